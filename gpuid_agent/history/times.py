"""Times as a person gives and reads them: UTC unless `--tz` names a zone.

A time is an ISO 8601 date (`2025-03-01`: its midnight) or date and time (`2025-03-01T12:00`,
`2025-03-01 12:00:00Z`, `…+02:00`), or `now`; one without an offset is in the `--tz` zone.
Printed times are in that zone, to the second, with its offset (`Z` for UTC).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_FIXED = re.compile(r"([+-])(\d{2}):?(\d{2})")


def zone(name: str) -> tzinfo:
    """`UTC`, an IANA zone (`Europe/Berlin`) or a fixed offset (`+05:30`); ValueError else."""
    if name.upper() in ("UTC", "Z"):
        return UTC
    fixed = _FIXED.fullmatch(name)
    if fixed:
        sign = -1 if fixed.group(1) == "-" else 1
        hours, minutes = int(fixed.group(2)), int(fixed.group(3))
        if hours > 23 or minutes > 59:
            raise ValueError(f"{name!r} is no UTC offset")
        return timezone(sign * timedelta(hours=hours, minutes=minutes))
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"{name!r} is no time zone (UTC, an IANA name, or +HH:MM)") from exc


def parse(text: str, tz: tzinfo, now: datetime | None = None) -> datetime:
    """The moment `text` names, aware, in UTC; ValueError with what was expected."""
    value = text.strip()
    if value.lower() == "now":
        return (now or datetime.now(UTC)).astimezone(UTC)
    expected = f"{text!r} is no time: give 2025-03-01, 2025-03-01T12:00, 2025-03-01T12:00Z or now"
    if len(value) > 40 or not _DATE.match(value):
        raise ValueError(expected)
    if value.endswith(("z", "Z")):
        value = value[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(expected) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=tz)
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+01:00 is before the first UTC moment there is
        raise ValueError(expected) from None


def show(moment: datetime | None, tz: tzinfo) -> str:
    """`2025-03-01 12:00:00Z` (UTC) or `2025-03-01 13:00:00+01:00`; `-` for none."""
    if moment is None:
        return "-"
    local = moment.astimezone(tz)
    text = local.strftime("%Y-%m-%d %H:%M:%S")
    offset = local.utcoffset()
    if tz is UTC or offset is None:
        return text + "Z"
    return text + local.strftime("%z")[:3] + ":" + local.strftime("%z")[3:]


def iso(moment: datetime | None, tz: tzinfo) -> str | None:
    """ISO 8601 in the zone, for JSON and CSV (None stays None)."""
    if moment is None:
        return None
    local = moment.astimezone(tz)
    text = local.isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z") if tz is UTC else text


def whole_hour(moment: datetime) -> bool:
    return moment.minute == moment.second == moment.microsecond == 0
