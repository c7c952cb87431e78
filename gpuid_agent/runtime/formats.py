"""The format version of every file the agent keeps across restarts, and how a file's format is
judged against the one this version writes.

State files under STATE_DIR carry theirs as a top-level `"version"` (a file without one is
format 1, which every release so far wrote). Spooled batches carry theirs in the file name, so a
spool is indexed without reading a byte of it: `<created ns>-<batch id>-<count>.<form>` is format
1 (the name every release so far wrote and reads), `<created ns>-<batch id>-<count>.v<N>.<form>`
format N from 2 on. Health clear requests carry a `"version"` like state files.

A file of an older format is read (a version that changes a format reads the one before it); a
file of a newer format is kept where it is for the version that wrote it: never read, never
overwritten, never set aside or deleted (`NewerFormatError` says so). Whoever changes what a
file holds raises its number here.
"""

from __future__ import annotations

from typing import Any, Literal

from gpuid_agent.runtime.errors import NewerFormatError

ACCOUNTING = "accounting.json"
ALLOCATIONS = "allocations.json"
HARDWARE = "hardware.json"
HEALTH = "health.json"
CLEAR_REQUEST = "health-clear request"
SPOOL_BATCH = "spool batch"
# what this version writes, and the newest it reads
FORMATS: dict[str, int] = {
    ACCOUNTING: 1,
    ALLOCATIONS: 1,
    HARDWARE: 1,
    HEALTH: 1,
    CLEAR_REQUEST: 1,
    SPOOL_BATCH: 1,
}
STATE_FILES = (ACCOUNTING, ALLOCATIONS, HARDWARE, HEALTH)
FIELD = "version"
MAX_FORMAT = 9999  # a larger number is no format, but damage

Judgement = Literal["older", "current", "newer"]


def judge(kind: str, found: int) -> Judgement:
    """Whether a file of format `found` is older than what this version writes (and readable),
    this version's own, or newer than it knows."""
    known = FORMATS[kind]
    return "older" if found < known else "current" if found == known else "newer"


def stamped(kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with this version's format of `kind` as its first field."""
    return {FIELD: FORMATS[kind], **doc}


def readable_format(kind: str, doc: object) -> int:
    """The format of a parsed file of `kind`, when this version reads it (1 without the field);
    NewerFormatError when it is newer, ValueError when the field is no format at all."""
    if not isinstance(doc, dict):
        raise ValueError(f"{kind} is not a JSON object")
    found = doc.get(FIELD, 1)
    if not isinstance(found, int) or isinstance(found, bool) or not 0 < found <= MAX_FORMAT:
        raise ValueError(f"{kind}: format {found!r} is no format version")
    if judge(kind, found) == "newer":
        raise NewerFormatError(kind, found, FORMATS[kind])
    return found


def spool_marker(found: int) -> str:
    """The part of a batch file's name that says its format: nothing for format 1 (so every
    release reads it), `.v<N>` before the form from format 2 on."""
    return "" if found == 1 else f".v{found}"
