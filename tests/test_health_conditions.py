"""Node conditions for unhealthy GPUs, written through kubernetes_asyncio to the fake API server."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.node.conditions import MESSAGE_LIMIT, desired_conditions
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.state.health.verdicts import CheckStatus, GpuHealth, NodeHealth
from tests.conftest import node_health, running_agent, settings
from tests.fakekube import FakeKube, write_kubeconfig
from tests.waiting import eventually

STATUS_PATH = "/api/v1/nodes/node-a/status"


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    async with FakeKube() as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", server.url)))
        monkeypatch.setenv("HOME", str(tmp_path))
        yield server


def _conditions(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.node("node-a")["status"]["conditions"]}


def _agent(api: SimulatedNvml, **overrides: Any) -> Agent:
    s = settings(simulate="gb200x4", node_conditions=True, kube_api="auto", **overrides)
    return Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])


async def test_unhealthy_gpu_raises_a_condition_once_and_clears_a_stale_one(
    kube: FakeKube,
) -> None:
    kube.add_node("node-a")
    stale = {
        "type": "GpuRowRemapping",
        "status": "True",
        "reason": "GpuRebootSuggested",
        "message": "GPU 1 (GPU-old): row remapping pending",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }
    kube.patch(
        "Node", "node-a", {"status": {"conditions": [{"type": "Ready", "status": "True"}, stale]}}
    )
    api = SimulatedNvml("gb200x4", "node-a")
    async with running_agent(_agent(api)) as agent:
        # the reboot fixed it: the condition left by the earlier run is cleared
        await eventually(lambda: _conditions(kube)["GpuRowRemapping"]["status"] == "False")
        cleared = _conditions(kube)["GpuRowRemapping"]
        assert (
            cleared["reason"] == "GpuHealthy"
            and cleared["lastTransitionTime"] != stale["lastTransitionTime"]
        )
        assert set(_conditions(kube)) == {"Ready", "GpuRowRemapping"}  # nothing else written
        api.inject_xid(2, 79)
        await eventually(lambda: _conditions(kube).get("GpuXidError", {}).get("status") == "True")
        xid = _conditions(kube)["GpuXidError"]
        assert xid["reason"] == "GpuRebootSuggested"
        gpu2 = node_health(agent).gpus[2]
        assert xid["message"] == f"GPU 2 ({gpu2.uuid}): XID 79: GPU has fallen off the bus"
        assert _conditions(kube)["Ready"] == {"type": "Ready", "status": "True"}  # untouched
        writes = kube.count("patch", path=STATUS_PATH)
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
        assert kube.count("patch", path=STATUS_PATH) == writes == 2
        assert agent.board.get("node-conditions").state == "ok"  # type: ignore[union-attr]
        patch = [r for r in kube.requests if r.path == STATUS_PATH][-1]
        assert patch.content_type == "application/strategic-merge-patch+json"


async def test_api_errors_are_retried_and_reported_without_touching_readiness(
    kube: FakeKube,
) -> None:
    kube.add_node("node-a")
    kube.inject(403, verb="patch", path=STATUS_PATH, times=2, message="nodes/status is forbidden")
    api = SimulatedNvml("gb200x4", "node-a", ["lost:gpu1"])
    async with running_agent(_agent(api)) as agent:
        await eventually(lambda: agent.board.get("node-conditions").state == "degraded")  # type: ignore[union-attr]
        assert "403" in (agent.board.get("node-conditions").reason or "")  # type: ignore[union-attr]
        ready, problems = agent.page.readiness()
        assert ready, problems
        await eventually(lambda: _conditions(kube).get("GpuLost", {}).get("status") == "True")
        # the server stored the patch before the agent read its answer
        await eventually(lambda: agent.board.get("node-conditions").state == "ok")  # type: ignore[union-attr]
        assert kube.count("patch", path=STATUS_PATH, status=403) == 2


async def test_without_an_api_configuration_the_agent_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    async with running_agent(_agent(SimulatedNvml("gb200x4", "node-a"))) as agent:
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
