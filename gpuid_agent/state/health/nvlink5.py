"""NVLink5 XIDs (144-150): the bucket NVIDIA's decode table gives each kernel line, kept as
data in `nvlink5_decode.json`.

The NVML event gives only the code; the kernel log line adds the unit, the registers and the
link (`sources.kmsg.lines.NvLink5Detail`). The row's immediate bucket is judged by `judge_xid`
through the catalogue's `buckets` (xid_catalog.json), XID_154_EVAL ("take XID 154's action,
else restart the application") included. A line no row matches has no bucket: it is judged as
the code without detail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

from gpuid_agent.sources.kmsg.lines import NvLink5Detail
from gpuid_agent.state.health.xid import CATALOG

DECODE_FILE = "nvlink5_decode.json"
_BY = ("any", "error_status", "subcode")


def parse_decode(doc: Mapping[str, Any], buckets: Mapping[str, Any]) -> Mapping[int, Any]:
    """{code: {unit: rule}} from the decode file; ValueError naming the first rule that is
    malformed or names a bucket the catalogue does not judge."""
    codes: dict[int, Any] = {}
    for code, units in doc["codes"].items():
        for unit, rule in units.items():
            by = rule.get("by")
            named = [rule.get("bucket")] if by == "any" else list(rule.get("rows", {}).values())
            bad = [b for b in named if b not in buckets]
            if by not in _BY or not named or bad:
                raise ValueError(f"NVLink5 decode, XID {code} {unit}: bad rule {rule!r}")
        codes[int(code)] = MappingProxyType(dict(units))
    return MappingProxyType(codes)


def _load() -> Any:
    text = resources.files(__package__).joinpath(DECODE_FILE).read_text(encoding="utf-8")
    return json.loads(text)


DECODE = parse_decode(_load(), CATALOG.buckets)


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
