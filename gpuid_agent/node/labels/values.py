"""Serials as Kubernetes label values: ≤ 63 characters of `[A-Za-z0-9._-]`, alphanumeric at
both ends.

A serial that is already valid is used as is (gpuid's labels and jq queries keep working). One
that is not is made deterministic and collision-resistant: its valid characters (others become
`-`), cut to leave room, then `-` and 10 hex digits of the SHA-256 of the raw serial. The same
raw serial always gives the same value; two different raw serials never share one in practice.
The raw serial stays available in the detail annotation.
"""

from __future__ import annotations

import hashlib
import re

MAX_LABEL_VALUE = 63
DIGEST_CHARS = 10
_VALID = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)?$")
_INVALID_CHAR = re.compile(r"[^A-Za-z0-9._-]")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def is_valid_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_VALUE and _VALID.match(value) is not None


def digest(raw: str) -> str:
    # surrogatepass: NVML bytes decoded with surrogateescape must still hash, not raise
    data = raw.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def label_value(raw: str) -> tuple[str, bool]:
    """(label value, exact): exact is False when the serial had to be rewritten."""
    if raw and is_valid_label_value(raw):
        return raw, True
    readable = _EDGE.sub("", _INVALID_CHAR.sub("-", raw))
    room = MAX_LABEL_VALUE - DIGEST_CHARS - 1
    readable = _EDGE.sub("", readable[:room])
    suffix = digest(raw)
    return (f"{readable}-{suffix}" if readable else suffix), False
