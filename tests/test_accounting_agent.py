"""GPU accounting end to end: the C fake libnvidia-ml (energy counters, compute and MPS
processes with SM samples), a fake host /proc, the real kube-apiserver (pods and this node's
ResourceSlice in resource.k8s.io/v1, read with the agent's pod-bound token under the chart's
RBAC) and the kubelet's own pod-resources server (Go, `real_kubelet`). A time-sliced GPU is
split by measured SM share, a whole GPU counts 1 per second, unheld GPUs count as idle, energy
splits the GPUs' own counter deltas, and a pod leaving mid-interval ends with what it used, its
usage records adding up to its end's totals. No stand-in: nothing here is a fault."""

from __future__ import annotations

import io
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.serving.renderer import Rendered
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import test_dra_agent as dra
from tests.conftest import running_agent, settings
from tests.fakekube import objects
from tests.fakekubelet import ClaimDevice, KubeletClaim, claim_pod
from tests.fakenvml.fixtures import FakeNvml
from tests.fakeproc import FakeProc
from tests.realkube.kubelet import KubeletServer
from tests.test_process_agent import Api, api, scenario  # noqa: F401  (fixture and scene reused)
from tests.waiting import eventually

INTERVAL = 0.1  # COLLECT_INTERVAL: the tolerance of held time is one of it
WINDOW = 2.0  # of the reads' own time, between the two looks at the totals
DRIVER = "gpu.nvidia.com"
# NVIDIA's name of the 3g.40gb MIG device (profile 9) at memory slice 0 of GPU 0: a DNS label
BIG_MIG = "gpu-0-mig-9-0-4"


async def served(agent: Agent) -> Rendered:
    """/gpu/metrics as a scrape gets it now, with the snapshot it is of."""
    rendered = await agent.renderer.rendered()
    assert rendered.snapshot is not None
    return rendered


def read_time(rendered: Rendered) -> float:
    """When the NVML read of the page was taken (reads are stamped as they end)."""
    assert rendered.snapshot is not None
    return rendered.snapshot.inventory.read_time.timestamp()


async def served_read_after(agent: Agent, moment: float) -> float:
    """The read time of what /gpu/metrics serves, once it is later than `moment` (else 0)."""
    rendered = await agent.renderer.rendered()
    t = 0.0 if rendered.snapshot is None else read_time(rendered)
    return t if t > moment else 0.0


async def reads_after(agent: Agent, moment: float) -> None:
    """Wait until /gpu/metrics serves an NVML read begun after `moment` (wall clock): the one
    after the first read stamped later, which may have begun before it."""
    first = await eventually(lambda: served_read_after(agent, moment))
    await eventually(lambda: served_read_after(agent, first))


async def counted(agent: Agent, name: str, pod: str) -> bool:
    """/gpu/metrics serves a count above 0 of counter `name` for `pod`."""
    return per_pod((await agent.renderer.rendered()).text, name).get(pod, 0) > 0


def per_pod(text: bytes, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("pod", "") or s.labels["namespace"]] += s.value
    return out


def records(out: io.BytesIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines() if line.strip()]


async def test_shares_energy_and_churn_add_up(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    api: Api,  # noqa: F811
    tmp_path: Path,
) -> None:
    proc = FakeProc(tmp_path / "proc")
    config, real_kubelet.pods = scenario(api, proc)
    real_kubelet.publish()
    fake_nvml.apply(config)
    out = io.BytesIO()
    agent = Agent(
        settings(
            node_name=api.node,
            kube_api="auto",
            pod_resources_socket=real_kubelet.socket_path,
            pod_resources_interval=0.05,
            process_attribution=True,
            host_proc=str(proc.root),
            collect_interval=INTERVAL,
            accounting_per_pod=True,
            accounting_interval=1.0,
        ),
        nvml_api=PynvmlApi(str(fake_nvml.lib_path)),
        exporters=[StdoutExporter(out)],
    )
    seconds, joules = "gpuid_pod_gpu_seconds_total", "gpuid_pod_gpu_energy_joules_total"
    async with running_agent(agent):
        await eventually(lambda: counted(agent, seconds, "serve"))
        first = await served(agent)
        before, t0 = per_pod(first.text, seconds), read_time(first)
        e_before = per_pod(first.text, joules)
        g0, g1 = config.gpus[0], config.gpus[1]
        g0.energy_mj = (g0.energy_mj or 0) + 800_000  # 800 J on the time-sliced GPU
        g1.energy_mj = (g1.energy_mj or 0) + 300_000  # 300 J on the notebook's
        fake_nvml.apply(config)
        await reads_after(agent, max(time.time(), t0 + WINDOW))  # the counters' jump is in
        last = await served(agent)
        after, t1 = per_pod(last.text, seconds), read_time(last)
        e_after = per_pod(last.text, joules)
        # serve leaves mid-interval: its end carries what it used
        real_kubelet.pods = [p for p in real_kubelet.pods if p.name != "serve"]
        real_kubelet.publish()
        await eventually(lambda: any(r.get("event") == "end" for r in records(out)))
        workloads = per_pod((await served(agent)).text, "gpuid_workload_gpu_seconds_total")
    held = t1 - t0
    d = {k: after[k] - before.get(k, 0) for k in after}
    # GPU 0: split by measured SM share (train 50 %, serve 30 % via MPS: 5/8 and 3/8)
    assert d["train"] + d["serve"] == pytest.approx(held, abs=INTERVAL + 0.15)
    assert d["train"] / (d["train"] + d["serve"]) == pytest.approx(5 / 8, rel=0.01)
    assert d["notebook"] == pytest.approx(held, abs=INTERVAL + 0.15)  # a whole GPU, idle
    e = {k: e_after[k] - e_before.get(k, 0) for k in e_after}
    assert e["train"] + e["serve"] == pytest.approx(800, rel=0.01)
    assert e["train"] == pytest.approx(500, rel=0.01)
    assert e["notebook"] == pytest.approx(300, rel=0.01)
    assert workloads[""] > 0  # the idle row: GPUs 2-7
    sent = records(out)
    end = next(r for r in sent if r.get("event") == "end" and r["pod"] == "serve")
    usage = [r for r in sent if r.get("event") == "usage" and r["pod"] == "serve"]
    assert end["gpu_seconds"] > 0 and end["energy_joules"] > 0
    assert len(usage) >= 2  # one per 1 s period, then the last partial one
    assert len({r["record_id"] for r in usage}) == len(usage)
    assert sum(r["gpu_seconds"] for r in usage) == pytest.approx(end["gpu_seconds"], abs=0.01)
    assert sum(r["energy_joules"] for r in usage) == pytest.approx(end["energy_joules"], abs=0.01)
    assert all(r["usage_start"] <= r["read_time"] for r in usage)


