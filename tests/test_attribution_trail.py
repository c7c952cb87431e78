"""The allocation trail through the real pipeline: starts, ends, and agent restarts, with the
kubelet's own pod-resources server (Go, `real_kubelet`) saying who holds which GPU.

The Python stand-in kubelet (`tests/fakekubelet`) stays where the kubelet being down is the
point (`test_an_unreachable_kubelet_ends_nothing`: stopped and started again mid-test). Nothing
here uses the API server."""

from __future__ import annotations

import io
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.allocations import (
    AllocationTrail,
    TrailIdentity,
    allocation_record_id,
)
from gpuid_agent.records.serialize import rfc3339, to_wire
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.kubelet import DeviceAssignment, PodResourcesSnapshot
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.state.allocation_trail import STATE_FILE
from gpuid_agent.state.attribution import attribute
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekubelet import FakeKubelet, pod
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.test_attribution_agent import polls
from tests.waiting import eventually


def make_agent(
    fake: FakeNvml, kubelet: FakeKubelet | KubeletServer, out: io.BytesIO, **overrides: Any
) -> Agent:
    s = settings(pod_resources_socket=kubelet.socket_path, pod_resources_interval=0.05, **overrides)
    return Agent(s, nvml_api=PynvmlApi(str(fake.lib_path)), exporters=[StdoutExporter(out)])


def allocations(out: io.BytesIO) -> list[dict[str, Any]]:
    records = [orjson.loads(line) for line in out.getvalue().splitlines()]
    # starts and ends (an end's last usage record: tests/test_accounting_agent.py)
    return [r for r in records if r["kind"] == "allocation" and r["event"] != "usage"]


def by_pod(records: list[dict[str, Any]], event: str) -> dict[str, dict[str, Any]]:
    return {r["pod"]: r for r in records if r["event"] == event}


async def test_start_and_end_records(fake_nvml: FakeNvml, real_kubelet: KubeletServer) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    shared = config.gpus[1].uuid
    real_kubelet.pods = [
        pod("ml", "train", "main", "nvidia.com/gpu", config.gpus[0].uuid or "")
    ] + [pod("inf", f"serve-{r}", "srv", "nvidia.com/gpu", f"{shared}::{r}") for r in range(3)]
    real_kubelet.publish()
    out = io.BytesIO()
    async with running_agent(make_agent(fake_nvml, real_kubelet, out)) as agent:
        await eventually(lambda: len(allocations(out)) == 4)
        real_kubelet.pods = real_kubelet.pods[:1] + real_kubelet.pods[2:]  # serve-0 goes away
        real_kubelet.publish()
        await eventually(lambda: len(allocations(out)) == 5)
        assert agent.trail.status()["open"] == 3
    records = allocations(out)
    starts, ends = by_pod(records, "start"), by_pod(records, "end")
    assert set(starts) == {"train", "serve-0", "serve-1", "serve-2"}
    train = starts["train"]
    assert train["serial"] == train["gpu"] == config.gpus[0].serial
    assert train["uuid"] == config.gpus[0].uuid and train["mig_uuid"] is None
    assert (train["namespace"], train["container"], train["resource_name"]) == (
        "ml",
        "main",
        "nvidia.com/gpu",
    )
    assert train["device_id"] == config.gpus[0].uuid and train["ended_at"] is None
    assert train["cluster"] == "test" and train["node"] == "node-a"
    assert (train["machine"], train["machine_source"]) == ("node-a", "node_name")
    assert train["start_observed"] is False  # already there when the agent started
    for r in range(3):
        assert starts[f"serve-{r}"]["uuid"] == shared  # every sharing pod, not the last one
        assert starts[f"serve-{r}"]["replica"] == r
    assert set(ends) == {"serve-0"}
    end, start = ends["serve-0"], starts["serve-0"]
    assert end["allocation_id"] == start["allocation_id"]
    assert end["started_at"] == start["started_at"] and end["ended_at"] >= start["started_at"]
    assert end["end_observed"] is True
    assert start["record_id"] == allocation_record_id(start["allocation_id"], "start")
    assert end["record_id"] == allocation_record_id(start["allocation_id"], "end")
    assert len({r["record_id"] for r in records}) == len(records)


