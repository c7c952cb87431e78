"""Liveness, readiness and the /status document, assembled from state the background tasks
keep current: reading them does no I/O, so probes of every node cost nothing downstream.

Liveness fails when a supervised task died or the collector stalled (a hung NVML call): the
kubelet then restarts a wedged agent. Readiness also needs a successful NVML read and at least
one exporter that is not losing records (see docs/exporters/README.md for the fan-out policy).
`run` re-evaluates readiness on its own cadence so `gpuid_health_check_success` is current
whether or not anyone probes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime
from typing import Any, Protocol

from gpuid_agent import __version__
from gpuid_agent.delivery.pipeline import Pipeline
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.runtime.supervisor import Supervisor
from gpuid_agent.serving.share_families import usage_status
from gpuid_agent.state.collector import Collector
from gpuid_agent.state.health.workloads import health_status


class Describes(Protocol):
    def status(self) -> dict[str, Any]: ...


class StatusPage:
    def __init__(
        self,
        settings: Settings,
        *,
        board: StatusBoard,
        supervisor: Supervisor,
        collector: Collector,
        pipeline: Pipeline,
        metrics: AgentMetrics,
        parts: dict[str, Describes | None],
    ) -> None:
        self._settings = settings
        self._board = board
        self._supervisor = supervisor
        self._collector = collector
        self._pipeline = pipeline
        self._metrics = metrics
        self._parts = parts  # labels, pods, trail, hardware: each one's own part
        self.started_at = datetime.now(UTC)

    def liveness(self) -> tuple[bool, list[str]]:
        problems = self._supervisor.problems()
        stalled = self._collector.stalled()
        if stalled is not None:
            problems.append(f"collector stalled: {stalled}")
            self._board.set("collector", "stalled", stalled)
        else:
            self._board.set("collector", "ok")
        return not problems, problems

    def readiness(self) -> tuple[bool, list[str]]:
        _, problems = self.liveness()
        nvml = self._board.get("nvml")
        if nvml is None or nvml.state not in ("ok", "degraded"):
            reason = nvml.reason if nvml and nvml.reason else "not read yet"
            problems.append(f"nvml: {reason}")
        healths = self._pipeline.health()
        for name, health in healths.items():
            self._board.set(f"exporter:{name}", health.state, health.reason)
        if not self._pipeline.ready(healths):
            problems.extend(f"exporter {n}: {h.reason}" for n, h in healths.items())
        ok = not problems
        self._metrics.health_check_success.set(1 if ok else 0)
        return ok, problems

    async def run(self, every: float = 2.0) -> None:
        """Keep readiness (and its gauge) current without anyone probing."""
        while True:
            self.readiness()
            await asyncio.sleep(every)

    def status(self) -> dict[str, Any]:
        ready, problems = self.readiness()
        collector = self._collector
        identity = collector.identity
        inventory = collector.inventory
        parts = {k: (None if v is None else v.status()) for k, v in self._parts.items()}
        return {
            "version": __version__,
            "node": identity.node,
            "cluster": identity.cluster,
            "machine": {"id": identity.machine, "source": identity.machine_source},
            "started_at": self.started_at,
            "ready": ready,
            "problems": problems,
            "components": self._board.as_dict(),
            "labels": parts.pop("labels", None),
            "hardware": parts.pop("hardware", None),
            "health": {
                **health_status(
                    collector.health.snapshot(), inventory, collector.attributor.current
                ),
                "expected_gpus": collector.health.expected_gpus(),
            },
            "inventory": None
            if inventory is None
            else {
                "read_time": inventory.read_time,
                "driver_version": inventory.driver_version,
                "cuda_driver_version": inventory.cuda_driver_version,
                "gpu_count": len(inventory.gpus),
                "serials": inventory.serials,
                "chassis": inventory.chassis_serials,
                "gpus": [dataclasses.asdict(g) for g in inventory.gpus],
            },
            "attribution": {**collector.attributor.status(), **parts},
            "processes": collector.processes.status(),
            "usage": None
            if (last := collector.last) is None
            else usage_status(last.inventory, last.samples, last.attribution, last.processes),
            "exporters": [w.describe() for w in self._pipeline.workers],
            "config": self._settings.redacted(),
        }
