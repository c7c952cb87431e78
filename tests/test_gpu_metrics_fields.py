"""/gpu/metrics telemetry fields (read through the real pynvml from the fake libnvidia-ml),
both namings, and the pod part of the label set, parsed back with prometheus_client."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.kubelet import DeviceAssignment, PodResourcesSnapshot
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.reader import NvmlReader
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.state.attribution import attribute
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot
from tests import fakenvml
from tests.conftest import running_agent
from tests.conftest import settings as agent_settings
from tests.fakenvml.fixtures import FakeNvml
from tests.waiting import eventually

NOT_SUPPORTED = fakenvml.NVML_ERROR_NOT_SUPPORTED
# sample key → FakeGpu field; the reader's own, then those taken from the health read
READER_KEYS = {
    "enc_util": "util_enc",
    "dec_util": "util_dec",
    "energy_mj": "energy_mj",
    "sm_clock_mhz": "clock_sm",
    "mem_clock_mhz": "clock_mem",
    "pcie_replay": "pcie_replay",
}
HEALTH_KEYS = {
    "ecc_sbe_volatile": "ecc_vol_corr",
    "ecc_dbe_volatile": "ecc_vol_uncorr",
    "ecc_sbe_aggregate": "ecc_agg_corr",
    "ecc_dbe_aggregate": "ecc_agg_uncorr",
    "remapped_rows_correctable": "remap_corr",
    "remapped_rows_uncorrectable": "remap_unc",
    "row_remap_pending": "remap_pending",
    "row_remap_failure": "remap_failure",
    "clock_event_reasons": "clocks_event_reasons",
    "pcie_link_gen": "pcie_gen",
    "pcie_link_max_gen": "pcie_max_gen",
    "pcie_link_width": "pcie_width",
    "pcie_link_max_width": "pcie_max_width",
}
NEW_KEYS = READER_KEYS | HEALTH_KEYS


def distinct_gpu(i: int) -> fakenvml.FakeGpu:
    """An H100 whose every telemetry value is distinct, so a mixed-up field shows."""
    gpu = fakenvml.h100x8().gpus[i]
    for n, fake_key in enumerate(NEW_KEYS.values()):
        setattr(gpu, fake_key, 100 * (i + 1) + n + 1)
    gpu.energy_mj = 7_000_123_456 + i  # above 32 bits
    gpu.clocks_event_reasons = 0x10000000104  # above 32 bits: read as a 64-bit mask
    gpu.remap_pending, gpu.remap_failure = 1, 0
    return gpu


async def read(fake: FakeNvml, config: fakenvml.FakeNvmlConfig, lib: str | None = None) -> Any:
    fake.apply(config)
    source = NvmlSource(PynvmlApi(lib or str(fake.lib_path)))
    try:
        await source.init()
        return await source.read()
    finally:
        await source.close()


async def test_new_fields_read_through_pynvml(fake_nvml: FakeNvml) -> None:
    config = fakenvml.FakeNvmlConfig(gpus=[distinct_gpu(0), distinct_gpu(1)])
    reading = await read(fake_nvml, config)
    assert reading.errors == 0
    for gpu in config.gpus:
        values = reading.samples[gpu.uuid].values
        for key, fake_key in READER_KEYS.items():
            assert values[key] == getattr(gpu, fake_key), key
        assert not set(HEALTH_KEYS) & set(values)  # read once, by the health reader


async def test_unsupported_fields_are_absent_not_errors(fake_nvml: FakeNvml) -> None:
    bare = distinct_gpu(0)
    for fake_key in READER_KEYS.values():
        setattr(bare, fake_key, None)  # unset: the call answers NOT_SUPPORTED
    partial = distinct_gpu(1)
    partial.errors = {
        "nvmlDeviceGetTotalEnergyConsumption": NOT_SUPPORTED,
        "nvmlDeviceGetEncoderUtilization": NOT_SUPPORTED,
    }
    config = fakenvml.FakeNvmlConfig(gpus=[bare, partial])
    reading = await read(fake_nvml, config)
    assert reading.errors == 0
    assert not set(READER_KEYS) & set(reading.samples[bare.uuid].values)
    left = set(reading.samples[partial.uuid].values) & set(READER_KEYS)
    assert left == set(READER_KEYS) - {"energy_mj", "enc_util"}


async def scrape(agent: Agent) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}/gpu/metrics") as resp,
    ):
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


@pytest.mark.parametrize("naming", ["prometheus", "dcgm"])
async def test_fields_in_both_namings(fake_nvml: FakeNvml, naming: str) -> None:
    config = fakenvml.FakeNvmlConfig(gpus=[distinct_gpu(0), distinct_gpu(1)])
    bare = distinct_gpu(2)
    bare.util_enc = bare.util_dec = bare.pcie_replay = None  # GPU 2 lacks these
    bare.remap_corr = bare.remap_unc = bare.remap_pending = bare.remap_failure = None
    bare.ecc_agg_corr = bare.ecc_agg_uncorr = None
    bare.ecc_vol_corr = bare.ecc_vol_uncorr = None
    config.gpus.append(bare)
    fake_nvml.apply(config)
    s = agent_settings(metrics_naming=naming)
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent):
        await eventually(lambda: agent.renderer.seq >= 1)  # the first render is installed
        families = await scrape(agent)
    dcgm = naming == "dcgm"
    uuid_label = "UUID" if dcgm else "uuid"
    for spec in gpu_metrics.FIELDS:
        if spec.key not in NEW_KEYS:
            continue
        name = spec.dcgm_name if dcgm else spec.prom_name
        family = families[name.removesuffix("_total") if spec.counter and not dcgm else name]
        counter = spec.dcgm_counter if dcgm else spec.counter  # dcgm-exporter's types
        assert family.type == ("counter" if counter else "gauge"), name
        by_gpu = {s.labels[uuid_label]: s.value for s in family.samples}
        scale = spec.dcgm_scale if dcgm else spec.prom_scale
        for gpu in config.gpus:
            raw = getattr(gpu, NEW_KEYS[spec.key])
            if raw is None:
                assert gpu.uuid not in by_gpu, name  # skipped, not zero
            else:
                assert by_gpu[gpu.uuid] == pytest.approx(raw * scale), name
    # spot checks of units
    if dcgm:
        energy = families["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].samples[0].value
        assert energy == config.gpus[0].energy_mj  # millijoules, as dcgm-exporter
        assert families["DCGM_FI_DEV_SM_CLOCK"].samples[0].value == config.gpus[0].clock_sm
        assert {"pod", "namespace", "container", "GPU_I_ID", "GPU_I_PROFILE"} <= set(
            families["DCGM_FI_DEV_SM_CLOCK"].samples[0].labels
        )
    else:
        energy = families["gpuid_gpu_energy_joules"].samples[0].value
        assert energy == pytest.approx((config.gpus[0].energy_mj or 0) / 1000)
        hz = families["gpuid_gpu_sm_clock_hertz"].samples[0].value
        assert hz == (config.gpus[0].clock_sm or 0) * 1e6


def test_every_nvml_call_exists_in_both_backends() -> None:
    calls = [n for n, _ in inspect.getmembers(NvmlApi, inspect.isfunction) if not n.startswith("_")]
    assert {"clocks_event_reasons", "total_energy_mj", "pcie_replay_count"} <= set(calls)
    for backend in (PynvmlApi, SimulatedNvml):
        missing = [n for n in calls if not callable(getattr(backend, n, None))]
        assert not missing, backend.__name__


def test_simulated_node_reports_every_field() -> None:
    api = SimulatedNvml("mig", "node-a")
    api.init()
    reading = NvmlReader(api).read({})
    assert reading.errors == 0
    whole = next(g for g in reading.gpus if not g.mig_devices)
    want = {f.key for f in gpu_metrics.FIELDS} - set(HEALTH_KEYS)
    assert want <= set(reading.samples[whole.uuid].values)
    mig_gpu = next(g for g in reading.gpus if g.mig_devices)
    assert "gpu_util" not in reading.samples[mig_gpu.uuid].values  # not on MIG-enabled GPUs
    for mig in mig_gpu.mig_devices:
        assert reading.samples[mig.uuid].values["memory_total_bytes"] > 0


# ---- the pod part of the label set -------------------------------------------------------

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@given(st.lists(st.text(max_size=80), max_size=12))
def test_pod_label_columns_are_valid_and_distinct(keys: list[str]) -> None:
    columns = gpu_metrics.pod_label_columns(keys)
    names = [name for _, name in columns]
    assert len(names) == len(set(names))
    reserved = {n for n, _ in gpu_metrics.LABELS} | {"namespace", "pod", "container"}
    for key, name in columns:
        assert LABEL_NAME.fullmatch(name) and not name.startswith("__")
        assert name.startswith("label_") and name not in reserved
        assert key in keys
    # every key is either a column or collides with an earlier one
    assert {gpu_metrics.pod_label_name(k) for k in keys} == set(names)


def one_gpu() -> NodeInventory:
    return build_inventory(
        [GpuIdentity(index=0, uuid="GPU-00000000-0000-4000-8000-000000000000", name="H100")],
        node="node-a",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version="570",
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )


hostile = st.text(max_size=60)  # any code point, lone surrogates included


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(hostile, hostile, hostile), min_size=1, max_size=4, unique=True),
    st.dictionaries(st.sampled_from(["app", "team.example/owner", "tier"]), hostile, max_size=3),
    st.sampled_from(["prometheus", "dcgm"]),
)
def test_hostile_pod_values_render_and_parse_back(
    holders: list[tuple[str, str, str]], labels: dict[str, str], naming: Any
) -> None:
    inventory = one_gpu()
    uuid = inventory.gpus[0].uuid
    snapshot = PodResourcesSnapshot(
        tuple(
            DeviceAssignment(ns, p, c, "nvidia.com/gpu", f"{uuid}::{i}")
            for i, (ns, p, c) in enumerate(holders)
        )
    )
    meta = {(ns, p): PodMeta(ns, p, "uid", labels, "Deployment", "web") for ns, p, _ in holders}
    allow = ["app", "team.example/owner", "missing"]
    attribution = attribute(
        inventory, snapshot, pods=lambda ns, p: meta.get((ns, p)), label_allowlist=allow
    )
    renderer = MetricsRenderer(naming, allow, pods=meta)  # a pod directory: workload labels
    sample = GpuSample(uuid, {"temperature_celsius": 40.0})
    node = NodeSnapshot(
        seq=1,
        cause="collection",
        inventory=inventory,
        samples={uuid: sample},
        health=NodeHealth(),
        attribution=attribution,
    )
    text = gpu_metrics.expose(renderer.families(node), "text")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    name = "DCGM_FI_DEV_GPU_TEMP" if naming == "dcgm" else "gpuid_gpu_allocation_info"
    series = families[name].samples

    def clean(v: str) -> str:
        return v.encode("utf-8", "replace").decode("utf-8")

    want = {(clean(ns), clean(p), clean(c)) for ns, p, c in holders}
    got = {(s.labels["namespace"], s.labels["pod"], s.labels["container"]) for s in series}
    assert got == want
    for s in series:
        assert s.labels["workload_kind"] == "Deployment" and s.labels["workload_name"] == "web"
        assert s.labels["label_app"] == clean(labels.get("app", ""))
        assert s.labels["label_team_example_owner"] == clean(labels.get("team.example/owner", ""))
        assert s.labels["label_missing"] == ""
    holders_value = families["gpuid_gpu_holders"].samples[0].value
    assert holders_value == len(holders)


def test_gpu_sample_fields_are_not_pod_labels() -> None:
    """Label names from FIELDS, identity, MIG and pod parts never collide."""
    names = [p for p, _ in gpu_metrics.LABELS + gpu_metrics.MIG_LABELS + gpu_metrics.HOLDER_LABELS]
    names += [p for p, _ in gpu_metrics.WORKLOAD_LABELS]
    dcgm = [d for _, d in gpu_metrics.LABELS + gpu_metrics.MIG_LABELS + gpu_metrics.HOLDER_LABELS]
    assert len(names) == len(set(names)) and len(dcgm) == len(set(dcgm))
    assert all(dataclasses.is_dataclass(f) for f in gpu_metrics.FIELDS)
