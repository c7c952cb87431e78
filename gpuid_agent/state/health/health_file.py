"""The health state kept across restarts (STATE_DIR/health.json), the node's boot id, and the
operators' clear requests (STATE_DIR/health-clear/).

health.json holds, per GPU UUID, the latched XIDs with the boot they were latched in and the
bucket they were judged by (a kernel line's NVLink5 subcode decides it), the boots each XID
was seen in (for "again after two reboots"), the times of the repeats within
XID_REPEAT_WINDOW (wall clock, with their boot id) and the NVLinks seen up. It is hostile
input like every state file: anything that does not read back as that shape is logged once
and left out (the GPU starts afresh), never a reason to fail.

Clear requests (`gpuid-agent health clear`) are taken from STATE_DIR/health-clear/ each
collection: see `runtime.clear_requests`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from gpuid_agent.runtime import formats, log
from gpuid_agent.runtime.clear_requests import CLEAR_DIR, take_clear_requests
from gpuid_agent.state.health.xid_history import REPEATS_KEPT
from gpuid_agent.state.state_file import StateDir, write_atomically

_log = log.get("health.state")
STATE_FILE = formats.HEALTH
MAX_CODES = 256  # XID codes with saved repeats, per GPU
BOOT_ID = "sys/kernel/random/boot_id"


def read_boot_id(proc: str) -> str | None:
    """The kernel's boot id under `proc` (the host's /proc; the id is not namespaced)."""
    try:
        text = (Path(proc) / BOOT_ID).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        _log.warning(
            "no boot id: latched XIDs are not cleared by a reboot", extra={"error": str(exc)}
        )
        return None
    return text if 0 < len(text) <= 64 and text.isprintable() else None


class HealthFile:
    def __init__(self, state_dir: StateDir | None) -> None:
        self._state_dir = state_dir
        self.path = state_dir.path(STATE_FILE) if state_dir else None
        self.clear_dir = state_dir.path(CLEAR_DIR) if state_dir else None
        self._last: bytes | None = None
        self._newer_requests: set[str] = set()  # clear requests of a newer format, left there

    def load(self) -> dict[str, dict[str, Any]]:
        """Saved per-GPU state, each GPU's entry checked; {} without a usable file (an odd or
        unreadable one is set aside by `StateDir.load`: latched XIDs start afresh)."""
        gpus = self._state_dir.load(STATE_FILE, _gpus) if self._state_dir else None
        # None while the file there is of a newer format: no save overwrites it
        self.path = self._state_dir.path(STATE_FILE) if self._state_dir else None
        if gpus is None:
            return {}
        good = {k: v for k, v in gpus.items() if isinstance(k, str) and _gpu_ok(v)}
        if len(good) != len(gpus):
            _log.warning(
                "health state: malformed GPU entries left out",
                extra={"path": str(self.path), "left_out": len(gpus) - len(good)},
            )
        return good

    def save(self, state: Mapping[str, Any]) -> None:
        """Write the state when it differs from what was last written."""
        if self.path is None:
            return
        payload = orjson.dumps(
            formats.stamped(STATE_FILE, dict(state)), option=orjson.OPT_SORT_KEYS
        )
        if payload == self._last:
            return
        try:
            write_atomically(self.path, payload)
        except OSError as exc:
            _log.warning("cannot save health state", extra={"error": str(exc)})
            return
        self._last = payload

    def take_clear_requests(self) -> list[str]:
        """The GPUs (UUID or index) operators asked to clear; see `runtime.clear_requests`."""
        if self.clear_dir is None:
            return []
        return take_clear_requests(self.clear_dir, self._newer_requests)


def _gpus(raw: bytes) -> dict[Any, Any]:
    doc = orjson.loads(raw)
    formats.readable_format(STATE_FILE, doc)  # format 1 is the only one so far
    gpus = doc.get("gpus")
    if not isinstance(gpus, dict):
        raise ValueError("gpus must be an object")
    return gpus


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 for v in value
    )


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 40 and value.isidentifier()


def _gpu_ok(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    latched, boots = entry.get("latched", []), entry.get("boots", {})
    if not isinstance(latched, list) or not isinstance(boots, dict):
        return False
    if not all(
        isinstance(item, dict)
        and _ints([item.get("code")])
        and isinstance(item.get("boot_id"), (str, type(None)))
        and (item.get("bucket") is None or _name(item["bucket"]))
        for item in latched
    ):
        return False
    if not all(
        k.isdigit() and len(k) < 10 and isinstance(v, list) and all(isinstance(b, str) for b in v)
        for k, v in boots.items()
    ):
        return False
    return _ints(entry.get("nvlink_seen_up", [])) and _repeats_ok(entry)


def _repeats_ok(entry: dict[Any, Any]) -> bool:
    """Repeats: up to REPEATS_KEPT wall-clock times (epoch seconds) for each of up to
    MAX_CODES codes, and the boot they were seen in."""
    repeats, boot = entry.get("repeats", {}), entry.get("repeats_boot_id")
    if not isinstance(repeats, dict) or len(repeats) > MAX_CODES:
        return False
    if not isinstance(boot, (str, type(None))):
        return False
    return all(
        isinstance(k, str)
        and k.isdigit()
        and len(k) < 10
        and isinstance(v, list)
        and len(v) <= REPEATS_KEPT
        and all(_epoch(t) for t in v)
        for k, v in repeats.items()
    )


def _epoch(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < 2**40  # NaN and infinities fail too
    )