async def test_restart_with_state_dir_closes_what_ended_meanwhile(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, tmp_path: Path
) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    uuids = [g.uuid or "" for g in config.gpus]
    real_kubelet.pods = [
        pod("a", "stays", "c", "nvidia.com/gpu", uuids[0]),
        pod("a", "leaves", "c", "nvidia.com/gpu", uuids[1]),
    ]
    real_kubelet.publish()
    first = io.BytesIO()
    async with running_agent(make_agent(fake_nvml, real_kubelet, first, state_dir=str(tmp_path))):
        await eventually(lambda: len(allocations(first)) == 2)
    assert (tmp_path / STATE_FILE).exists()

    # while the agent is down: one pod ends, another starts
    real_kubelet.pods = [real_kubelet.pods[0], pod("a", "arrives", "c", "nvidia.com/gpu", uuids[2])]
    real_kubelet.publish()
    second = io.BytesIO()
    agent = make_agent(fake_nvml, real_kubelet, second, state_dir=str(tmp_path))
    async with running_agent(agent):
        await eventually(lambda: len(allocations(second)) == 2)
        answered = polls(agent)
        await eventually(lambda: polls(agent) > answered + 3)
    records = allocations(second)
    assert len(records) == 2  # no second start for "stays"
    ended, started = by_pod(records, "end"), by_pod(records, "start")
    assert set(ended) == {"leaves"} and set(started) == {"arrives"}
    gone = ended["leaves"]
    assert gone["end_observed"] is False
    assert gone["ended_at"] >= agent.trail.started_at.isoformat()[:19]
    assert gone["last_seen_at"] and gone["last_seen_at"] <= gone["ended_at"]
    original = by_pod(allocations(first), "start")["leaves"]
    assert gone["allocation_id"] == original["allocation_id"]
    assert started["arrives"]["start_observed"] is False


