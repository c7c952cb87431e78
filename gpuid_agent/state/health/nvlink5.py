"""NVLink5 XIDs (144-150) judged per row of NVIDIA's decode table, kept as data in
`nvlink5_decode.json`.

The NVML event gives only the code; the kernel log line adds the unit, the registers and the
link (`sources.kmsg.lines.NvLink5Detail`). A row's immediate bucket is judged the way the
catalogue judges buckets (xid_catalog.json's `buckets`). XID_154_EVAL ("take XID 154's action,
else restart the application") is judged as RESTART_APP: XID 154 speaks for itself. A line no
row matches is judged as the code without detail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from types import MappingProxyType
from typing import Any, cast

from gpuid_agent.sources.kmsg.lines import NvLink5Detail
from gpuid_agent.state.health.verdicts import Action
from gpuid_agent.state.health.xid import CATALOG_FILE, XidClass, XidState, classify_xid

DECODE_FILE = "nvlink5_decode.json"
_DEFERS_TO_154 = "XID_154_EVAL"
_BY = ("any", "error_status", "subcode")


def _load(name: str) -> Any:
    return json.loads(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))


def parse_decode(doc: Mapping[str, Any], buckets: Mapping[str, Any]) -> Mapping[int, Any]:
    """{code: {unit: rule}} from the decode file; ValueError naming the first rule that is
    malformed or names a bucket the catalogue does not judge."""
    codes: dict[int, Any] = {}
    for code, units in doc["codes"].items():
        for unit, rule in units.items():
            by = rule.get("by")
            named = [rule.get("bucket")] if by == "any" else list(rule.get("rows", {}).values())
            bad = [b for b in named if b != _DEFERS_TO_154 and b not in buckets]
            if by not in _BY or not named or bad:
                raise ValueError(f"NVLink5 decode, XID {code} {unit}: bad rule {rule!r}")
        codes[int(code)] = MappingProxyType(dict(units))
    return MappingProxyType(codes)


_CATALOG_BUCKETS: Mapping[str, Any] = MappingProxyType(_load(CATALOG_FILE)["buckets"])
DECODE = parse_decode(_load(DECODE_FILE), _CATALOG_BUCKETS)


def decode_bucket(code: int, detail: NvLink5Detail) -> str | None:
    """The sheet's immediate bucket for this line; None where no row says."""
    units = DECODE.get(code)
    rule = None if units is None else units.get(detail.unit) or units.get("*")
    if rule is None:
        return None
    if rule["by"] == "any":
        return str(rule["bucket"])
    key = str(detail.subcode) if rule["by"] == "subcode" else f"0x{detail.error_status:08x}"
    bucket = rule["rows"].get(key)
    return None if bucket is None else str(bucket)


def judge_nvlink5(code: int, detail: NvLink5Detail | None) -> XidClass:
    """The class of an NVLink5 XID given what its kernel log line says."""
    cls = classify_xid(code)
    bucket = None if detail is None else decode_bucket(code, detail)
    if bucket is None or detail is None:
        return cls
    judged = _CATALOG_BUCKETS["RESTART_APP" if bucket == _DEFERS_TO_154 else bucket]
    state, action = judged["state"], judged["action"]
    where = f"link {detail.link}" if detail.link is not None else "no single link"
    severity = "fatal" if detail.fatal else "non-fatal"
    return replace(
        cls,
        state=cast(XidState, state),
        action=cast(Action, action),
        latched=bool(judged["latched"]),
        bucket=bucket,
        name=f"{cls.name}; {detail.unit} {severity}, {where}, status "
        f"0x{detail.error_status:08x}: {bucket}",
    )
