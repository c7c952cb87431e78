"""The fast text exposition writes exactly what prometheus_client's generate_latest writes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric

from gpuid_agent.facts import GpuIdentity, GpuSample, MigDevice
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.text_exposition import BareCounterFamily, write_text
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.inventory import build_inventory

hostile = st.text(max_size=40)  # any code point: quotes, backslashes, newlines, surrogates
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


@settings(max_examples=100, deadline=None)
@given(
    holders,
    holders,
    st.sampled_from(["prometheus", "dcgm"]),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
)
def test_same_bytes_as_prometheus_client(
    first: list[Holder], second: list[Holder], naming: Any, mig: bool, value: float
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
        attribution=Attribution("current", by_device=by_device),
        options=options,
    )
    assert write_text(families) == reference(families)


def reference(families: list[Metric]) -> bytes:
    """generate_latest's bytes. It cannot write a counter without `_total` (dcgm-exporter's
    counters): such a family goes through as a gauge, and its TYPE line is set back."""
    bare = {f.name for f in families if isinstance(f, BareCounterFamily)}
    as_gauges = []
    for family in families:
        if family.name in bare:
            gauge = Metric(family.name, family.documentation, "gauge")
            gauge.samples = family.samples
            family = gauge
        as_gauges.append(family)
    text = generate_latest(gpu_metrics.as_registry(as_gauges)).decode()
    for name in bare:
        text = text.replace(f"# TYPE {name} gauge\n", f"# TYPE {name} counter\n")
    return text.encode()


def test_dcgm_counters_keep_their_bare_names() -> None:
    inv = inventory(False)
    samples = {"GPU-a": GpuSample("GPU-a", {"energy_mj": 5.0, "pcie_replay": 2.0})}
    text = write_text(gpu_metrics.collect(inv, samples, "dcgm")).decode()
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter\n" in text
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and "_total" not in text


def test_families_it_does_not_handle_are_refused() -> None:
    histogram = HistogramMetricFamily("h", "a histogram", buckets=[("+Inf", 1)], sum_value=1)
    with pytest.raises(ValueError, match="histogram"):
        write_text([histogram])
