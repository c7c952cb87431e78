"""Component states shown in /status and used by /readyz; each change is logged once.

A reason says what is wrong in words that stay the same while it stays wrong; the counts that
move meanwhile (batches held, seconds a call has run) are its figures. A change of state or of
the words is logged; new figures only update /status."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from gpuid_agent.runtime import log

State = Literal["starting", "ok", "degraded", "unavailable", "stalled", "disabled"]
Figures = Mapping[str, int | float]
_log = log.get("status")


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a component is in its state: stable `text`, and the `figures` that move."""

    text: str
    figures: Figures = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.figures:
            return self.text
        shown = ", ".join(f"{name} {value:g}" for name, value in self.figures.items())
        return f"{self.text} ({shown})"


@dataclass(frozen=True, slots=True)
class ComponentState:
    state: State
    reason: str | None
    since: datetime
    figures: Figures = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "state": self.state,
            "reason": self.reason,
            "since": self.since.isoformat(),
        }
        if self.figures:
            shown["figures"] = dict(self.figures)
        return shown


class StatusBoard:
    def __init__(self) -> None:
        self._components: dict[str, ComponentState] = {}

    def set(self, name: str, state: State, reason: str | Reason | None = None) -> bool:
        """Record a component's state; returns True (and logs) only when its state or its
        reason's text changed. New figures alone are kept without a log line."""
        text, figures = (
            (reason.text, reason.figures) if isinstance(reason, Reason) else (reason, {})
        )
        current = self._components.get(name)
        if current is not None and current.state == state and current.reason == text:
            if current.figures != figures:
                self._components[name] = ComponentState(state, text, current.since, figures)
            return False
        self._components[name] = ComponentState(state, text, datetime.now(UTC), figures)
        level = 30 if state in ("degraded", "unavailable", "stalled") else 20
        extra: dict[str, Any] = {"target": name, "reason": text}
        if figures:
            extra["figures"] = dict(figures)
        _log.log(level, f"{name} is {state}", extra=extra)
        return True

    def get(self, name: str) -> ComponentState | None:
        return self._components.get(name)

    def is_ok(self, name: str) -> bool:
        current = self._components.get(name)
        return current is not None and current.state == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {name: c.as_dict() for name, c in sorted(self._components.items())}
