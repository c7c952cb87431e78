"""The FAULT setting: faults a simulated node injects, `<kind>:gpu<N>[:<link>][@<delay>]`.

Kinds: `xid<code>` (an XID event), `lost`, `remap-pending`, `remap-failure`, `ecc-growth`,
`ecc-uncorrected`, `retired-pending`, `thermal`, `power-brake`, `hw-slowdown`,
`persistence-off`, `fabric-degraded`, `pcie-down` (link trained to half its width),
`pcie-gen` (link below its generation while busy), `pcie-replay` (replays growing),
`gpu-replaced` (another serial and UUID in the slot), and the per-link
`nvlink-down:gpu<N>:<link>` and `nvlink-errors:gpu<N>:<link>`. The optional delay
(`@30s`, `@2m`) starts the fault that long after the agent starts, so a demo shows the
transition.

A pure parser with no dependencies, so config validation and the simulator share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAULT_KINDS = (
    "lost",
    "remap-pending",
    "remap-failure",
    "ecc-growth",
    "ecc-uncorrected",
    "retired-pending",
    "thermal",
    "power-brake",
    "hw-slowdown",
    "persistence-off",
    "fabric-degraded",
    "pcie-down",
    "pcie-gen",
    "pcie-replay",
    "nvlink-down",
    "nvlink-errors",
    "gpu-replaced",
)
LINK_KINDS = frozenset({"nvlink-down", "nvlink-errors"})
_SPEC = re.compile(
    r"^(?P<kind>xid(?P<code>\d{1,6})|[a-z-]+):gpu(?P<gpu>\d{1,3})(?::(?P<link>\d{1,2}))?"
    r"(?:@(?P<delay>\d{1,6}(?:\.\d+)?)(?P<unit>ms|s|m|h)?)?$"
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # one of FAULT_KINDS, or "xid"
    gpu: int
    code: int | None = None  # the XID code for kind "xid"
    delay: float = 0.0
    link: int | None = None  # the NVLink of an nvlink-* fault

    def __str__(self) -> str:
        kind = f"xid{self.code}" if self.kind == "xid" else self.kind
        link = f":{self.link}" if self.link is not None else ""
        return f"{kind}:gpu{self.gpu}{link}" + (f"@{self.delay:g}s" if self.delay else "")


def parse_fault(text: str) -> Fault:
    """One fault spec; ValueError saying what is wrong (never echoing the text: a value set
    in the wrong variable may be a secret)."""
    match = _SPEC.match(text.strip().lower())
    if match is None:
        raise ValueError(
            "bad fault: expected <kind>:gpu<N>[@<delay>], "
            "e.g. xid79:gpu2, lost:gpu0@30s or nvlink-down:gpu0:3"
        )
    kind, code = match.group("kind"), match.group("code")
    if code is None and kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind; choose from xid<code>, {', '.join(FAULT_KINDS)}")
    link = int(match.group("link")) if match.group("link") is not None else None
    if (link is None) == (kind in LINK_KINDS):
        want = "needs a link: <kind>:gpu<N>:<link>" if link is None else "takes no link"
        raise ValueError(f"bad fault: {kind} {want}")
    delay = 0.0
    if match.group("delay"):
        delay = float(match.group("delay")) * _UNITS[match.group("unit") or "s"]
    return Fault(
        kind="xid" if code is not None else kind,
        gpu=int(match.group("gpu")),
        code=int(code) if code is not None else None,
        delay=delay,
        link=link,
    )


def parse_faults(items: list[str]) -> list[Fault]:
    """Every spec, reporting all bad ones at once."""
    faults, problems = [], []
    for position, item in enumerate(items, 1):
        try:
            faults.append(parse_fault(item))
        except ValueError as exc:
            problems.append(f"entry {position}: {exc}")
    if problems:
        raise ValueError("; ".join(problems))
    return faults
