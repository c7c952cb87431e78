"""Node conditions for unhealthy GPU checks (NODE_CONDITIONS=true; needs nodes/status RBAC).

One condition type per check that can be unhealthy; it is True while at least one GPU (or the
node, for the GPU count) is unhealthy on that check, naming them in its message. Degraded states
stay on /status, metrics and records: a condition is for what should keep work off the node.

A condition is written only when it changes, with a strategic-merge patch of nodes/<name>/status
(merged by type, so other controllers' conditions are untouched). A condition type this agent
never set True is not written at all; one left True by an earlier run is set False once the
agent sees the check healthy, so a reboot that fixed the GPU also clears the condition.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, node_path
from gpuid_agent.state.health.verdicts import NodeHealth

_log = log.get("node_conditions")

CONDITION_TYPES: Mapping[str, str] = {
    "lost": "GpuLost",
    "xid": "GpuXidError",
    "recovery": "GpuRecoveryActionRequired",
    "ecc": "GpuEccError",
    "remapped_rows": "GpuRowRemapping",
    "fabric": "GpuFabricUnhealthy",
    "nvlink": "GpuNvlinkDown",
    "pcie": "GpuPcieLinkDown",
    "gpu_count": "GpuCountLow",
}
_REASONS = {
    "none": "GpuUnhealthy",
    "check_workload": "GpuCheckWorkload",
    "drain": "GpuDrainSuggested",
    "reset": "GpuResetSuggested",
    "reboot": "GpuRebootSuggested",
    "hardware_inspection": "GpuHardwareInspectionSuggested",
}
_HEALTHY = "GpuHealthy"
MESSAGE_LIMIT = 1024
COMPONENT = "node-conditions"


@dataclass(frozen=True, slots=True)
class Condition:
    status: str  # "True" / "False"
    reason: str
    message: str


def desired_conditions(health: NodeHealth) -> dict[str, Condition]:
    """Every condition type's wanted value for this snapshot."""
    problems: dict[str, list[tuple[str, str, str]]] = {t: [] for t in CONDITION_TYPES.values()}
    for gpu in health.gpus:
        for check, status in gpu.checks.items():
            kind = CONDITION_TYPES.get(check)
            if kind and status.state == "unhealthy":
                where = f"GPU {gpu.index} ({gpu.uuid})"
                problems[kind].append((where, status.reason or "unhealthy", status.action))
    for check, status in health.node_checks.items():
        kind = CONDITION_TYPES.get(check)
        if kind and status.state == "unhealthy":
            problems[kind].append(("node", status.reason or "unhealthy", status.action))
    wanted = {}
    for kind, found in problems.items():
        if not found:
            wanted[kind] = Condition("False", _HEALTHY, "no GPU is unhealthy on this check")
            continue
        ranks = list(_REASONS)
        action = max((a for _, _, a in found), key=ranks.index)
        message = "; ".join(f"{where}: {why}" for where, why, _ in found)
        if len(message) > MESSAGE_LIMIT:
            message = message[: MESSAGE_LIMIT - 1] + "…"
        wanted[kind] = Condition("True", _REASONS.get(action, "GpuUnhealthy"), message)
    return wanted


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeConditionWriter:
    def __init__(self, node: str, board: StatusBoard, *, timeout: float = 10.0) -> None:
        self.node = node
        self._board = board
        self._timeout = timeout
        self._client: KubeClient | None = None
        self._latest: NodeHealth | None = None
        self._wake = asyncio.Event()
        # what the Node carries for our types: status and lastTransitionTime; None: not read
        self._on_node: dict[str, tuple[Condition, str]] | None = None
        self.writes = 0

    def open(self, client: KubeClient | None) -> bool:
        """Write through the agent's API client; False (and the reason on /status) when
        there is none."""
        self._client = client
        if client is None:
            self._board.set(COMPONENT, "unavailable", "no Kubernetes API configuration found")
            return False
        self._board.set(COMPONENT, "starting")
        return True

    def offer(self, health: NodeHealth) -> None:
        self._latest = health
        self._wake.set()

    async def run(self) -> None:
        backoff = Backoff(base=1.0, cap=60.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._sync()
            except (KubeApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                reason = _describe(exc)
                self._board.set(COMPONENT, "degraded", reason)
                await asyncio.sleep(backoff.next())
                self._wake.set()  # try again with whatever is latest by then
                continue
            backoff.reset()
            self._board.set(COMPONENT, "ok")

    async def _sync(self) -> None:
        health = self._latest
        if health is None or self._client is None:
            return
        client = self._client
        if self._on_node is None:
            node = await client.request_json("GET", node_path(self.node), within=self._timeout)
            self._on_node = conditions_on(node)
        now = _rfc3339(datetime.now(UTC))
        patch = []
        changed: dict[str, tuple[Condition, str]] = {}
        for kind, want in desired_conditions(health).items():
            have = self._on_node.get(kind)
            if have is None and want.status == "False":
                continue  # never raised: nothing to say
            if have is not None and have[0] == want:
                continue
            since = have[1] if have is not None and have[0].status == want.status else now
            patch.append(
                {
                    "type": kind,
                    "status": want.status,
                    "reason": want.reason,
                    "message": want.message,
                    "lastTransitionTime": since,
                    "lastHeartbeatTime": now,
                }
            )
            changed[kind] = (want, since)
        if not patch:
            return
        await client.request_json(
            "PATCH",
            node_path(self.node) + "/status",
            body={"status": {"conditions": patch}},
            within=self._timeout,
        )
        self._on_node.update(changed)
        self.writes += 1
        _log.info(
            "node conditions written",
            extra={"conditions": {c["type"]: c["status"] for c in patch}},
        )


def conditions_on(node: Any) -> dict[str, tuple[Condition, str]]:
    """Our condition types as a Node (its JSON) carries them: value and lastTransitionTime;
    entries of the wrong shape are skipped."""
    status = node.get("status") if isinstance(node, Mapping) else None
    listed = status.get("conditions") if isinstance(status, Mapping) else None
    now = _rfc3339(datetime.now(UTC))
    found = {}
    for c in listed if isinstance(listed, list) else ():
        if not isinstance(c, Mapping) or c.get("type") not in CONDITION_TYPES.values():
            continue
        value = Condition(_text(c, "status"), _text(c, "reason"), _text(c, "message"))
        found[str(c["type"])] = (value, _text(c, "lastTransitionTime") or now)
    return found


def _text(condition: Mapping[str, Any], key: str) -> str:
    value = condition.get(key)
    return value if isinstance(value, str) else ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KubeApiError):
        return f"Node status update failed: {exc.status} {exc.detail}"
    return f"Node status update failed: {type(exc).__name__}: {exc}"