def by_labels(text: bytes, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(s.labels[k] for k in keys)] += s.value
    return out


def node_slice(config: Any, node: str) -> dict[str, Any]:
    """This node's ResourceSlice of NVIDIA's driver: GPUs 0-2 and GPU 0's 3g.40gb device."""
    gpu0 = config.gpus[0]
    devices = [objects.gpu_device(f"gpu-{i}", g.uuid or "") for i, g in enumerate(config.gpus)]
    devices.append(objects.gpu_device(BIG_MIG, gpu0.mig[0].uuid or "", parent_uuid=gpu0.uuid))
    return objects.resource_slice(f"{node}-{DRIVER}", node, devices)


def claim_pods(node: str) -> list[Any]:
    """The pods of the claims the scheduler allocated from that slice, as the kubelet reports
    them, and a NIC driver's claim beside them."""

    def claim(namespace: str, name: str, device: str, driver: str = DRIVER) -> KubeletClaim:
        return KubeletClaim(namespace, name, (ClaimDevice(driver, node, device),))

    shared = claim("ml", "shared-gpu", "gpu-2")
    return [
        claim_pod("ml", "train-0", "trainer", claim("ml", "train-gpu", "gpu-1")),
        claim_pod("ml", "serve-a", "server", shared),
        claim_pod("ml", "serve-b", "server", shared),
        claim_pod("research", "big", "w", claim("research", "big-mig", BIG_MIG)),
        claim_pod("net", "rdma", "c", claim("net", "nic", "eth1", "dra.net")),
    ]


async def test_mig_fraction_and_a_dra_claim_shared_by_two_pods(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    api: Api,  # noqa: F811
) -> None:
    """GPU 0 in MIG mode: its 3g.40gb device (claimed by research/big) is 3/7 of the GPU, the
    unclaimed 1g.10gb and the unconfigured slices idle; GPU 1 whole (train-0); GPU 2 through
    one claim shared by serve-a and serve-b, half each."""
    config = dra.nvml_config()
    fake_nvml.apply(config)
    real_kubelet.pods = claim_pods(api.node)
    real_kubelet.publish()
    api.admin.create("/apis/resource.k8s.io/v1/resourceslices", node_slice(config, api.node))
    agent = Agent(
        settings(
            node_name=api.node,
            kube_api="auto",
            pod_resources_socket=real_kubelet.socket_path,
            pod_resources_interval=0.05,
            collect_interval=INTERVAL,
            accounting_per_pod=True,
        ),
        nvml_api=PynvmlApi(str(fake_nvml.lib_path)),
        exporters=[StdoutExporter(io.BytesIO())],
    )
    pod_s, pod_j = "gpuid_pod_gpu_seconds_total", "gpuid_pod_gpu_energy_joules_total"
    async with running_agent(agent):
        await eventually(lambda: counted(agent, pod_s, "big"), within=20)
        first = await served(agent)
        before, t0 = per_pod(first.text, pod_s), read_time(first)
        e_before = per_pod(first.text, pod_j)
        w_before = by_labels(first.text, "gpuid_workload_device_seconds_total", "claim")
        g0, g2 = config.gpus[0], config.gpus[2]
        g0.energy_mj = (g0.energy_mj or 0) + 700_000
        g2.energy_mj = (g2.energy_mj or 0) + 400_000
        fake_nvml.apply(config)
        await reads_after(agent, max(time.time(), t0 + WINDOW))  # the counters' jump is in
        last = await served(agent)
        after, t1 = per_pod(last.text, pod_s), read_time(last)
        e_after = per_pod(last.text, pod_j)
        w_after = by_labels(last.text, "gpuid_workload_device_seconds_total", "claim")
    held = t1 - t0
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["big"] == pytest.approx(held * 3 / 7, abs=INTERVAL)
    assert d["train-0"] == pytest.approx(held, abs=INTERVAL)
    assert d["serve-a"] + d["serve-b"] == pytest.approx(held, abs=INTERVAL)
    assert d["serve-a"] == pytest.approx(d["serve-b"], rel=0.01)
    # the MIG device held alone: one device-second per second, its claim's series
    device = w_after[("big-mig",)] - w_before.get(("big-mig",), 0)
    assert device == pytest.approx(held, abs=INTERVAL)
    shared = w_after[("shared-gpu",)] - w_before.get(("shared-gpu",), 0)
    assert shared == pytest.approx(held, abs=INTERVAL)  # one series for the claim's two pods
    e = {k: e_after[k] - e_before.get(k, 0) for k in e_after}
    assert e["big"] == pytest.approx(300, rel=0.01)
    assert e["serve-a"] == pytest.approx(200, rel=0.01)
    assert e["serve-b"] == pytest.approx(200, rel=0.01)
