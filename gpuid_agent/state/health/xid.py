"""XID classification from NVIDIA's XID catalogue, kept as data in `xid_catalog.json`.

The file holds every code the catalogue lists (Ampere and newer GPUs) with its mnemonic, a short
description, the GPUs it applies to, the catalogue's immediate and investigatory resolution
buckets, driver notes, and a category. An XID's state and action come from its immediate
bucket through the file's `buckets` table, except where an entry's `agent` block says
otherwise and why. Codes the catalogue marks unused (immediate bucket CONTACT_SUPPORT) are
judged by the `unused` row: never expected, so worth a look, but not a reason to drain a node.

A *latched* XID keeps its GPU in that state until the GPU is reset, the node reboots or an
operator clears it (see `tracker`); the others hold for `XID_HOLD` after the last occurrence
and then clear. A bucket marked `needs_detail` is decided by NVIDIA per subcode, which only the
kernel log carries: `judge_xid` takes that detail when a source has it. A code outside the
catalogue is reported as unknown (degraded, check the workload), never dropped. The same XID
repeated `XID_REPEAT_COUNT` times within `XID_REPEAT_WINDOW` raises its action one step.
docs/health.md carries the table, generated from the same file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from types import MappingProxyType
from typing import Any, Literal, cast

from gpuid_agent.state.health.recovery import recovery_verdict
from gpuid_agent.state.health.verdicts import ACTIONS, Action

XidState = Literal["healthy", "degraded", "unhealthy"]
_STATES = ("healthy", "degraded", "unhealthy")
CATALOG_FILE = "xid_catalog.json"


@dataclass(frozen=True, slots=True)
class XidClass:
    code: int
    name: str
    state: XidState  # "healthy": counted and shown, never changes the GPU's state
    action: Action
    latched: bool = False
    category: str = "unknown"
    bucket: str | None = None  # the catalogue's immediate resolution bucket
    known: bool = True  # False: the code is not in the catalogue
    needs_detail: bool = False  # NVIDIA decides it per subcode (kernel log)
    recovery_action: int | None = None  # XID 154 judged by the action its line names


@dataclass(frozen=True, slots=True)
class XidDetail:
    """What a kernel log line adds to an XID code (see `kernel.xid_detail`): the subcode of
    XIDs 144-150 and its bucket in NVIDIA's NVLink5 decode sheet, and the line's own words
    (the unit and link, XID 154's new recovery action, the process)."""

    subcode: int | None = None
    bucket: str | None = None  # NVIDIA's immediate bucket for this subcode, when known
    text: str | None = None
    recovery_action: int | None = None  # XID 154: the action the line says it changed to


@dataclass(frozen=True, slots=True)
class XidEntry:
    """One row of the catalogue as the data file has it."""

    code: int
    mnemonic: str
    description: str
    applies_to: tuple[str, ...]
    immediate: str | None
    investigatory: str | None
    category: str
    driver: str | None
    override: str | None  # why the agent judges it otherwise than its bucket says
    judged: XidClass
    note: str | None = None  # how the agent's checks treat it, where that needs saying


@dataclass(frozen=True, slots=True)
class XidCatalog:
    source: str
    retrieved: str
    entries: Mapping[int, XidEntry]
    source_version: str = ""
    sheet_sha256: str | None = None  # of NVIDIA's spreadsheet the file was built from
    source_file: str = ""  # the generated catalogue it was checked against, with its commit
    source_commit: str = ""  # and its SHA-256: the sheet itself was not at hand
    source_file_sha256: str = ""
    buckets: Mapping[str, tuple[XidState, Action, bool]] = field(
        default_factory=lambda: MappingProxyType({})
    )


_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _judgement(raw: Mapping[str, Any], where: str) -> tuple[XidState, Action, bool]:
    state, action, latched = raw.get("state"), raw.get("action"), raw.get("latched")
    if state not in _STATES or action not in ACTIONS or not isinstance(latched, bool):
        raise ValueError(f"{where}: bad judgement {dict(raw)!r}")
    return cast(XidState, state), cast(Action, action), latched


def _provenance(doc: Mapping[str, Any]) -> tuple[str, str | None]:
    version, sha = doc.get("source_version"), doc.get("sheet_sha256")
    if not isinstance(version, str) or not version:
        raise ValueError("catalogue: source_version missing")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise ValueError(f"catalogue: sheet_sha256 {sha!r} is not a lower-case SHA-256")
    return version, sha


def _source_file(doc: Mapping[str, Any]) -> tuple[str, str, str]:
    path, commit, sha = (
        doc.get("source_file"),
        doc.get("source_commit"),
        doc.get("source_file_sha256"),
    )
    if not isinstance(path, str) or not path:
        raise ValueError("catalogue: source_file missing")
    if not (isinstance(commit, str) and _COMMIT.fullmatch(commit)):
        raise ValueError(f"catalogue: source_commit {commit!r} is not a git commit")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise ValueError(f"catalogue: source_file_sha256 {sha!r} is not a lower-case SHA-256")
    return path, commit, sha


def parse_catalog(text: str) -> XidCatalog:
    """The catalogue from the data file's text; ValueError naming the first bad entry."""
    doc = json.loads(text)
    version, sha = _provenance(doc)
    buckets = {name: _judgement(raw, f"bucket {name}") for name, raw in doc["buckets"].items()}
    detailed = {name for name, raw in doc["buckets"].items() if raw.get("needs_detail") is True}
    entries: dict[int, XidEntry] = {}
    for raw in doc["xids"]:
        code = raw["code"]
        if not isinstance(code, int) or isinstance(code, bool) or code in entries:
            raise ValueError(f"XID entry {raw!r}: code missing, not an integer or repeated")
        immediate = raw.get("immediate")
        agent = raw.get("agent")
        if agent is not None:
            judged = _judgement(agent, f"XID {code}")
        elif raw["category"] == "unused" and immediate == "CONTACT_SUPPORT":
            judged = buckets["unused"]
        elif immediate in buckets:
            judged = buckets[immediate]
        else:
            raise ValueError(f"XID {code}: bucket {immediate!r} has no judgement")
        state, action, latched = judged
        entries[code] = XidEntry(
            code=code,
            mnemonic=raw["mnemonic"],
            description=raw["description"],
            applies_to=tuple(raw["applies_to"]),
            immediate=immediate,
            investigatory=raw.get("investigatory"),
            category=raw["category"],
            driver=raw.get("driver"),
            override=agent.get("why") if agent else None,
            judged=XidClass(
                code,
                raw["description"],
                state,
                action,
                latched,
                raw["category"],
                immediate,
                needs_detail=agent is None and immediate in detailed,
            ),
            note=raw.get("note"),
        )
    return XidCatalog(
        doc["source"],
        doc["retrieved"],
        MappingProxyType(entries),
        version,
        sha,
        *_source_file(doc),
        MappingProxyType(buckets),
    )


def load_catalog() -> XidCatalog:
    text = resources.files(__package__).joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return parse_catalog(text)


CATALOG = load_catalog()
XID_TABLE: Mapping[int, XidClass] = MappingProxyType(
    {code: entry.judged for code, entry in CATALOG.entries.items()}
)
CRITICAL_XIDS = frozenset(code for code, c in XID_TABLE.items() if c.state == "unhealthy")
RECOVERY_ACTION_XID = 154
_NAME_MAX = 240  # a verdict's reason stays one readable line
_XID_154 = CATALOG.buckets["XID_154"]
# Each action's next step when an XID repeats (within the window, or across reboots).
_NEXT_STEP: Mapping[str, Action] = {
    "none": "check_workload",
    "check_workload": "reset",
    "drain": "reset",
    "reset": "reboot",
    "reboot": "hardware_inspection",
}


def classify_xid(code: int) -> XidClass:
    """The class of an XID code; a code outside the catalogue (or not a code at all) is
    unknown: degraded, check the workload. The driver thought it worth reporting, so it is
    shown rather than ignored."""
    known = XID_TABLE.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if known is not None:
        return known
    return XidClass(
        code=code if isinstance(code, int) and not isinstance(code, bool) else -1,
        name="unknown XID (not in the catalogue)",
        state="degraded",
        action="check_workload",
        known=False,
    )


def judge_xid(
    code: int, detail: XidDetail | None = None, *, recovery_field: bool = True
) -> XidClass:
    """The verdict class of one XID occurrence.

    `detail` is what a kernel-log source knows of it: for a code NVIDIA decides per subcode
    (144-150), the subcode's bucket decides; without it such a code is degraded with the
    advice to read the kernel log, never a latched reboot. XID 154 is judged from the
    driver's recovery action (field 230, the recovery check) where the driver has the field
    (`recovery_field`); otherwise by the action its kernel line names, and without a line by
    its catalogue bucket. The line's own words end the reason.
    """
    cls = classify_xid(code)
    if cls.code == RECOVERY_ACTION_XID and not recovery_field:
        cls = _recovery_without_field(cls, detail)
    judged = CATALOG.buckets.get(detail.bucket) if detail and detail.bucket else None
    if cls.needs_detail and judged is not None and detail is not None:
        state, action, latched = judged
        sub = "" if detail.subcode is None else f", subcode {detail.subcode}"
        cls = replace(
            cls,
            name=f"{cls.name}{sub}",
            state=state,
            action=action,
            latched=latched,
            bucket=detail.bucket,
            needs_detail=False,
        )
    elif cls.needs_detail:
        cls = replace(cls, name=f"{cls.name}: check the kernel log for its subcode")
    if detail is None or not detail.text:
        return cls
    return replace(cls, name=f"{cls.name} ({detail.text})"[:_NAME_MAX])


def _recovery_without_field(cls: XidClass, detail: XidDetail | None) -> XidClass:
    """XID 154 on a driver older than field 230: the line says which action the driver now
    asks for (`... to 0x1 (GPU Reset Required)`), judged as the field's value would be; only
    an XID without its line falls back to the catalogue's bucket."""
    action_value = detail.recovery_action if detail is not None else None
    if action_value is None:
        state, action, latched = _XID_154
        return replace(cls, state=state, action=action, latched=latched)
    verdict = recovery_verdict(action_value)
    judged = cast(XidState, verdict.state) if verdict.state in _STATES else "degraded"
    return replace(
        cls,
        state=judged,
        action=verdict.action,
        latched=judged == "unhealthy",
        recovery_action=action_value,
    )


def escalate(cls: XidClass, repeats: int, window: str) -> XidClass:
    """`cls` one action step stronger, for an XID seen `repeats` times within `window`.

    A counted-only XID (healthy) stays so: XID 45 follows every aborted job. The strongest
    action cannot go further.
    """
    step = _NEXT_STEP.get(cls.action)
    if cls.state == "healthy" or step is None:
        return cls
    return replace(cls, action=step, name=f"{cls.name} (seen {repeats} times in {window})")


def escalate_after_reboots(cls: XidClass, boots: int) -> XidClass:
    """Hardware inspection for an XID seen again after two reboots (in `boots` >= 3 boots):
    a fault that a reboot does not cure is the hardware's."""
    if cls.state == "healthy" or boots < 3 or cls.action == "hardware_inspection":
        return cls
    return replace(
        cls, action="hardware_inspection", name=f"{cls.name} (again after {boots - 1} reboots)"
    )
