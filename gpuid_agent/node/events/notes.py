"""What a Node Event says: its reason from a fixed set, its type and action, and its note.

Pure: a health transition or a replaced GPU in, an `EventText` out. The note names the GPU
(index, serial, UUID), the check, its state and suggested action, the reason in words and the
pods hit, and stays within the API server's 1,024 bytes whatever it is fed: every value is made
printable, long ones are clipped, pods that do not fit are counted ("and 3 more") and the
whole is cut on a character boundary as a last resort.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from gpuid_agent.records.types import HardwareRecord
from gpuid_agent.state.attribution.holders import Holder
from gpuid_agent.state.health.verdicts import CheckStatus, Transition

EventType = Literal["Normal", "Warning"]
NOTE_LIMIT = 1024  # bytes: the API server refuses a longer note
_FIELD_LIMIT = 96  # characters of one identity field (serial, UUID, bus id, pod name)
_REASON_LIMIT = 400  # characters of a check's reason in words
_ELLIPSIS = "…"


@dataclass(frozen=True, slots=True)
class Reason:
    type: EventType
    action: str
    means: str  # for docs/health.md


# The fixed set of reasons, as docs/health.md lists them.
REASONS: Mapping[str, Reason] = {
    "GpuUnhealthy": Reason(
        "Warning", "Judged", "a GPU check became unhealthy, or its action changed while unhealthy"
    ),
    "GpuDegraded": Reason(
        "Warning", "Judged", "a GPU check became degraded, or its action changed while degraded"
    ),
    "GpuRecovered": Reason(
        "Normal", "Judged", "a GPU check is healthy again (or no longer judged: not supported)"
    ),
    "GpuLatchedCleared": Reason(
        "Normal",
        "Cleared",
        "the XIDs holding a GPU's `xid` check were cleared: a GPU reset seen through NVML, or "
        "an operator's `gpuid-agent health clear`",
    ),
    "GpuReplaced": Reason("Warning", "Replaced", "another GPU (serial) is in a PCI slot"),
    "NodeGpusUnhealthy": Reason(
        "Warning", "Judged", "a node-level check (`gpu_count`, `nvswitch`) became unhealthy"
    ),
    "NodeGpusDegraded": Reason("Warning", "Judged", "a node-level check became degraded"),
    "NodeGpusRecovered": Reason("Normal", "Judged", "a node-level check is healthy again"),
}
_CLEARED_BY = {"reset": "a GPU reset", "operator": "an operator", "reboot": "a node reboot"}


@dataclass(frozen=True, slots=True)
class EventText:
    """One occurrence to tell: what its Event says and when it happened. Two occurrences with
    the same `key` are the same event (a series), whenever they happen."""

    reason: str
    note: str
    observed: datetime

    @property
    def type(self) -> EventType:
        return REASONS[self.reason].type

    @property
    def action(self) -> str:
        return REASONS[self.reason].action

    @property
    def key(self) -> tuple[str, str]:
        return (self.reason, self.note)


def transition_event(transition: Transition, serial: str | None) -> EventText | None:
    """The Event a check transition makes (`serial`: its GPU's), or None for one that is no
    news to the Node (a check that went to `unknown` is never reported as a transition)."""
    t, now, was = transition, transition.current, transition.previous
    node = t.uuid is None
    if t.check == "xid" and t.cleared_by is not None:
        reason = "GpuLatchedCleared"
    elif now.state in ("unhealthy", "degraded"):
        reason = ("NodeGpus" if node else "Gpu") + now.state.capitalize()
    elif was is not None and was.state in ("unhealthy", "degraded"):
        reason = "NodeGpusRecovered" if node else "GpuRecovered"
    else:
        return None
    where = "node" if node else gpu_name(t.index, serial, t.uuid)
    what = f"{clean(t.check)} {now.state}"
    if reason == "GpuLatchedCleared":
        what += f", XIDs cleared by {_CLEARED_BY.get(t.cleared_by or '', 'a clear')}"
    if now.state in ("unhealthy", "degraded"):
        what += f", action {now.action}: {clip(now.reason or now.state, _REASON_LIMIT)}"
    if was is not None:
        what += f" (was {_status(was)})"
    return EventText(reason, compose(f"{where}: {what}", t.holders), now.since)


def replaced_event(
    record: HardwareRecord, holders: Iterable[Holder], observed: datetime
) -> EventText:
    """The Event for a GPU swapped under the node: another serial in the slot."""
    index, bus = record.index, clip(record.pci_bus_id)
    body = f"GPU {index} at {bus}" if index is not None else f"GPU at {bus}"
    body += f" replaced: serial {clip(record.old_serial or '?')} → {clip(record.new_serial or '?')}"
    if record.uuid:
        body += f", {clip(record.uuid)}"
    return EventText("GpuReplaced", compose(body, holders), observed)


def gpu_name(index: int | None, serial: str | None, uuid: str | None) -> str:
    serial_part = f"serial {clip(serial)}" if serial else "no serial"
    return f"GPU {index} ({serial_part}, {clip(uuid or '?')})"


def _status(status: CheckStatus) -> str:
    if status.state in ("unhealthy", "degraded") and status.reason:
        return f"{status.state}: {clip(status.reason, _REASON_LIMIT)}"
    return status.state


def compose(text: str, holders: Iterable[Holder]) -> str:
    """`text` and the pods hit, as many as fit in NOTE_LIMIT bytes (the rest counted)."""
    pods = list(dict.fromkeys(f"{clip(h.namespace)}/{clip(h.pod)}" for h in holders))
    note = fit(clean(text))
    if not pods:
        return note
    head = f"{note}. Pods hit: "
    size, shown = _size(head), 0
    for pod in pods:
        rest = len(pods) - shown - 1  # left over if this one is the last shown
        grown = size + _size(pod) + (2 if shown else 0)
        if grown + (_size(f" and {rest} more") if rest else 0) > NOTE_LIMIT:
            break
        size, shown = grown, shown + 1
    if shown:
        left = len(pods) - shown
        return head + ", ".join(pods[:shown]) + (f" and {left} more" if left else "")
    counted = f"{head}{len(pods)} pods"
    return counted if _size(counted) <= NOTE_LIMIT else note


def clean(text: str) -> str:
    """`text` printable on one line: lone surrogates and other unencodable code points become
    "?", control and separator characters a space."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return "".join(c if c.isprintable() else " " for c in text)


def clip(text: str, limit: int = _FIELD_LIMIT) -> str:
    text = clean(text)
    return text if len(text) <= limit else text[: limit - 1] + _ELLIPSIS


def fit(text: str, limit: int = NOTE_LIMIT) -> str:
    """`text` cut to at most `limit` UTF-8 bytes on a character boundary, marked when cut."""
    if _size(text) <= limit:
        return text
    room = limit - _size(_ELLIPSIS)
    return text.encode("utf-8")[:room].decode("utf-8", "ignore") + _ELLIPSIS


def _size(text: str) -> int:
    return len(text.encode("utf-8"))
