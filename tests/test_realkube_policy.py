"""The chart's own-node ValidatingAdmissionPolicy as the real API server compiles and enforces
it: the agent's pod-bound token may change only the Node named in it, and only labels under the
prefix; in Warn mode the API server's warning reaches the agent, which logs it once."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from tests.conftest import running_agent, settings
from tests.realkube.chart import (
    AgentIdentity,
    Installed,
    agent_identity,
    chart_values,
    install,
    render_for,
    wait_policy_enforced,
)
from tests.realkube.cluster import ApiError, KubeCluster
from tests.realkube.objects import node, unique
from tests.waiting import eventually

P = "gpuid.github.com"
OWN_NODE = "may only modify its own Node"


@pytest.fixture(autouse=True)
def _not_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest.fixture
def other_node(kube_cluster: KubeCluster) -> str:
    name = unique("node-b")
    kube_cluster.admin.create("/api/v1/nodes", node(name, labels={"team": "b"}))
    return name


def labelling_agent(
    identity: AgentIdentity, node_name: str, monkeypatch: pytest.MonkeyPatch
) -> Agent:
    """The agent of `identity`'s pod, told it runs on `node_name` (NODE_NAME)."""
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    s = settings(
        simulate="gb200x4",
        node_name=node_name,
        kube_api="auto",
        labels="on",
        label_startup_jitter=0,
        label_resync_interval=0.2,
        pod_resources_socket="/nonexistent/kubelet.sock",
    )
    return Agent(
        s, nvml_api=SimulatedNvml("gb200x4", node_name), exporters=[StdoutExporter(io.BytesIO())]
    )


def test_token_of_node_a_may_label_node_a_only(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, other_node: str
) -> None:
    wait_policy_enforced(kube_cluster, agent_node)
    agent_client = agent_node.client
    own = f"/api/v1/nodes/{agent_node.node}"
    agent_client.strategic_patch(own, {"metadata": {"labels": {f"{P}/gpu-0": "S0"}}})
    refusals: dict[str, Any] = {
        "another node": (
            f"/api/v1/nodes/{other_node}",
            {"metadata": {"labels": {f"{P}/gpu-0": "S0"}}},
        ),
        "a label outside the prefix": (own, {"metadata": {"labels": {"team": "mine"}}}),
        "the spec": (own, {"spec": {"unschedulable": True}}),
    }
    messages = {}
    for what, (path, patch) in refusals.items():
        with pytest.raises(ApiError) as refused:
            agent_client.strategic_patch(path, patch)
        assert refused.value.status == 403, what
        messages[what] = refused.value.body["message"]
    assert f"the gpuid agent on node {agent_node.node} {OWN_NODE}" in messages["another node"]
    assert (
        "may only change labels under gpuid.github.com/" in messages["a label outside the prefix"]
    )
    assert "may not change a Node's spec" in messages["the spec"]
    b = kube_cluster.admin.get(f"/api/v1/nodes/{other_node}")
    assert not any(k.startswith(f"{P}/") for k in b["metadata"]["labels"])


def test_kubelet_conditions_are_not_the_agents(
    kube_cluster: KubeCluster, chart_with_conditions: Installed, tmp_path: Path
) -> None:
    identity = agent_identity(kube_cluster, chart_with_conditions, unique("node"), tmp_path)
    wait_policy_enforced(kube_cluster, identity)
    status = f"/api/v1/nodes/{identity.node}/status"
    kube_cluster.admin.strategic_patch(
        status, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    gpu = {"type": "GpuXidError", "status": "False", "reason": "GpuHealthy", "message": "ok"}
    identity.client.strategic_patch(status, {"status": {"conditions": [gpu]}})
    with pytest.raises(ApiError) as refused:
        identity.client.strategic_patch(
            status, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
        )
    assert "may not change the kubelet's Node conditions" in refused.value.body["message"]


async def test_agent_told_another_node_is_refused_and_says_why(
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    other_node: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    wait_policy_enforced(kube_cluster, agent_node)
    async with running_agent(labelling_agent(agent_node, other_node, monkeypatch)) as agent:
        state = await eventually(
            lambda: (c := agent.board.get("labels")) and c.state == "degraded" and c
        )
        assert OWN_NODE in str(state.reason)
    hints = [
        r
        for r in caplog.records
        if getattr(r, "hint", "").startswith("an admission policy refused")
    ]
    assert len(hints) == 1
    b = kube_cluster.admin.get(f"/api/v1/nodes/{other_node}")
    assert not any(k.startswith(f"{P}/") for k in b["metadata"]["labels"])


async def test_warn_mode_lets_the_patch_through_and_the_agent_logs_the_warning_once(
    kube_cluster: KubeCluster,
    other_node: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    chart = render_for(
        kube_cluster, chart_values(("Warn",)), release="gpuid-warn", namespace="gpu-warn"
    )
    identity = agent_identity(
        kube_cluster, install(kube_cluster.admin, chart), unique("node"), tmp_path
    )

    # Warn mode refuses nothing: wait until the warning comes back instead.
    def warned() -> bool:
        identity.client.warnings.clear()
        identity.client.strategic_patch(
            f"/api/v1/nodes/{other_node}?dryRun=All", {"metadata": {"labels": {f"{P}/probe": "x"}}}
        )
        return any(OWN_NODE in w for w in identity.client.warnings)

    await eventually(warned, within=30)
    async with running_agent(labelling_agent(identity, other_node, monkeypatch)) as agent:
        await eventually(
            lambda: (
                f"{P}/gpu-count"
                in kube_cluster.admin.get(f"/api/v1/nodes/{other_node}")["metadata"]["labels"]
            )
        )
        # Several resyncs later (each re-reads the Node; a patch only on drift), and one
        # more patch after someone removes a label: still one warning line.
        kube_cluster.admin.merge_patch(
            f"/api/v1/nodes/{other_node}", {"metadata": {"labels": {f"{P}/gpu-0": None}}}
        )
        await eventually(
            lambda: (
                f"{P}/gpu-0"
                in kube_cluster.admin.get(f"/api/v1/nodes/{other_node}")["metadata"]["labels"]
            )
        )
        assert agent.board.is_ok("labels")
    lines = [r for r in caplog.records if r.getMessage() == "the API server warned about a request"]
    assert len(lines) == 1
    assert OWN_NODE in lines[0].warning  # type: ignore[attr-defined]
