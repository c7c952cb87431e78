"""Node conditions for unhealthy GPUs, written through the agent's client to the real
kube-apiserver: the chart's release with health.nodeConditions (its role patches nodes/status,
its own-node policy protects the kubelet's conditions), the agent's pod-bound token. A refusal
is a real one: a release whose role lacks nodes/status, granted it while the agent runs, as an
upgrade enabling the feature does. Writes are counted by the agent's own
`gpuid_kube_api_requests_total`. Nothing here needs the stand-in API server (`tests/fakekube`)."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.node.conditions import MESSAGE_LIMIT, desired_conditions
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.state.health.verdicts import CheckStatus, GpuHealth, NodeHealth
from tests.conftest import node_health, running_agent, settings
from tests.realkube.chart import (
    AgentIdentity,
    Installed,
    agent_identity,
    chart_values,
    install,
    render_for,
    uninstall,
)
from tests.realkube.cluster import KubeCluster
from tests.realkube.objects import unique
from tests.test_labels_agent import api_requests
from tests.waiting import eventually

READY = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "kubelet is posting ready status",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


@pytest.fixture(autouse=True)
def _not_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest.fixture
def without_node_status(kube_cluster: KubeCluster) -> Iterator[tuple[Installed, dict[str, Any]]]:
    """A release with health.nodeConditions whose ClusterRole lost its nodes/status rule (in
    its own namespace, gone after the test), and the ClusterRole as the chart renders it."""
    release = unique("gpuid-nostatus")
    values = chart_values(health={"nodeConditions": True})
    chart = render_for(kube_cluster, values, release=release, namespace=release)
    role = chart.cluster_role
    full = copy.deepcopy(role)
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["nodes/status"]]
    assert role["rules"] != full["rules"]
    try:
        yield install(kube_cluster.admin, chart), full
    finally:
        uninstall(kube_cluster.admin, chart)


def _conditions(cluster: KubeCluster, node: str) -> dict[str, dict[str, Any]]:
    status = cluster.admin.get(f"/api/v1/nodes/{node}").get("status", {})
    return {c["type"]: c for c in status.get("conditions", [])}


def _agent(
    identity: AgentIdentity, api: SimulatedNvml, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> Agent:
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    s = settings(
        simulate="gb200x4",
        node_conditions=True,
        kube_api="auto",
        node_name=identity.node,
        **overrides,
    )
    return Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])


async def test_unhealthy_gpu_raises_a_condition_once_and_clears_a_stale_one(
    kube_cluster: KubeCluster,
    chart_with_conditions: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    identity = agent_identity(kube_cluster, chart_with_conditions, unique("node"), tmp_path)
    name = identity.node
    stale = {
        "type": "GpuRowRemapping",
        "status": "True",
        "reason": "GpuRebootSuggested",
        "message": "GPU 1 (GPU-old): row remapping pending",
        "lastHeartbeatTime": "2025-01-01T00:00:00Z",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }
    kube_cluster.admin.strategic_patch(
        f"/api/v1/nodes/{name}/status", {"status": {"conditions": [READY, stale]}}
    )
    ready = _conditions(kube_cluster, name)["Ready"]  # as the server keeps it
    api = SimulatedNvml("gb200x4", name)
    async with running_agent(_agent(identity, api, monkeypatch)) as agent:
        conditions = lambda: _conditions(kube_cluster, name)  # noqa: E731
        # the reboot fixed it: the condition left by the earlier run is cleared
        await eventually(lambda: conditions()["GpuRowRemapping"]["status"] == "False")
        cleared = conditions()["GpuRowRemapping"]
        assert (
            cleared["reason"] == "GpuHealthy"
            and cleared["lastTransitionTime"] != stale["lastTransitionTime"]
        )
        assert set(conditions()) == {"Ready", "GpuRowRemapping"}  # nothing else written
        api.inject_xid(2, 79)
        await eventually(lambda: conditions().get("GpuXidError", {}).get("status") == "True")
        xid = conditions()["GpuXidError"]
        assert xid["reason"] == "GpuRebootSuggested"
        gpu2 = node_health(agent).gpus[2]
        assert xid["message"] == f"GPU 2 ({gpu2.uuid}): XID 79: GPU has fallen off the bus"
        # untouched: the patches merge conditions by type (strategic merge), never replace
        assert conditions()["Ready"] == ready
        writes = api_requests(agent, "patch", "nodes/status")
        for _ in range(2):  # many collections later: no write without a change
            ticks = (
                agent.metrics.registry.get_sample_value("gpuid_collection_duration_seconds_count")
                or 0
            )
            await eventually(
                lambda t=ticks: (
                    (
                        agent.metrics.registry.get_sample_value(
                            "gpuid_collection_duration_seconds_count"
                        )
                        or 0
                    )
                    > t + 5
                )
            )
        assert api_requests(agent, "patch", "nodes/status") == writes == 2
        assert api_requests(agent, "patch", "nodes/status", "200") == 2
        assert agent.board.get("node-conditions").state == "ok"  # type: ignore[union-attr]


async def test_api_errors_are_retried_and_reported_without_touching_readiness(
    kube_cluster: KubeCluster,
    without_node_status: tuple[Installed, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chart, full_role = without_node_status
    identity = agent_identity(kube_cluster, chart, unique("node"), tmp_path)
    api = SimulatedNvml("gb200x4", identity.node, ["lost:gpu1"])
    async with running_agent(_agent(identity, api, monkeypatch)) as agent:
        await eventually(lambda: agent.board.get("node-conditions").state == "degraded")  # type: ignore[union-attr]
        reason = agent.board.get("node-conditions").reason or ""  # type: ignore[union-attr]
        assert "403" in reason and "nodes/status" in reason, reason
        ready, problems = agent.page.readiness()
        assert ready, problems
        assert "GpuLost" not in _conditions(kube_cluster, identity.node)
        # the release gets the chart's whole role (as an upgrade would): a later try goes through
        kube_cluster.admin.merge_patch(
            f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{full_role['metadata']['name']}",
            {"rules": full_role["rules"]},
        )
        lost = lambda: _conditions(kube_cluster, identity.node).get("GpuLost", {})  # noqa: E731
        await eventually(lambda: lost().get("status") == "True")
        await eventually(lambda: agent.board.get("node-conditions").state == "ok")  # type: ignore[union-attr]
        assert api_requests(agent, "patch", "nodes/status", "403") >= 1
        # One write, or two when the grant came before the lost GPU was judged; then none while
        # nothing changes.
        writes = api_requests(agent, "patch", "nodes/status", "200")
        assert writes in (1, 2)
        collections = "gpuid_collection_duration_seconds_count"
        ticks = agent.metrics.registry.get_sample_value(collections) or 0
        await eventually(lambda: (agent.metrics.registry.get_sample_value(collections) or 0) >= ticks + 5)
        assert api_requests(agent, "patch", "nodes/status", "200") == writes


async def test_without_an_api_configuration_the_agent_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    s = settings(simulate="gb200x4", node_conditions=True, kube_api="auto")
    nvml = SimulatedNvml("gb200x4", "node-a")
    agent = Agent(s, nvml_api=nvml, exporters=[StdoutExporter(io.BytesIO())])
    async with running_agent(agent):
        state = agent.board.get("node-conditions")
        assert state is not None and state.state == "unavailable"
        await eventually(lambda: agent.bus.latest is not None)
        assert agent.page.liveness()[0]


def test_condition_messages_name_every_unhealthy_gpu_and_stay_bounded() -> None:
    from datetime import UTC, datetime

    since = datetime(2025, 1, 1, tzinfo=UTC)

    def gpu(i: int, reason: str, action: str) -> GpuHealth:
        check = CheckStatus("unhealthy", reason, action, since)  # type: ignore[arg-type]
        return GpuHealth(i, f"GPU-{i}", None, "unhealthy", action, {"remapped_rows": check})  # type: ignore[arg-type]

    health = NodeHealth(
        (
            gpu(0, "row remapping pending", "reboot"),
            gpu(1, "remapping failed", "hardware_inspection"),
        )
    )
    wanted = desired_conditions(health)
    rows = wanted["GpuRowRemapping"]
    assert rows.status == "True" and rows.reason == "GpuHardwareInspectionSuggested"
    assert rows.message == "GPU 0 (GPU-0): row remapping pending; GPU 1 (GPU-1): remapping failed"
    assert wanted["GpuLost"].status == "False"
    many = NodeHealth(tuple(gpu(i, "x" * 300, "reboot") for i in range(8)))
    assert len(desired_conditions(many)["GpuRowRemapping"].message) == MESSAGE_LIMIT
