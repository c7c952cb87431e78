"""Node Events on the real kube-apiserver (events.k8s.io/v1), written with the agent's pod-bound
token under the chart's RBAC: a fault and its recovery, a repeat as a series on one object, a
latched XID cleared by an operator, what `kubectl describe node` finds, a storm of 1,000 XIDs
within the write budget, and a release without the events rule (a real 403, survived).

Real parts: the fake libnvidia-ml delivers the XIDs (or the simulated node, for the storm
through the agent), the kubelet's own pod-resources server (Go, `real_kubelet`) says which pods
held the GPU, and the real API server stores, validates and selects the Events. No stand-in:
nothing here needs a fault the real server cannot give.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.node.events import REASONS, NodeEventWriter
from gpuid_agent.node.events.ledger import BURST, REFILL_EVERY
from gpuid_agent.node.events.objects import REPORTING_CONTROLLER
from gpuid_agent.runtime.clear_requests import write_clear_request
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.kube.client import create_kube_client, request_counter
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.state.health.tracker import HealthTracker
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekubelet import pod as kubelet_pod
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube import objects as real
from tests.realkube.chart import (
    AgentIdentity,
    Installed,
    agent_identity,
    chart_values,
    install,
    render_for,
)
from tests.realkube.cluster import KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.test_records_bus import snapshot
from tests.waiting import eventually

EVENTS = "/apis/events.k8s.io/v1/namespaces/default/events"


@pytest.fixture(autouse=True)
def _not_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def events_of(cluster: KubeCluster, node: str) -> list[dict[str, Any]]:
    """The node's Events as events.k8s.io/v1 lists them, oldest first."""
    found = cluster.admin.get(EVENTS, fieldSelector=f"regarding.name={node}")["items"]
    return sorted(found, key=lambda e: (e["eventTime"], e["metadata"]["name"]))


def described(cluster: KubeCluster, node: dict[str, Any]) -> set[str]:
    """The names of the Events `kubectl describe node` shows: core/v1 Events in any namespace
    selected by the Node as their involvedObject (kind, name, no namespace, UID)."""
    meta = node["metadata"]
    selector = (
        f"involvedObject.name={meta['name']},involvedObject.namespace=,"
        f"involvedObject.kind=Node,involvedObject.uid={meta['uid']}"
    )
    return {
        e["metadata"]["name"]
        for e in cluster.admin.get("/api/v1/events", fieldSelector=selector)["items"]
    }


