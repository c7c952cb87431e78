"""The answers the renderers print: one shape for the four questions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from gpuid_agent.history.facts import Holding, Mark

Question = Literal["gpu", "node", "pod", "usage"]
UsageBy = Literal["namespace", "workload", "team"]


@dataclass(frozen=True, slots=True)
class Placement:
    """A stay: a GPU serial under one node, machine and chassis, from its first reading there
    to its last (both dies of a superchip are one serial: `slots` and `uuids` list each)."""

    serial: str
    cluster: str
    node: str
    machine: str
    chassis: str
    slots: tuple[str, ...]
    uuids: tuple[str, ...]
    model: str
    first_seen: datetime
    last_seen: datetime
    removed: bool  # a reading said it left the node


@dataclass(frozen=True, slots=True)
class UsageRow:
    """GPU-seconds and energy of one group (its labels in `group`, named by `columns`)."""

    group: tuple[str, ...]
    gpu_seconds: float
    energy_joules: float

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600

    @property
    def kwh(self) -> float:
        return self.energy_joules / 3_600_000


@dataclass(frozen=True, slots=True)
class Answer:
    """What one question found. `since`/`until` bound what was asked (`at` for a node at
    one moment); the lists hold what was found, in time order."""

    question: Question
    subject: str
    since: datetime | None = None
    until: datetime | None = None
    at: datetime | None = None
    placements: tuple[Placement, ...] = ()
    holdings: tuple[Holding, ...] = ()
    marks: tuple[Mark, ...] = ()
    usage: tuple[UsageRow, ...] = ()
    usage_columns: tuple[str, ...] = ()
    by: UsageBy | None = None