async def test_restart_without_state_dir_reannounces_under_the_same_ids(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    real_kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", config.gpus[0].uuid or "")]
    real_kubelet.publish()
    runs = []
    for _ in range(2):
        out = io.BytesIO()
        async with running_agent(make_agent(fake_nvml, real_kubelet, out)):
            await eventually(lambda out=out: allocations(out))  # type: ignore[misc]
        runs.append(allocations(out))
    assert [len(r) for r in runs] == [1, 1]
    assert runs[0][0]["record_id"] == runs[1][0]["record_id"]
    assert runs[0][0]["allocation_id"] == runs[1][0]["allocation_id"]


REJECTED_TOTAL = "gpuid_state_files_rejected_total"


async def test_a_damaged_state_file_is_set_aside(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    damaged = b'{"version": 1, "node": "node-a", "open": [{"pod": 1}]'
    (tmp_path / STATE_FILE).write_bytes(damaged)
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    real_kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", config.gpus[0].uuid or "")]
    real_kubelet.publish()
    out = io.BytesIO()
    agent = make_agent(fake_nvml, real_kubelet, out, state_dir=str(tmp_path))
    async with running_agent(agent):
        await eventually(lambda: allocations(out))
    assert by_pod(allocations(out), "start").keys() == {"p"}
    [line] = [r for r in caplog.records if r.getMessage().startswith("state file set aside")]
    assert (line.file, line.reason) == (STATE_FILE, "invalid")  # type: ignore[attr-defined]
    [kept] = (tmp_path / "rejected").iterdir()
    assert kept.name.endswith(".invalid") and kept.read_bytes() == damaged
    labels = {"file": STATE_FILE, "reason": "invalid"}
    assert agent.metrics.registry.get_sample_value(REJECTED_TOTAL, labels) == 1
    saved = orjson.loads((tmp_path / STATE_FILE).read_bytes())
    assert [r["pod"] for r in saved["open"]] == ["p"]


async def test_an_unreachable_kubelet_ends_nothing(
    fake_nvml: FakeNvml, kubelet: FakeKubelet
) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", config.gpus[0].uuid or "")]
    out = io.BytesIO()
    agent = make_agent(fake_nvml, kubelet, out, pod_resources_stale_after=0.1)
    async with running_agent(agent):
        await eventually(lambda: allocations(out))
        await kubelet.stop()
        outage = await eventually(lambda: unavailable(agent))
        failures = agent.page.status()["attribution"]["kubelet"]
        assert failures["stale"] is True
        # Five collections later, every snapshot still without the kubelet: the trail has taken
        # some (it takes each as it comes, keeping only the newest), and none may end "p".
        await eventually(lambda: (s := unavailable(agent)) and s.seq >= outage.seq + 5)
        assert agent.trail.status()["open"] == 1
        assert [r["event"] for r in allocations(out)] == ["start"]
        back = rfc3339(datetime.now(UTC))
        kubelet.pods = []
        await kubelet.start()
        await eventually(lambda: len(allocations(out)) == 2)
    start, end = allocations(out)
    assert (start["event"], end["event"]) == ("start", "end")
    assert end["end_observed"] is True and end["ended_at"] >= back  # seen gone once back


def unavailable(agent: Agent) -> NodeSnapshot | None:
    """The latest snapshot, if it has no attribution."""
    latest = agent.bus.latest
    return latest if latest is not None and latest.attribution.state == "unavailable" else None


def test_mig_allocation_and_a_replaced_pod() -> None:
    """Record fields of a MIG allocation; a pod recreated under the same name (new UID) on the
    same device ends the old allocation and starts a new one."""
    from gpuid_agent.facts import MigDevice

    gpu = GpuIdentity(
        index=0,
        uuid="GPU-00000000-0000-4000-8000-000000000000",
        serial="S0",
        mig_enabled=True,
        mig_devices=(MigDevice(0, "MIG-11111111-0000-4000-8000-000000000000", 2, 0, "3g.40gb"),),
    )
    inventory = inventory_of(gpu)
    snapshot = PodResourcesSnapshot(
        (DeviceAssignment("ns", "db-0", "pg", "nvidia.com/mig-3g.40gb", gpu.mig_devices[0].uuid),)
    )
    trail = AllocationTrail(TrailIdentity("c", "n", "src"), publish_durable=_never)
    uid = {"value": "uid-1"}

    def lookup(namespace: str, name: str) -> PodMeta:
        return PodMeta(
            namespace, name, uid["value"], workload_kind="StatefulSet", workload_name="db"
        )

    first = [to_wire(r) for r in trail.owed(attribute(inventory, snapshot, pods=lookup), inventory)]
    assert len(first) == 1
    record = first[0]
    assert record["mig_uuid"] == gpu.mig_devices[0].uuid
    assert (record["mig_gpu_instance_id"], record["mig_profile"]) == (2, "3g.40gb")
    assert (record["pod_uid"], record["workload_kind"], record["workload_name"]) == (
        "uid-1",
        "StatefulSet",
        "db",
    )
    assert trail.owed(attribute(inventory, snapshot, pods=lookup), inventory) == []
    uid["value"] = "uid-2"
    replaced = [
        to_wire(r) for r in trail.owed(attribute(inventory, snapshot, pods=lookup), inventory)
    ]
    assert [(r["event"], r["pod_uid"]) for r in replaced] == [("end", "uid-1"), ("start", "uid-2")]
    assert replaced[0]["allocation_id"] == record["allocation_id"]
    assert replaced[1]["allocation_id"] != record["allocation_id"]


def test_only_a_current_attribution_ends_or_starts_anything() -> None:
    """The open set's own gate, without the bus's in front of it: an attribution with no
    kubelet answer (unavailable) or no inventory yet (pending) holds nobody, and must not end
    what is open; the current one that no longer lists the pod does."""
    gpu = GpuIdentity(index=0, uuid="GPU-00000000-0000-4000-8000-000000000001", serial="S0")
    inventory = inventory_of(gpu)
    held = PodResourcesSnapshot((DeviceAssignment("ns", "p", "c", "nvidia.com/gpu", gpu.uuid),))
    trail = AllocationTrail(TrailIdentity("c", "n", "src"), publish_durable=_never)
    [start] = trail.owed(attribute(inventory, held), inventory)
    for nobody in (attribute(inventory, None), attribute(None, PodResourcesSnapshot(()))):
        assert nobody.state != "current" and nobody.allocations == ()
        assert trail.owed(nobody, inventory) == []
        assert trail.status()["open"] == 1
    [end] = trail.owed(attribute(inventory, PodResourcesSnapshot(())), inventory)
    assert (to_wire(end)["event"], to_wire(end)["allocation_id"]) == (
        "end",
        to_wire(start)["allocation_id"],
    )


def inventory_of(gpu: GpuIdentity) -> NodeInventory:
    return build_inventory(
        [gpu],
        node="n",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version=None,
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )


async def _never(records: list[dict[str, Any]]) -> None:
    raise AssertionError("not published in this test")
