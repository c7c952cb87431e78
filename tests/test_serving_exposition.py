"""Our writers put out exactly what prometheus_client writes for the same families: its
text `generate_latest` and its OpenMetrics `generate_latest`, run here as the reference."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from gpuid_agent.facts import GpuIdentity, GpuSample, MigDevice, NvLink, PcieAer
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.exposition import Family, write_openmetrics, write_text
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.health.verdicts import CheckStatus, GpuHealth, NodeHealth
from gpuid_agent.state.inventory import build_inventory

hostile = st.text(max_size=40)  # any code point: quotes, backslashes, newlines, surrogates
# what the formats escape or could trip on, often, and any code point besides
tricky = st.text(st.sampled_from('a"\\\n{},= é') | st.characters(), max_size=20)
holders = st.lists(
    st.builds(
        Holder,
        hostile,
        hostile,
        hostile,
        workload_kind=hostile,
        workload_name=hostile,
        labels=st.tuples(st.tuples(st.just("app"), hostile)),
    ),
    max_size=4,
)
values = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**60), 2**60)


class _Collected(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def as_library(family: Family) -> Metric:
    """The same family built as prometheus_client's own object, sample by sample."""
    if family.type == "counter" and not family.bare:
        made: Metric = CounterMetricFamily(family.name, family.help, labels=family.labelnames)
    else:  # a bare counter goes through as a gauge: the library cannot write one
        made = GaugeMetricFamily(family.name, family.help, labels=family.labelnames)
    for row_values, value in family.rows:
        made.add_metric(row_values, value)  # type: ignore[attr-defined]
    return made


def reference(families: list[Family], fmt: gpu_metrics.Format) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected([as_library(f) for f in families]))
    if fmt == "openmetrics":
        return openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call,no-any-return]
    text = generate_latest(registry).decode()
    for family in families:
        if family.bare:  # its TYPE line set back
            text = text.replace(f"# TYPE {family.name} gauge\n", f"# TYPE {family.name} counter\n")
    return text.encode()


def inventory(mig: bool) -> Any:
    gpus = [
        GpuIdentity(index=0, uuid="GPU-a", name='H100 "SXM"\\x', serial="s\n1"),
        GpuIdentity(
            index=1,
            uuid="GPU-b",
            mig_devices=(MigDevice(index=0, uuid="MIG-b1", gpu_instance_id=1, profile="1g.10gb"),)
            if mig
            else (),
        ),
    ]
    return build_inventory(
        gpus,
        node="node-a",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version="570",
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )


def health(count: int) -> NodeHealth:
    status = CheckStatus("degraded", 'a "reason"', "reboot", datetime.now(UTC))
    gpu = GpuHealth(
        index=0,
        uuid="GPU-a",
        serial="s\n1",
        state="degraded",
        action="reboot",
        checks=MappingProxyType({"xid": status}),
        xid_counts=MappingProxyType({79: count, 13: 1}),
        last_xid=79,
        nvlinks=(NvLink(0, True, (count, 0, None, 1)), NvLink(1, False)),
        pcie_aer=PcieAer(count, None, 0),
    )
    return NodeHealth((gpu,), MappingProxyType({"gpu_count": status}))


@settings(max_examples=100, deadline=None)
@given(
    holders,
    holders,
    st.sampled_from(["prometheus", "dcgm"]),
    st.booleans(),
    values,
    st.integers(0, 2**40),
)
def test_same_bytes_as_prometheus_client(
    first: list[Holder], second: list[Holder], naming: Any, mig: bool, value: float, count: int
) -> None:
    inv = inventory(mig)
    by_device = {"GPU-a": tuple(first), "MIG-b1" if mig else "GPU-b": tuple(second)}
    keys = ["temperature_celsius", "energy_mj", "memory_used_bytes", "pcie_replay"]
    samples = {
        uuid: GpuSample(uuid, {k: value for k in keys}) for uuid in ("GPU-a", "GPU-b", "MIG-b1")
    }
    options = gpu_metrics.RenderOptions(
        workload_labels=True, pod_labels=gpu_metrics.pod_label_columns(["app", "missing"])
    )
    families = gpu_metrics.collect(
        inv,
        samples,
        naming,
        health(count),
        attribution=Attribution("current", by_device=by_device),
        options=options,
    )
    assert gpu_metrics.expose(families, "text") == reference(families, "text")
    if naming == "prometheus":  # dcgm naming is served as text only
        assert gpu_metrics.expose(families, "openmetrics") == reference(families, "openmetrics")


names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True)


@st.composite
def families(draw: st.DrawFn) -> list[Family]:
    """Families of any valid names, hostile help texts and label values, any values; label
    sets repeated within and across families, as the dcgm layout repeats them."""
    made = []
    for name in draw(st.lists(names, max_size=4, unique=True)):
        labelnames = draw(st.lists(names, max_size=5, unique=True))
        kind = draw(st.sampled_from(["gauge", "counter"]))
        family = Family(name, draw(tricky), kind, labelnames)
        rows = draw(
            st.lists(
                st.tuples(
                    st.lists(tricky, min_size=len(labelnames), max_size=len(labelnames)), values
                ),
                max_size=4,
            )
        )
        for row_values, value in rows:
            for _ in range(draw(st.integers(1, 3))):
                family.add_metric(row_values, value)
        made.append(family)
    return made


@settings(max_examples=100, deadline=None)
@given(families())
def test_any_family_writes_as_prometheus_client_writes_it(made: list[Family]) -> None:
    try:
        want_text = reference(made, "text")
    except UnicodeEncodeError:  # lone surrogates: neither writer can encode them
        with pytest.raises(UnicodeEncodeError):
            write_text(made)
        return
    assert write_text(made) == want_text
    assert write_openmetrics(made) == reference(made, "openmetrics")


def test_dcgm_counters_keep_their_bare_names_in_text_only() -> None:
    inv = inventory(False)
    samples = {"GPU-a": GpuSample("GPU-a", {"energy_mj": 5.0, "pcie_replay": 2.0})}
    dcgm = gpu_metrics.collect(inv, samples, "dcgm")
    text = write_text(dcgm).decode()
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter\n" in text
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and "_total" not in text
    with pytest.raises(ValueError, match="not OpenMetrics"):
        write_openmetrics(dcgm)


def test_counter_names_are_exposed_with_total_once() -> None:
    family = Family("jobs_total", "Jobs.", "counter", ["queue"])
    family.add_metric(["a"], 3)
    assert family.name == "jobs"
    assert (
        write_text([family])
        == b'# HELP jobs_total Jobs.\n# TYPE jobs_total counter\njobs_total{queue="a"} 3.0\n'
    )
    assert write_openmetrics([family]).startswith(b"# HELP jobs Jobs.\n# TYPE jobs counter\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("h", "a histogram", "histogram", []), "histogram"),
        (("g", "a gauge", "gauge", [], True), "gauge"),
        (("bad-name", "x", "gauge", []), "invalid"),
        (("g", "x", "gauge", ["pod", "pod"]), "repeated"),
        (("g", "x", "gauge", ["0pod"]), "invalid"),
    ],
)
def test_families_it_does_not_handle_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Family(*args[:4], bare=args[4] if len(args) > 4 else False)


def test_a_row_with_the_wrong_number_of_values_is_refused() -> None:
    family = Family("g", "x", "gauge", ["a", "b"])
    with pytest.raises(ValueError, match="1 values"):
        family.add_metric(["only one"], 1)
