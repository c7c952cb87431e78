"""The allocations open on this node, what started and ended since the last look, and the
state file that keeps them across restarts.

An open allocation is kept as its start record, as the exporters received it: its end repeats
the start's fields (the GPU may be gone by then), and the state file has always held those
records. This module reads only the fields that identify an allocation; `records/allocations.py`
writes them.

Restarts: open allocations are kept in `<STATE_DIR>/allocations.json`. The first current
attribution after a restart is compared with that file: what is still there stays open (no
second start); what is gone ended while the agent was down (`observed` false), and its end
carries the file's `saved_at` as when it was last known open. The records a change owes are
kept in the file as `pending` until every exporter's spool holds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gpuid_agent.runtime import formats, log
from gpuid_agent.state.attribution import Allocation, Attribution
from gpuid_agent.state.state_file import StateDir, WireRecord, write_atomically

_log = log.get("allocations")
STATE_FILE = formats.ALLOCATIONS
# Key of an allocation while it is open: one device id of one container.
Key = tuple[str, str, str, str, str]
_KEY_FIELDS = ("namespace", "pod", "container", "resource_name", "device_id")


def allocation_key(a: Allocation) -> Key:
    h = a.holder
    return (h.namespace, h.pod, h.container, a.resource_name, a.device_id)


@dataclass(frozen=True, slots=True)
class Started:
    key: Key
    allocation: Allocation
    observed: bool  # False: already there when the agent started, with no state file to tell


@dataclass(frozen=True, slots=True)
class Ended:
    start: WireRecord
    observed: bool  # False: it ended while the agent was down
    last_seen_at: str | None  # when an unseen end was last known open


@dataclass(frozen=True, slots=True)
class AllocationChanges:
    ended: tuple[Ended, ...]
    started: tuple[Started, ...]


class OpenAllocations:
    """The open set, diffed against each current attribution, saved with the records it owes.

    `stamp` gives the time a save records as `saved_at`, in the records' own format (an end
    that was not seen carries it as `last_seen_at`).
    """

    def __init__(
        self, node: str, state_dir: StateDir | None = None, *, stamp: Callable[[], str]
    ) -> None:
        self.node = node
        self._stamp = stamp
        self._state_dir = state_dir
        self.open: dict[Key, WireRecord] = {}
        self.pending: list[WireRecord] = []  # owed by the saved open set, not yet in every spool
        # allocation_id → where its usage records stand (records/usage.py), saved with them
        self.usage: dict[str, list[Any]] = {}
        self._restored = False
        self._restored_saved_at = ""
        self._first = True
        self._load()
        # after the load: None while the file there is of a newer format (never overwritten)
        self.path = state_dir.path(STATE_FILE) if state_dir else None

    def update(self, attribution: Attribution) -> AllocationChanges | None:
        """What ended and started since the last current attribution; the ended leave the open
        set, the started join it once `opened` is given their start. Only a current
        attribution counts (None otherwise): a stale or missing mapping ends nothing."""
        if attribution.state != "current":
            return None
        first, restored = self._first, self._restored
        self._first = False
        current: dict[Key, Allocation] = {}
        for a in attribution.allocations:
            current.setdefault(allocation_key(a), a)
        ended: list[Ended] = []
        for key, start in list(self.open.items()):
            held = current.get(key)
            same_pod = held is not None and (
                not held.holder.pod_uid
                or not start.get("pod_uid")
                or held.holder.pod_uid == start["pod_uid"]
            )
            if not same_pod:
                # Seen gone on the first look after a restart: it ended while we were down.
                observed = not (first and restored)
                last_seen = None if observed else (self._restored_saved_at or None)
                ended.append(Ended(start, observed, last_seen))
                del self.open[key]
        # Found at start-up without a state file to tell: the start was not seen.
        started = tuple(
            Started(key, a, observed=not first)
            for key, a in current.items()
            if key not in self.open
        )
        return AllocationChanges(tuple(ended), started)

    @property
    def settled(self) -> bool:
        """Whether a current attribution was compared with the open set (and the state file)."""
        return not self._first

    def opened(self, key: Key, start: WireRecord) -> None:
        self.open[key] = start

    # ---- state file ------------------------------------------------------------------------

    def _load(self) -> None:
        # A damaged or odd file must not stop the agent: set aside, start as without STATE_DIR.
        state = self._state_dir.load(STATE_FILE, self._parse) if self._state_dir else None
        if state is None:
            return
        self.open, self.pending, self.usage, self._restored_saved_at = state
        self._restored = True
        _log.info("restored open allocations", extra={"count": len(self.open)})

    def _parse(
        self, raw: bytes
    ) -> tuple[dict[Key, WireRecord], list[WireRecord], dict[str, list[Any]], str]:
        state = orjson.loads(raw)
        formats.readable_format(STATE_FILE, state)  # format 1 is the only one so far
        if state.get("node") != self.node:
            raise ValueError("state file is for another node")
        records = [r for r in state["open"] if isinstance(r, dict)]
        opened = {_record_key(r): r for r in records}
        pending = [r for r in state.get("pending", []) if isinstance(r, dict)]
        # the open allocations' marks and the idle GPUs' (records/allocations.py prunes those
        # of GPUs gone at its first look)
        usage = {str(k): v for k, v in state.get("usage", {}).items() if _mark_ok(v)}
        return opened, pending, usage, str(state.get("saved_at") or "")

    def _state_bytes(self) -> bytes:
        return orjson.dumps(
            formats.stamped(
                STATE_FILE,
                {
                    "node": self.node,
                    "saved_at": self._stamp(),
                    "open": sorted(self.open.values(), key=lambda r: r["allocation_id"]),
                    "pending": self.pending,
                    "usage": self.usage,
                },
            ),
            option=orjson.OPT_SORT_KEYS,
        )

    async def save(self) -> None:
        if self.path is None:
            return
        try:
            await asyncio.to_thread(write_atomically, self.path, self._state_bytes())
        except OSError as exc:
            _log.warning("cannot save allocation state", extra={"error": str(exc)})

    async def refresh(self) -> None:
        """Re-save while allocations are open, so that after a crash `last_seen_at` bounds when
        an allocation that vanished meanwhile was last known to be open."""
        if self.open and not self._first:
            await self.save()


def _record_key(record: WireRecord) -> Key:
    values = tuple(record[f] for f in _KEY_FIELDS)
    if not all(isinstance(v, str) for v in values) or not isinstance(
        record.get("allocation_id"), str
    ):
        raise ValueError("malformed open allocation")
    return values


def _mark_ok(mark: Any) -> bool:
    """A usage mark as records/usage.py writes it: [since, period, base s, base J, s, J]."""
    return (
        isinstance(mark, list)
        and len(mark) == 6
        and isinstance(mark[0], str)
        and isinstance(mark[1], int)
        and all(isinstance(v, int | float) for v in (mark[2], mark[4], mark[5]))
        and (mark[3] is None or isinstance(mark[3], int | float))
    )
