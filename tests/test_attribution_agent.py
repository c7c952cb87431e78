"""Pods on GPUs end to end: fake libnvidia-ml (real pynvml) + the kubelet's own pod-resources
server (Go, `real_kubelet`) + the agent, asserted by parsing /gpu/metrics with
prometheus_client's text parser.

The Python stand-in kubelet (`tests/fakekubelet`) stays for the one test whose point is a
fault and a call log: a scrape must not reach the kubelet, shown by a kubelet that would answer
List 30 s late and by its count of calls staying the same
(`test_a_scrape_only_serves_prepared_bytes`). Nothing here uses the API server."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, serves, settings
from tests.fakekubelet import FakeKubelet, KubeletPod, pod
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually

Holders = set[tuple[str, str, str]]
NOBODY: Holders = {("", "", "")}


def make_agent(fake: FakeNvml, kubelet: FakeKubelet | KubeletServer, **overrides: Any) -> Agent:
    s = settings(
        pod_resources_socket=kubelet.socket_path,
        pod_resources_interval=0.05,
        **overrides,
    )
    return Agent(
        s, nvml_api=PynvmlApi(str(fake.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )


def polls(agent: Agent) -> float:
    """The agent's answered pod-resources polls."""
    sample = agent.metrics.registry.get_sample_value(
        "gpuid_pod_resources_polls_total", {"outcome": "ok"}
    )
    return sample or 0


async def rendered_with_pods(agent: Agent) -> bool:
    """/gpu/metrics serves at least one holder."""
    return await serves(agent, b"gpuid_gpu_allocation_info{")


async def scrape(agent: Agent, path: str = "/gpu/metrics") -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as resp,
    ):
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def holders(
    families: dict[str, Any], family: str = "gpuid_gpu_temperature_celsius"
) -> dict[tuple[str, str], Holders]:
    """(GPU UUID, GPU instance id) → {(namespace, pod, container)}: from the telemetry series
    themselves in dcgm naming, from gpuid_gpu_allocation_info joined on (uuid,
    gpu_instance_id) in Prometheus naming; NOBODY for a device with telemetry and no holder."""
    dcgm = "DCGM_FI_DEV_INFO" in families
    if dcgm:
        family = {
            "gpuid_gpu_temperature_celsius": "DCGM_FI_DEV_GPU_TEMP",
            "gpuid_gpu_memory_used_bytes": "DCGM_FI_DEV_FB_USED",
        }[family]
    uuid, gi = ("UUID", "GPU_I_ID") if dcgm else ("uuid", "gpu_instance_id")
    out: dict[tuple[str, str], Holders] = {}
    for s in families[family].samples:
        key = (s.labels[uuid], s.labels[gi])
        who = {(s.labels["namespace"], s.labels["pod"], s.labels["container"])} if dcgm else set()
        out.setdefault(key, set()).update(who)
    if not dcgm:
        assert not {"pod", "namespace", "container"} & set(families[family].samples[0].labels)
        for s in families["gpuid_gpu_allocation_info"].samples:
            key = (s.labels["uuid"], s.labels["gpu_instance_id"])
            assert key in out, key  # every allocation joins a telemetry series
            out[key].add((s.labels["namespace"], s.labels["pod"], s.labels["container"]))
    return {key: who or NOBODY for key, who in out.items()}


@dataclass
class Scenario:
    nvml: Callable[[], fakenvml.FakeNvmlConfig]
    pods: Callable[[fakenvml.FakeNvmlConfig], list[KubeletPod]]
    want: Callable[[fakenvml.FakeNvmlConfig], dict[tuple[str, str], Holders]]
    family: str = "gpuid_gpu_temperature_celsius"


def _uuids(config: fakenvml.FakeNvmlConfig) -> list[str]:
    return [g.uuid or "" for g in config.gpus]


def _migs(config: fakenvml.FakeNvmlConfig) -> list[str]:
    return [m.uuid or "" for m in config.gpus[0].mig]


