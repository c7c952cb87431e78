"""The agent's writes to its own Node against the real kube-apiserver, with the chart's RBAC and
own-node admission policy enforced and the agent authenticated by the token bound to its pod:
serial labels (reconciled, stale ones removed, nothing else touched) and GPU conditions
through nodes/status."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from tests.conftest import running_agent, settings
from tests.realkube.chart import AgentIdentity, Installed, agent_identity
from tests.realkube.cluster import KubeCluster
from tests.realkube.objects import unique
from tests.waiting import eventually

P = "gpuid.github.com"


@pytest.fixture(autouse=True)
def _not_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def agent(
    identity: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
    nvml: SimulatedNvml | None = None,
    **overrides: Any,
) -> Agent:
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    base: dict[str, Any] = {
        "simulate": "gb200x4",
        "node_name": identity.node,
        "kube_api": "auto",
        "labels": "on",
        "label_startup_jitter": 0,
        "label_resync_interval": 0.3,
        "pod_resources_socket": "/nonexistent/kubelet.sock",
    }
    base.update(overrides)
    nvml = nvml or SimulatedNvml("gb200x4", identity.node)
    return Agent(settings(**base), nvml_api=nvml, exporters=[StdoutExporter(io.BytesIO())])


def node_of(cluster: KubeCluster, name: str) -> dict[str, Any]:
    return cluster.admin.get(f"/api/v1/nodes/{name}")  # type: ignore[no-any-return]


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith(f"{P}/")}


async def test_serial_labels_reconciled_and_nothing_else_touched(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin, name = kube_cluster.admin, agent_node.node
    # What others keep on the Node, and a serial label left by the GPU this VM had before.
    admin.strategic_patch(
        f"/api/v1/nodes/{name}",
        {
            "metadata": {
                "labels": {"team": "ml", f"{P}/gpu-7": "OLD-SERIAL"},
                "annotations": {"owner": "platform"},
            },
            "spec": {"taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]},
        },
    )
    before = node_of(kube_cluster, name)
    async with running_agent(agent(agent_node, monkeypatch)) as running:
        await eventually(
            lambda: (
                ours(node_of(kube_cluster, name)["metadata"]["labels"]).get(f"{P}/gpu-count") == "4"
            )
        )
        after = node_of(kube_cluster, name)
        labels = after["metadata"]["labels"]
        assert f"{P}/gpu-7" not in labels  # stale: removed
        assert {f"{P}/gpu-0", f"{P}/gpu-1", f"{P}/chassis"} <= set(labels)
        desired = ours(labels)
        others = {k: v for k, v in labels.items() if not k.startswith(f"{P}/")}
        assert others == {
            k: v for k, v in before["metadata"]["labels"].items() if not k.startswith(f"{P}/")
        }
        assert after["spec"]["taints"] == before["spec"]["taints"]
        assert after["metadata"]["annotations"].get("owner") == "platform"

        # Someone edits one serial label and removes another: the agent puts both back.
        admin.merge_patch(
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": {f"{P}/gpu-0": "TAMPERED", f"{P}/gpu-1": None}}},
        )
        await eventually(lambda: ours(node_of(kube_cluster, name)["metadata"]["labels"]) == desired)
        assert running.board.is_ok("labels")
    final = node_of(kube_cluster, name)
    assert final["metadata"]["labels"]["team"] == "ml"
    assert final["spec"]["taints"] == before["spec"]["taints"]


async def test_conditions_through_node_status_leave_others_alone(
    kube_cluster: KubeCluster,
    chart_with_conditions: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    identity = agent_identity(kube_cluster, chart_with_conditions, unique("node"), tmp_path / "a")
    admin, name = kube_cluster.admin, identity.node
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "kubelet is posting ready status",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    admin.strategic_patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": [ready]}})
    nvml = SimulatedNvml("gb200x4", name)

    def conditions() -> dict[str, dict[str, Any]]:
        status = node_of(kube_cluster, name).get("status", {})
        return {c["type"]: c for c in status.get("conditions", [])}

    async with running_agent(agent(identity, monkeypatch, nvml, node_conditions=True)):
        nvml.inject_xid(2, 79)
        await eventually(lambda: conditions().get("GpuXidError", {}).get("status") == "True")
        assert conditions()["GpuXidError"]["reason"] == "GpuRebootSuggested"
        assert conditions()["Ready"] == ready  # the kubelet's condition, untouched
