"""XID classification from NVIDIA's XID catalogue, kept as data in `xid_catalog.json`.

The file holds every code the catalogue lists (Ampere and newer GPUs) with its mnemonic, a short
description, the GPUs it applies to, the catalogue's immediate and investigatory resolution
buckets, driver notes, and a category. An XID's state and action come from its immediate
bucket through the file's `buckets` table, except where an entry's `agent` block says
otherwise and why. Codes the catalogue marks unused (immediate bucket CONTACT_SUPPORT) are
judged by the `unused` row: never expected, so worth a look, but not a reason to drain a node.

A *latched* XID keeps its GPU in that state until the agent restarts (a reboot restarts it); the
others hold for `XID_HOLD` after the last occurrence and then clear. A code outside the
catalogue is reported as unknown (degraded, check the workload), never dropped. The same XID
repeated `XID_REPEAT_COUNT` times within `XID_REPEAT_WINDOW` raises its action one step.
docs/health.md carries the table, generated from the same file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from types import MappingProxyType
from typing import Any, Literal, cast

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


@dataclass(frozen=True, slots=True)
class XidCatalog:
    source: str
    retrieved: str
    entries: Mapping[int, XidEntry]


def _judgement(raw: Mapping[str, Any], where: str) -> tuple[XidState, Action, bool]:
    state, action, latched = raw.get("state"), raw.get("action"), raw.get("latched")
    if state not in _STATES or action not in ACTIONS or not isinstance(latched, bool):
        raise ValueError(f"{where}: bad judgement {dict(raw)!r}")
    return cast(XidState, state), cast(Action, action), latched


def parse_catalog(text: str) -> XidCatalog:
    """The catalogue from the data file's text; ValueError naming the first bad entry."""
    doc = json.loads(text)
    buckets = {name: _judgement(raw, f"bucket {name}") for name, raw in doc["buckets"].items()}
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
                code, raw["description"], state, action, latched, raw["category"], immediate
            ),
        )
    return XidCatalog(doc["source"], doc["retrieved"], MappingProxyType(entries))


def load_catalog() -> XidCatalog:
    text = resources.files(__package__).joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return parse_catalog(text)


CATALOG = load_catalog()
XID_TABLE: Mapping[int, XidClass] = MappingProxyType(
    {code: entry.judged for code, entry in CATALOG.entries.items()}
)
CRITICAL_XIDS = frozenset(code for code, c in XID_TABLE.items() if c.state == "unhealthy")


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


def escalate(cls: XidClass, repeats: int, window: str) -> XidClass:
    """`cls` one action step stronger, for an XID seen `repeats` times within `window`.

    A counted-only XID (healthy) stays so: XID 45 follows every aborted job. The strongest
    action cannot go further.
    """
    if cls.state == "healthy" or cls.action == ACTIONS[-1]:
        return cls
    action = ACTIONS[ACTIONS.index(cls.action) + 1]
    return replace(cls, action=action, name=f"{cls.name} (seen {repeats} times in {window})")