def _whole(
    config: fakenvml.FakeNvmlConfig, held: dict[int, Holders]
) -> dict[tuple[str, str], Holders]:
    return {(u, ""): held.get(i, NOBODY) for i, u in enumerate(_uuids(config))}


TRAIN = ("ml", "train-0", "trainer")
NOTEBOOK = ("default", "notebook", "jupyter")
SERVE = [("inference", f"serve-{r}", "server") for r in range(3)]

SCENARIOS = {
    "uuid": Scenario(
        fakenvml.h100x8,
        lambda c: [
            pod(*TRAIN[:2], TRAIN[2], "nvidia.com/gpu", *_uuids(c)[:4]),
            pod(*NOTEBOOK[:2], NOTEBOOK[2], "nvidia.com/gpu", _uuids(c)[4]),
        ],
        lambda c: _whole(c, {0: {TRAIN}, 1: {TRAIN}, 2: {TRAIN}, 3: {TRAIN}, 4: {NOTEBOOK}}),
    ),
    "index": Scenario(
        fakenvml.h100x8,
        lambda c: [
            pod(*TRAIN[:2], TRAIN[2], "nvidia.com/gpu", "6", "7"),
            pod(*NOTEBOOK[:2], NOTEBOOK[2], "nvidia.com/gpu", "0"),
        ],
        lambda c: _whole(c, {6: {TRAIN}, 7: {TRAIN}, 0: {NOTEBOOK}}),
    ),
    "shared-by-three": Scenario(
        fakenvml.h100x8,
        lambda c: (
            [
                pod(*SERVE[r][:2], SERVE[r][2], "nvidia.com/gpu", f"{_uuids(c)[0]}::{r}")
                for r in range(3)
            ]
            # two replicas of one GPU in one container: still one holder
            + [
                pod(
                    *NOTEBOOK[:2],
                    NOTEBOOK[2],
                    "nvidia.com/gpu.shared",
                    f"{_uuids(c)[1]}::0",
                    f"{_uuids(c)[1]}::1",
                )
            ]
        ),
        lambda c: _whole(c, {0: set(SERVE), 1: {NOTEBOOK}}),
    ),
    "mig": Scenario(
        fakenvml.mig_h100,
        lambda c: [
            pod("research", "big", "w", "nvidia.com/mig-3g.40gb", _migs(c)[0]),
            pod("research", "small", "w", "nvidia.com/mig-1g.10gb", f"{_migs(c)[1]}::0"),  # EKS
        ],
        lambda c: {
            (_uuids(c)[0], ""): NOBODY,  # the parent GPU's own series carry no pod
            (_uuids(c)[0], "2"): {("research", "big", "w")},
            (_uuids(c)[0], "9"): {("research", "small", "w")},
        },
        family="gpuid_gpu_memory_used_bytes",
    ),
    "gke": Scenario(
        fakenvml.h100x8,
        lambda c: [
            pod(*TRAIN[:2], TRAIN[2], "nvidia.com/gpu", "nvidia0", "nvidia1"),
            pod(*SERVE[0][:2], SERVE[0][2], "nvidia.com/gpu", "nvidia2/vgpu0"),
            pod(*SERVE[1][:2], SERVE[1][2], "nvidia.com/gpu", "nvidia2/vgpu1"),
        ],
        lambda c: _whole(c, {0: {TRAIN}, 1: {TRAIN}, 2: set(SERVE[:2])}),
    ),
    "gke-mig": Scenario(
        fakenvml.mig_h100,
        lambda c: [
            pod("research", "big", "w", "nvidia.com/mig-3g.40gb", "nvidia0/gi2"),
            pod("research", "small", "w", "nvidia.com/mig-1g.10gb", "nvidia0/gi9"),
        ],
        lambda c: {
            (_uuids(c)[0], ""): NOBODY,
            (_uuids(c)[0], "2"): {("research", "big", "w")},
            (_uuids(c)[0], "9"): {("research", "small", "w")},
        },
        family="gpuid_gpu_memory_used_bytes",
    ),
}


