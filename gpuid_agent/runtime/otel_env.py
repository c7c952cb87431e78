"""OpenTelemetry's environment conventions: `key=value` lists and the signal endpoints.

`OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_RESOURCE_ATTRIBUTES` are comma lists of `key=value`
with percent-encoded values (the W3C Baggage format without properties). Errors name the
position of the bad entry, never its text: header values are usually credentials.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# RFC 9110 token characters: what an HTTP header name may hold (and resource keys use).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE_IN_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# Set by the exporter itself; a configured value would make the body unreadable.
RESERVED_HEADERS = frozenset(
    {"content-type", "content-encoding", "content-length", "transfer-encoding", "host"}
)
URL = re.compile(r"https?://[^/\s]+(/\S*)?")


def parse_key_values(text: str) -> dict[str, str]:
    """`k=v,k2=v2` to a dict; values percent-decoded as UTF-8, blanks around entries ignored,
    empty entries skipped, a repeated key keeps its last value. ValueError on anything else."""
    out: dict[str, str] = {}
    for position, member in enumerate(text.split(","), 1):
        if not member.strip():
            continue
        key, sep, value = member.partition("=")
        key = key.strip()
        if not sep or not _TOKEN.fullmatch(key):
            raise ValueError(f"entry {position} is not key=value (key: letters, digits, -._~…)")
        try:
            out[key] = unquote(value.strip(), errors="strict")
        except UnicodeDecodeError:
            raise ValueError(f"entry {position}: value is not percent-encoded UTF-8") from None
    return out


def parse_headers(text: str) -> dict[str, str]:
    """Extra request headers from `OTEL_EXPORTER_OTLP_HEADERS`; ValueError naming the entry
    position for a malformed entry, a line break or control character in a decoded value
    (header injection), or a header the exporter sets itself."""
    headers = parse_key_values(text)
    for position, (key, value) in enumerate(headers.items(), 1):
        if _UNSAFE_IN_HEADER.search(value):
            raise ValueError(f"header {position}: value holds a control character")
        if key.lower() in RESERVED_HEADERS:
            raise ValueError(f"header {key} is set by the exporter and cannot be configured")
    return headers


def signal_endpoint(base: str, specific: str, signal: str) -> str:
    """The URL one signal (`logs`, `metrics`) is POSTed to: its own variable as is, else
    `v1/<signal>` appended to the base endpoint's path (after a `/`)."""
    if specific:
        return specific
    return f"{base.rstrip('/')}/v1/{signal}" if base else ""


def logs_endpoint(base: str, logs: str) -> str:
    return signal_endpoint(base, logs, "logs")
