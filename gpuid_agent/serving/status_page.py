"""Liveness, readiness and the /status document, assembled from state the background tasks
keep current: reading them does no I/O, so probes of every node cost nothing downstream.

Liveness fails when a supervised task died or the collector stalled (a hung NVML call): the
kubelet then restarts a wedged agent. Readiness also needs a successful NVML read and at least
one exporter that is not losing records (see docs/exporters/README.md for the fan-out policy).
`run` re-evaluates readiness after each snapshot and at least every READINESS_EVERY seconds,
so `gpuid_health_check_success` is current whether or not anyone probes.

What /status shows of the node comes from the latest snapshot on the bus (inventory, health,
per-process shares, usage) and the status board; the parts that keep their own state (labels,
pods, allocation trail, hardware, the attributor's sources) describe themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from gpuid_agent import __version__
from gpuid_agent.delivery.pipeline import Pipeline
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import Reason, StatusBoard
from gpuid_agent.runtime.supervisor import Supervisor
from gpuid_agent.serving.share_families import usage_status
from gpuid_agent.state.attribution.shares import PROCESSES_OFF, ProcessView
from gpuid_agent.state.bus import SnapshotBus, Subscription
from gpuid_agent.state.collector import NodeIdentity
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.health.workloads import health_status

# Seconds between readiness evaluations when no snapshot comes (a stalled collector)
READINESS_EVERY = 30.0


class Describes(Protocol):
    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class StatusConfig:
    settings: Mapping[str, Any]  # the effective settings, secrets redacted ("config")
    host_proc: str | None  # the /proc per-process shares are read from; None with them off


class StatusPage:
    def __init__(
        self,
        config: StatusConfig,
        *,
        identity: NodeIdentity,
        bus: SnapshotBus,
        stalled: Callable[[], Reason | None],
        board: StatusBoard,
        supervisor: Supervisor,
        pipeline: Pipeline,
        metrics: AgentMetrics,
        attribution: Describes,
        parts: dict[str, Describes | None],
    ) -> None:
        self._config = config
        self._identity = identity
        self._bus = bus
        self._stalled = stalled  # the collector's: a pass or an NVML call past its bound
        self._board = board
        self._supervisor = supervisor
        self._pipeline = pipeline
        self._metrics = metrics
        self._attribution = attribution
        self._parts = parts  # labels, pods, trail, hardware: each one's own part
        self.started_at = datetime.now(UTC)

    def liveness(self) -> tuple[bool, list[str]]:
        problems = self._supervisor.problems()
        stalled = self._stalled()
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
            shown = None if health.reason is None else Reason(health.reason, health.figures)
            self._board.set(f"exporter:{name}", health.state, shown)
        if not self._pipeline.ready(healths):
            problems.extend(f"exporter {n}: {h.reason}" for n, h in healths.items())
        ok = not problems
        self._metrics.health_check_success.set(1 if ok else 0)
        return ok, problems

    async def run(self, snapshots: Subscription, every: float = READINESS_EVERY) -> None:
        """Keep readiness (and its gauge) current without anyone probing: after each snapshot
        (a collection, an attribution) and at least every `every` seconds, since a stalled
        collector publishes none. Until the bus closes."""
        while True:
            self.readiness()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    if await snapshots.next() is None:
                        return

    def status(self) -> dict[str, Any]:
        ready, problems = self.readiness()
        identity = self._identity
        last = self._bus.latest
        inventory = None if last is None else last.inventory
        count, source = (None, None) if last is None else last.expected_gpus
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
                **(
                    NodeHealth().as_dict()
                    if last is None
                    else health_status(last.health, last.inventory, last.attribution)
                ),
                "expected_gpus": {"count": count, "source": source},
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
            "attribution": {**self._attribution.status(), **parts},
            "processes": process_status(
                PROCESSES_OFF if last is None else last.processes, self._config.host_proc
            ),
            "usage": None
            if last is None
            else usage_status(last.inventory, last.samples, last.attribution, last.processes),
            "exporters": [w.describe() for w in self._pipeline.workers],
            "config": self._config.settings,
        }


def process_status(view: ProcessView, host_proc: str | None) -> dict[str, Any]:
    """The per-process shares in /status: how many processes, how many attributed, and why
    the others are not."""
    uses = [u for d in view.devices.values() for u in d.processes]
    return {
        "state": view.state,
        "reason": view.reason or None,
        "host_proc": host_proc,
        "processes": len(uses),
        "attributed": sum(1 for u in uses if u.holder is not None),
        "unattributed": dict(Counter(u.reason for u in uses if u.holder is None)),
    }
