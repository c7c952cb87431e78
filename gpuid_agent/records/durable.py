"""The hand-off of records that a state file owes (allocation starts and ends, GPU swaps):
exactly once across crashes, because the state and what it owes are saved together first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from gpuid_agent.records.serialize import from_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import WireError
from gpuid_agent.state.state_file import WireRecord

_log = log.get("records")


class Owing(Protocol):
    """A state that keeps, in its state file, the records it owes (in their wire form) until
    they are handed off."""

    pending: list[WireRecord]

    async def save(self) -> None: ...


def readable(owed: Sequence[WireRecord]) -> list[AnyRecord]:
    """The owed records, typed; one a state file holds damaged is logged and set aside (the
    rest still go): it cannot be sent as a record, and keeping it would block the others."""
    records: list[AnyRecord] = []
    for wire in owed:
        try:
            records.append(from_wire(wire))
        except WireError as exc:
            _log.error(
                "owed record in the state file unreadable; set aside", extra={"error": str(exc)}
            )
    return records


async def publish_owed(
    state: Owing, publish_durable: Callable[[list[AnyRecord]], Awaitable[None]]
) -> int:
    """Write-ahead hand-off: the owed records are saved in the state file with the state that
    owes them, handed durably to every exporter (`Pipeline.publish_durable`), then cleared. A
    kill at any point re-publishes them on restart under the same record ids; none is lost.
    Returns how many were handed off."""
    await state.save()
    records = readable(state.pending)
    await publish_durable(records)
    state.pending = []
    await state.save()
    return len(records)
