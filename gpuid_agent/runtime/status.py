"""Component states shown in /status and used by /readyz; each change is logged once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from gpuid_agent.runtime import log

State = Literal["starting", "ok", "degraded", "unavailable", "stalled", "disabled"]
_log = log.get("status")


@dataclass(frozen=True, slots=True)
class ComponentState:
    state: State
    reason: str | None
    since: datetime

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "since": self.since.isoformat()}


class StatusBoard:
    def __init__(self) -> None:
        self._components: dict[str, ComponentState] = {}

    def set(self, name: str, state: State, reason: str | None = None) -> bool:
        """Record a component's state; returns True (and logs) only when it changed."""
        current = self._components.get(name)
        if current is not None and current.state == state and current.reason == reason:
            return False
        self._components[name] = ComponentState(state, reason, datetime.now(UTC))
        level = 30 if state in ("degraded", "unavailable", "stalled") else 20
        _log.log(level, f"{name} is {state}", extra={"target": name, "reason": reason})
        return True

    def get(self, name: str) -> ComponentState | None:
        return self._components.get(name)

    def is_ok(self, name: str) -> bool:
        current = self._components.get(name)
        return current is not None and current.state == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {name: c.as_dict() for name, c in sorted(self._components.items())}
