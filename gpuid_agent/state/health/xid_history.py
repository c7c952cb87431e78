"""One GPU's XIDs over time: counts, the latched ones, the recent ones, and the repeats.

A latched XID holds until the GPU is reset, the node reboots or an operator clears it
(`clear`); the others hold for `XID_HOLD`. Repeats escalate twice over: the same code
`repeat_count` times within `repeat_window` raises its action one step, and the same code
seen in three boots (again after two reboots) asks for hardware inspection. What must outlive
the agent (latched codes with their bucket, the boots each code was seen in, the repeats within
the window) goes to and from `as_state`. Repeats are kept as wall-clock times (the monotonic
clock restarts with the agent) and taken back in the same boot only: a reboot resets the GPU,
and a code seen again after reboots is the boots' escalation.

With the kernel log read too (`pair_window` > 0) one XID arrives twice, as an NVML event and
as its kernel line: whichever comes second within `pair_window` is its twin and is not counted
again. A line after its event takes back the event's judgement and puts its own (it says more:
the NVLink5 subcode's bucket, the process); an event after its line changes nothing.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuid_agent.state.health import checks as rules
from gpuid_agent.state.health.xid import (
    XidClass,
    XidDetail,
    escalate,
    escalate_after_reboots,
    judge_xid,
)

BOOTS_KEPT = 3  # the boots a code is remembered in: enough for "again after two reboots"
REPEATS_KEPT = 64  # per code across a restart: XID_REPEAT_COUNT above it counts afresh
PAIR_WINDOW = 5.0  # an NVML event and a kernel line of the same XID this close are one XID
Source = Literal["nvml", "kernel"]


@dataclass(frozen=True, slots=True)
class _Unpaired:
    """An XID counted from one source that the other may still report."""

    at: float
    source: Source
    judged: XidClass  # as judged, escalations included, so its twin can take it back
    prior: XidClass | None  # what was latched for its code before it


@dataclass(slots=True)
class XidHistory:
    repeat_count: int = 0
    repeat_window: float = 3600.0
    counts: Counter[int] = field(default_factory=Counter)
    last: int | None = None
    latched: dict[int, XidClass] = field(default_factory=dict)  # by code
    recent: list[tuple[float, XidClass]] = field(default_factory=list)
    # per code, for repeats: (monotonic, wall-clock epoch seconds) of each occurrence
    times: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    boots: dict[int, list[str]] = field(default_factory=dict)  # per code, oldest first
    pair_window: float = 0.0  # > 0: XIDs come from NVML and the kernel log, pair them up
    unpaired: list[_Unpaired] = field(default_factory=list)
    rebooted: bool = False  # latched XIDs of an earlier boot were restored, and so cleared

    def take_rebooted(self) -> bool:
        """Whether a reboot cleared latched XIDs restored for this GPU; told once."""
        rebooted, self.rebooted = self.rebooted, False
        return rebooted

    def record(
        self,
        code: int,
        now: float,
        boot: str | None,
        *,
        detail: XidDetail | None = None,
        recovery_field: bool = True,
        source: Source = "nvml",
        wall: float = 0.0,
    ) -> bool | None:
        """Count one occurrence (at monotonic `now`, wall-clock `wall`); True when what
        outlives the agent changed, None when it is the NVML twin of a kernel line already
        counted (nothing changes)."""
        twin = self._twin(code, source, now)
        if twin is not None and source != "kernel":
            return None
        if twin is not None:
            self._take_back(twin)
        else:
            self.counts[code] += 1
            self.last = code
        cls = judge_xid(code, detail, recovery_field=recovery_field)
        prior = self.latched.get(cls.code)
        changed = False
        if cls.state != "healthy":
            if boot is not None:
                seen = self.boots.setdefault(cls.code, [])
                if boot not in seen:
                    seen.append(boot)
                    del seen[:-BOOTS_KEPT]
                    changed = True
                cls = escalate_after_reboots(cls, len(seen))
            cls = self._repeated(cls, now, wall if twin is None else None)
            changed |= twin is None and self.repeat_count > 0
            if cls.latched:
                changed |= prior is None or prior.bucket != cls.bucket
                self.latched[cls.code] = rules.worst_xid([c for c in (prior, cls) if c]) or cls
            else:
                self.recent.append((now, cls))
        if twin is None and self.pair_window > 0:
            self.unpaired.append(_Unpaired(now, source, cls, prior))
        return changed

    def _twin(self, code: int, source: Source, now: float) -> _Unpaired | None:
        """The XID from the other source this one is the twin of, if any (taken off)."""
        self.unpaired = [u for u in self.unpaired if now - u.at < self.pair_window]
        for i, u in enumerate(self.unpaired):
            if u.source != source and u.judged.code == code:
                return self.unpaired.pop(i)
        return None

    def _take_back(self, twin: _Unpaired) -> None:
        code = twin.judged.code
        if twin.judged.latched and code in self.latched:
            if twin.prior is None:
                del self.latched[code]
            else:
                self.latched[code] = twin.prior
        self.recent = [(t, c) for t, c in self.recent if c is not twin.judged]

    def _repeated(self, cls: XidClass, now: float, wall: float | None) -> XidClass:
        """`cls` escalated if its code repeated; `wall` None: not counted (a twin)."""
        seen = self.times.setdefault(cls.code, deque())
        if wall is not None:
            seen.append((now, wall))
        while seen and seen[0][0] <= now - self.repeat_window:
            seen.popleft()
        if self.repeat_count <= 0 or len(seen) < self.repeat_count:
            return cls
        return escalate(cls, len(seen), rules.format_window(self.repeat_window))

    def active(self, now: float, hold: float) -> XidClass | None:
        """The worst XID holding now (latched, or recent within `hold`)."""
        self.recent = [(t, c) for t, c in self.recent if now - t < hold]
        return rules.worst_xid([*self.latched.values(), *(c for _, c in self.recent)])

    def clear(self) -> bool:
        """Forget what holds the GPU's state (after a reset, a reboot or an operator's
        request); counts and the boots each code was seen in stay. True when something
        was cleared."""
        had = bool(self.latched or self.recent or any(self.times.values()))
        self.latched.clear()
        self.recent.clear()
        self.times.clear()
        self.unpaired.clear()  # a twin arriving now counts afresh
        return had

    # ---- across restarts -----------------------------------------------------------------

    def as_state(self, boot: str | None) -> dict[str, Any]:
        kept = min(self.repeat_count, REPEATS_KEPT)
        repeats = {str(c): [w for _, w in seen][-kept:] for c, seen in sorted(self.times.items())}
        return {
            "latched": [
                {"code": code, "boot_id": boot, "bucket": cls.bucket}
                | ({"recovery_action": cls.recovery_action} if cls.recovery_action else {})
                for code, cls in sorted(self.latched.items())
            ],
            "boots": {str(code): list(seen) for code, seen in sorted(self.boots.items())},
            **(
                {"repeats": {c: w for c, w in repeats.items() if w}, "repeats_boot_id": boot}
                if kept
                else {}
            ),
        }

    def restore(
        self, saved: Mapping[str, Any], boot: str | None, now: float = 0.0, wall: float = 0.0
    ) -> None:
        """Take back what a previous run saved (`now`, `wall`: the monotonic and wall clocks
        now). Latched codes and repeats of another boot are gone (the reboot was their reset),
        repeats older than the window too; a malformed entry is skipped (the caller validated
        the shape)."""
        if boot is not None and saved.get("repeats_boot_id") == boot:
            for code, walls in saved.get("repeats", {}).items():
                recent = sorted(w for w in walls if 0 <= wall - w < self.repeat_window)
                if recent:
                    self.times[int(code)] = deque((now - (wall - w), w) for w in recent)
        for code, seen in saved.get("boots", {}).items():
            self.boots[int(code)] = [str(b) for b in _strings(seen)][-BOOTS_KEPT:]
        for item in saved.get("latched", []):
            if boot is None or item.get("boot_id") != boot:
                self.rebooted |= boot is not None  # the reboot was their reset
                continue
            bucket = item.get("bucket")  # a kernel line's subcode bucket, kept
            action = item.get("recovery_action")  # XID 154 judged by its line's action
            action = action if isinstance(action, int) and not isinstance(action, bool) else None
            detail = XidDetail(bucket=bucket, recovery_action=action) if bucket or action else None
            cls = judge_xid(int(item["code"]), detail, recovery_field=action is None)
            if cls.latched:
                seen = len(self.boots.get(cls.code, ()))
                self.latched[cls.code] = escalate_after_reboots(cls, seen)


def _strings(values: Iterable[Any]) -> list[str]:
    return [v for v in values if isinstance(v, str)]