@pytest.mark.parametrize("naming", ["prometheus", "dcgm"])
@pytest.mark.parametrize("name", SCENARIOS)
async def test_device_id_scenarios(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, name: str, naming: str
) -> None:
    scenario = SCENARIOS[name]
    config = scenario.nvml()
    fake_nvml.apply(config)
    real_kubelet.pods = scenario.pods(config)
    real_kubelet.publish()
    want = scenario.want(config)
    agent = make_agent(fake_nvml, real_kubelet, metrics_naming=naming)
    async with running_agent(agent):
        await eventually(lambda: rendered_with_pods(agent))
        families = await scrape(agent)
    assert holders(families, scenario.family) == want
    assert not agent.attributor.current.unmapped
    for s in families["gpuid_gpu_holders"].samples:  # a gpuid_* family: snake_case labels
        key = (s.labels["uuid"], s.labels["gpu_instance_id"])
        assert s.value == len(want[key] - NOBODY), key


async def test_mig_series_carry_instance_labels_and_memory(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = fakenvml.mig_h100()
    fake_nvml.apply(config)
    mig = config.gpus[0].mig
    real_kubelet.pods = [pod("research", "big", "w", "nvidia.com/mig-3g.40gb", mig[0].uuid or "")]
    real_kubelet.publish()
    agent = make_agent(fake_nvml, real_kubelet, metrics_naming="dcgm")
    async with running_agent(agent):
        await eventually(lambda: rendered_with_pods(agent))
        families = await scrape(agent)
    used = {s.labels["GPU_I_ID"]: s for s in families["DCGM_FI_DEV_FB_USED"].samples}
    assert set(used) == {"", "2", "9"}
    assert used["2"].labels["GPU_I_PROFILE"] == "3g.40gb"
    assert used["2"].labels["pod"] == "big" and used["2"].labels["namespace"] == "research"
    assert used["2"].value == (mig[0].mem_used or 0) / (1024 * 1024)
    assert used["9"].labels["GPU_I_PROFILE"] == "1g.10gb" and used["9"].labels["pod"] == ""
    assert used["2"].labels["UUID"] == config.gpus[0].uuid  # dcgm-exporter: the parent's UUID


async def test_unknown_and_malformed_ids_are_counted_not_fatal(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    good = config.gpus[0].uuid or ""
    real_kubelet.pods = [
        pod("a", "good", "c", "nvidia.com/gpu", good),
        pod("a", "bad", "c", "nvidia.com/gpu", "GPU-zzz", "", "9999", "nvidia0/gi", "\u00e9"),
        pod("a", "ghost", "c", "nvidia.com/gpu", "GPU-deadbeef-0000"),
    ]
    real_kubelet.publish()
    async with running_agent(make_agent(fake_nvml, real_kubelet)) as agent:
        await eventually(lambda: agent.attributor.current.unmapped)
        await eventually(lambda: rendered_with_pods(agent))
        families = await scrape(agent)
        own = await scrape(agent, "/metrics")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/status") as resp,
        ):
            status = orjson.loads(await resp.read())
        # the same bad ids polled again and again: logged once
        answered = polls(agent)
        await eventually(lambda: polls(agent) >= answered + 5)
        assert not agent.supervisor.problems()
    assert holders(families)[(good, "")] == {("a", "good", "c")}
    reasons = {
        s.labels["reason"]: s.value
        for s in own["gpuid_attribution_unmapped_devices"].samples
        if s.value
    }
    assert reasons == {"unknown_form": 2, "empty": 1, "unknown_gpu": 2, "bad_characters": 1}
    assert len(status["attribution"]["unmapped"]) == 6
    warnings = [r for r in caplog.records if r.getMessage() == "kubelet device ids not attributed"]
    assert len(warnings) == 1


async def test_a_new_pod_is_rendered_without_waiting_for_nvml(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    agent = make_agent(fake_nvml, real_kubelet, collect_interval=3600)
    async with running_agent(agent):
        await eventually(lambda: agent.renderer.seq >= 1)  # the first render is installed
        families = await scrape(agent)
        assert holders(families)[(config.gpus[3].uuid, "")] == NOBODY
        real_kubelet.pods = [pod("a", "late", "c", "nvidia.com/gpu", config.gpus[3].uuid or "")]
        real_kubelet.publish()
        await eventually(lambda: rendered_with_pods(agent))
        families = await scrape(agent)
    assert holders(families)[(config.gpus[3].uuid, "")] == {("a", "late", "c")}


async def test_a_scrape_only_serves_prepared_bytes(
    fake_nvml: FakeNvml, kubelet: FakeKubelet
) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", config.gpus[0].uuid or "")]
    async with running_agent(make_agent(fake_nvml, kubelet)) as agent:
        await eventually(lambda: rendered_with_pods(agent))
        await agent.supervisor.stop("collector", "pod-resources", "attribution")
        calls = dict(kubelet.calls)
        kubelet.behaviour.delay["List"] = 30.0  # a scrape that asked the kubelet would hang
        async with aiohttp.ClientSession() as http:
            bodies = set()
            for _ in range(20):
                async with http.get(f"http://127.0.0.1:{agent.bound_port}/gpu/metrics") as resp:
                    bodies.add(await resp.read())
    assert dict(kubelet.calls) == calls
    assert len(bodies) == 1
    assert b'pod="p"' in bodies.pop()


async def test_two_gpus_with_one_uuid_are_reported_and_attributed_to_neither(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = fakenvml.h100x8()
    shared = config.gpus[0].uuid or ""
    config.gpus[1].uuid = shared  # a driver or firmware fault NVML passes on
    fake_nvml.apply(config)
    other = config.gpus[2].uuid or ""
    real_kubelet.pods = [
        pod("a", "by-uuid", "c", "nvidia.com/gpu", shared),
        pod("a", "by-index", "c", "nvidia.com/gpu", "1"),
        pod("a", "fine", "c", "nvidia.com/gpu", other),
    ]
    real_kubelet.publish()
    out = io.BytesIO()
    agent = Agent(
        settings(pod_resources_socket=real_kubelet.socket_path, pod_resources_interval=0.05),
        nvml_api=PynvmlApi(str(fake_nvml.lib_path)),
        exporters=[StdoutExporter(out)],
    )
    async with running_agent(agent):
        await eventually(lambda: len(agent.attributor.current.unmapped) == 2)
        await eventually(lambda: rendered_with_pods(agent))
        families = await scrape(agent)
        own = await scrape(agent, "/metrics")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/status") as resp,
        ):
            status = orjson.loads(await resp.read())
    nvml = status["components"]["nvml"]
    assert (
        nvml["state"] == "degraded"
        and f"GPUs 0, 1 report one UUID {shared.lower()}" in (nvml["reason"])
    )
    errors = {s.labels["reason"]: s.value for s in own["gpuid_collection_errors"].samples}
    assert errors["duplicate_uuid"] >= 1
    unmapped = {(u["pod"], u["reason"]) for u in status["attribution"]["unmapped"]}
    assert unmapped == {("a/by-uuid", "ambiguous_uuid"), ("a/by-index", "ambiguous_uuid")}
    # neither GPU's series names a holder of the shared UUID; the others are as usual
    seen = holders(families)
    assert seen[(shared, "")] == NOBODY and seen[(other, "")] == {("a", "fine", "c")}
    # each GPU keeps its own index-based identity in the records
    records = [orjson.loads(line) for line in out.getvalue().splitlines()]
    readings = {(r["index"], r["pci_bus_id"]) for r in records if r.get("uuid") == shared}
    assert {index for index, _ in readings} == {0, 1} and len(readings) == 2
    allocations = [r for r in records if r["kind"] == "allocation"]
    assert {r["pod"] for r in allocations} == {"fine"}