def counted(metrics: AgentMetrics, name: str, **labels: str) -> float:
    """The sum of a counter's samples matching `labels`."""
    return sum(
        s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def event_writes(metrics: AgentMetrics) -> float:
    """API writes of Events (creates and series patches), whatever their answer."""
    return sum(
        counted(metrics, "gpuid_kube_api_requests_total", verb=verb, resource="events")
        for verb in ("create", "patch")
    )


def simulated(
    identity: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
    profile: str,
    faults: list[str] | None = None,
    **overrides: Any,
) -> tuple[Agent, SimulatedNvml, io.BytesIO]:
    """An agent on a simulated node, authenticated as `identity`, and what it exports."""
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    nvml = SimulatedNvml(profile, identity.node, faults or [])
    out = io.BytesIO()
    s = settings(
        simulate=profile,
        node_name=identity.node,
        kube_api="auto",
        pod_resources_socket="/nonexistent/kubelet.sock",
        **overrides,
    )
    return Agent(s, nvml_api=nvml, exporters=[StdoutExporter(out)]), nvml, out


def assert_about_the_node(event: dict[str, Any], node: dict[str, Any]) -> None:
    assert event["regarding"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node["metadata"]["name"],
        "uid": node["metadata"]["uid"],
    }
    assert event["reportingController"] == REPORTING_CONTROLLER
    assert event["reportingInstance"] == node["metadata"]["name"]
    assert event["reason"] in REASONS
    assert (event["type"], event["action"]) == (
        REASONS[event["reason"]].type,
        REASONS[event["reason"]].action,
    )
    assert event["metadata"]["name"].startswith(node["metadata"]["name"] + ".")
    assert len(event["note"].encode()) <= 1024


async def test_a_fault_its_recovery_a_repeat_and_a_clear_are_events_on_the_node(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    name, admin = agent_node.node, kube_cluster.admin
    ns = real.unique("team")
    real.create_pod(admin, real.pod(ns, "train-0", name))
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:2]
    fake_nvml.apply(config)
    gpu = config.gpus[1]
    real_kubelet.pods = [kubelet_pod(ns, "train-0", "main", "nvidia.com/gpu", gpu.uuid or "")]
    real_kubelet.publish()
    state = tmp_path / "state"
    s = settings(
        node_name=name,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        nvml_library_path=str(fake_nvml.lib_path),
        xid_hold=1.0,
        state_dir=str(state),
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )

    def reasons() -> list[str]:
        return [e["reason"] for e in events_of(kube_cluster, name)]

    async with running_agent(agent):
        await eventually(lambda: agent.collector.health.xid.alive)
        await eventually(
            lambda: agent.bus.latest and agent.bus.latest.attribution.holders(gpu.uuid or "")
        )
        gpu.xids.append((13, 0))  # graphics engine exception: degraded for XID_HOLD
        fake_nvml.apply(config)
        await eventually(lambda: reasons() == ["GpuDegraded", "GpuRecovered"])
        gpu.xids.append((13, 0))  # the same again: a repeat of both Events
        fake_nvml.apply(config)
        await eventually(
            lambda: (
                [e.get("series", {}).get("count") for e in events_of(kube_cluster, name)] == [2, 2]
            ),
            within=40,
        )
        gpu.xids.append((79, 0))  # fallen off the bus: latched until cleared
        fake_nvml.apply(config)
        await eventually(lambda: reasons()[-1:] == ["GpuUnhealthy"])
        write_clear_request(str(state), "1")  # `gpuid-agent health clear 1`
        await eventually(lambda: reasons()[-1:] == ["GpuLatchedCleared"])
        metrics = agent.metrics
        assert agent.board.is_ok("node-events")
    node = admin.get(f"/api/v1/nodes/{name}")
    found = events_of(kube_cluster, name)
    assert [(e["reason"], e["type"]) for e in found] == [
        ("GpuDegraded", "Warning"),
        ("GpuRecovered", "Normal"),
        ("GpuUnhealthy", "Warning"),
        ("GpuLatchedCleared", "Normal"),
    ]
    for event in found:
        assert_about_the_node(event, node)
        assert f"GPU 1 (serial {gpu.serial}, {gpu.uuid})" in event["note"], event["note"]
        assert event["note"].endswith(f"Pods hit: {ns}/train-0"), event["note"]
    degraded, recovered, unhealthy, cleared = (e["note"] for e in found)
    assert "xid degraded, action check_workload: XID 13: graphics engine exception" in degraded
    assert "xid healthy (was degraded: XID 13" in recovered
    assert "xid unhealthy, action reboot: XID 79: GPU has fallen off the bus" in unhealthy
    assert "xid healthy, XIDs cleared by an operator (was unhealthy: XID 79" in cleared
    repeated = found[0]["series"]
    assert repeated["lastObservedTime"] > found[0]["eventTime"]
    # what `kubectl describe node` lists: every one of them
    assert described(kube_cluster, node) == {e["metadata"]["name"] for e in found}
    assert counted(metrics, "gpuid_node_events_total") == 4
    assert counted(metrics, "gpuid_node_event_repeats_total") == 2
    assert counted(metrics, "gpuid_node_events_dropped_total") == 0
    assert event_writes(metrics) == 6  # four creates, two series patches


async def test_a_storm_of_1000_xids_writes_within_the_budget(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 XIDs on 8 GPUs, 40 codes among them, each clearing after XID_HOLD: the tracker
    makes 2,000 transitions of 80 distinct Events (a degraded and a recovered one per GPU and
    code), which the writer gets through the agent's own API client."""
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    name = agent_node.node
    metrics = AgentMetrics()
    client = await create_kube_client("auto", observer=request_counter(metrics.kube_api_requests))
    assert client is not None
    gpus = [GpuIdentity(index=i, uuid=f"GPU-storm-{i}", serial=f"16524230{i:05}") for i in range(8)]
    inventory = NodeInventory(name, "c", "m", "dmi", None, None, tuple(gpus), datetime.now(UTC))
    healthy = {g.index: GpuHealthSignals(g.index, g.uuid) for g in gpus}
    now = [0.0]
    tracker = HealthTracker(xid_hold=10.0, clock=lambda: now[0])
    tracker.observe(gpus, healthy, {})
    started = time.monotonic()
    writer = NodeEventWriter(name, StatusBoard(), metrics.node_events)
    assert writer.open(client)
    task = asyncio.create_task(writer.run())
    transitions = 0
    try:
        for i in range(1000):
            gpu = gpus[i % 8]
            made = tracker.record_xid(
                XidEvent(gpu.index, gpu.uuid, 1000 + i % 40, datetime.now(UTC))
            )
            now[0] += 11.0  # past XID_HOLD: the next collection finds the XID no longer holding
            made += tracker.observe(gpus, healthy, {})
            transitions += len(made)
            writer.offer(snapshot(i, inventory, transitions=tuple(made)))
            if i % 50 == 49:  # as a collector would pace them: the queue never overflows
                await eventually(lambda: writer.queued == 0)
        await eventually(lambda: writer.queued == 0)
        writes, elapsed = event_writes(metrics), time.monotonic() - started
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    created = counted(metrics, "gpuid_node_events_total")
    repeats = counted(metrics, "gpuid_node_event_repeats_total")
    dropped = counted(metrics, "gpuid_node_events_dropped_total", cause="budget")
    assert transitions == 2000
    assert writes <= BURST + elapsed // REFILL_EVERY, (writes, elapsed)
    assert BURST <= created < 80  # the burst spent on the first distinct Events
    assert dropped == transitions - created - repeats > 0  # held back: the rest, counted
    assert counted(metrics, "gpuid_node_events_dropped_total") == dropped  # none for other causes
    stored = events_of(kube_cluster, name)
    assert len(stored) == created
    node = kube_cluster.admin.get(f"/api/v1/nodes/{name}")
    for event in stored:
        assert_about_the_node(event, node)


async def test_a_storm_of_1000_xids_through_the_agent_stays_within_the_budget(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same storm end to end: 1,000 XIDs of seven codes on a simulated node's four GPUs.
    Every transition the agent judged (its health records) is an Event created, a repeat in a
    series or counted as dropped, and the writes stay within the budget."""
    name = agent_node.node
    agent, nvml, out = simulated(agent_node, monkeypatch, "gb200x4")
    codes = (13, 31, 94, 92, 119, 79, 48)

    def told() -> float:
        kinds = ("gpuid_node_events_total", "gpuid_node_event_repeats_total")
        dropped = counted(agent.metrics, "gpuid_node_events_dropped_total")
        return sum(counted(agent.metrics, kind) for kind in kinds) + dropped

    def judged() -> int:  # health records of a change to or from degraded or unhealthy
        rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
        bad = ("degraded", "unhealthy")
        return sum(
            r["kind"] == "health" and (r["state"] in bad or r["previous_state"] in bad)
            for r in rows
        )

    started = time.monotonic()
    async with running_agent(agent):
        await eventually(lambda: agent.collector.health.xid.alive)
        for i in range(1000):
            nvml.inject_xid(i % 4, codes[i % len(codes)])
        await eventually(
            lambda: (
                sum(sum(g.xid_counts.values()) for g in agent.collector.health.snapshot().gpus)
                == 1000
            ),
            within=60,
        )
        await eventually(lambda: agent.events is not None and agent.events.queued == 0)
        await eventually(lambda: told() == judged() > 0)
        writes, elapsed = event_writes(agent.metrics), time.monotonic() - started
    assert writes <= BURST + elapsed // REFILL_EVERY, (writes, elapsed)
    created = counted(agent.metrics, "gpuid_node_events_total")
    assert len(events_of(kube_cluster, name)) == created > 0


async def test_a_gpu_replaced_under_the_node_is_a_warning_event(
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    name = agent_node.node
    agent, _, out = simulated(
        agent_node, monkeypatch, "h100x8", ["gpu-replaced:gpu3@1s"], state_dir=str(tmp_path)
    )
    async with running_agent(agent):
        [event] = await eventually(lambda: events_of(kube_cluster, name))
        await eventually(lambda: b'"kind":"hardware"' in out.getvalue())
    [record] = [
        r for r in map(orjson.loads, out.getvalue().splitlines()) if r["kind"] == "hardware"
    ]
    assert_about_the_node(event, kube_cluster.admin.get(f"/api/v1/nodes/{name}"))
    assert (event["reason"], event["type"], event["action"]) == (
        "GpuReplaced",
        "Warning",
        "Replaced",
    )
    assert event["note"] == (
        f"GPU 3 at {record['pci_bus_id']} replaced: serial {record['old_serial']} → "
        f"{record['new_serial']}, {record['uuid']}"
    )
    assert counted(agent.metrics, "gpuid_node_events_total", reason="GpuReplaced") == 1


@pytest.fixture(scope="module")
def chart_without_events(kube_cluster: KubeCluster) -> Installed:
    """A release with health.nodeEvents off: no events Role, so the agent's token may not
    write Events anywhere."""
    values = chart_values(health={"nodeEvents": False})
    chart = render_for(kube_cluster, values, release="gpuid-quiet", namespace="gpu-quiet")
    return install(kube_cluster.admin, chart)


async def test_without_the_events_rule_the_agent_is_refused_says_so_once_and_runs_on(
    kube_cluster: KubeCluster,
    chart_without_events: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not chart_without_events.rendered.of_kind("Role")
    identity = agent_identity(kube_cluster, chart_without_events, real.unique("node"), tmp_path)
    # asked for, but not granted
    agent, nvml, _ = simulated(identity, monkeypatch, "gb200x4", node_events=True)
    caplog.set_level(logging.WARNING)
    async with running_agent(agent):
        await eventually(lambda: agent.collector.health.xid.alive)
        for index in range(4):  # four GPUs fall off the bus: four Events, four refusals
            nvml.inject_xid(index, 79)
        await eventually(
            lambda: counted(agent.metrics, "gpuid_node_events_dropped_total", cause="refused") == 4
        )
        component = agent.board.get("node-events")
        assert component is not None and component.state == "degraded"
        assert (component.reason or "").startswith("forbidden: 403 ")
        assert 'cannot create resource "events" in API group "events.k8s.io"' in (
            component.reason or ""
        )
        live, problems = agent.page.liveness()
        ready, _ = agent.page.readiness()
        assert live and ready, problems  # Events are no reason to take the agent out
        status = agent.page.status()["components"]["node-events"]
        assert status["state"] == "degraded"
    refused = counted(agent.metrics, "gpuid_kube_api_requests_total", resource="events", code="403")
    assert refused == 4
    assert counted(agent.metrics, "gpuid_node_events_total") == 0
    hints = [r for r in caplog.records if r.getMessage() == "node events not written"]
    assert len(hints) == 1
    assert "events.k8s.io" in hints[0].hint and "health.nodeEvents" in hints[0].hint  # type: ignore[attr-defined]
    assert events_of(kube_cluster, identity.node) == []
