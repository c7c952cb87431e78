"""The hand-off of records that a state file owes (allocation starts and ends, GPU swaps):
exactly once across crashes, because the state and what it owes are saved together first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from gpuid_agent.records.serialize import Record


class Owing(Protocol):
    """A state that keeps, in its state file, the records it owes until they are handed off."""

    pending: list[Record]

    async def save(self) -> None: ...


async def publish_owed(
    state: Owing, publish_durable: Callable[[list[Record]], Awaitable[None]]
) -> int:
    """Write-ahead hand-off: the owed records are saved in the state file with the state that
    owes them, handed durably to every exporter (`Pipeline.publish_durable`), then cleared. A
    kill at any point re-publishes them on restart under the same record ids; none is lost.
    Returns how many were handed off."""
    await state.save()
    await publish_durable(state.pending)
    sent, state.pending = len(state.pending), []
    await state.save()
    return sent
