"""An answer as data: JSON (one object, a list per kind of fact) and CSV (one row per fact,
a `record` column naming its kind). Times are ISO 8601 in the chosen zone; GPU-hours and kWh
are rounded to the thousandth."""

from __future__ import annotations

import csv
import io
from datetime import tzinfo
from typing import Any

import orjson

from gpuid_agent.history.answers import Answer, Placement, UsageRow
from gpuid_agent.history.facts import Holding, Mark
from gpuid_agent.history.times import iso


def hours(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds / 3600, 3)


def kwh(joules: float | None) -> float | None:
    return None if joules is None else round(joules / 3_600_000, 3)


def placement(p: Placement, tz: tzinfo) -> dict[str, Any]:
    return {
        "serial": p.serial,
        "cluster": p.cluster,
        "node": p.node,
        "machine": p.machine,
        "chassis": p.chassis,
        "slots": list(p.slots),
        "uuids": list(p.uuids),
        "model": p.model,
        "first_seen": iso(p.first_seen, tz),
        "last_seen": iso(p.last_seen, tz),
        "removed": p.removed,
    }


def allocation(h: Holding, tz: tzinfo) -> dict[str, Any]:
    return {
        "allocation_id": h.allocation_id,
        "cluster": h.cluster,
        "node": h.node,
        "chassis": h.chassis,
        "slot": h.slot,
        "serial": h.serial,
        "uuid": h.uuid,
        "mig_uuid": h.mig_uuid or None,
        "namespace": h.namespace,
        "pod": h.pod,
        "pod_uid": h.pod_uid or None,
        "container": h.container,
        "workload_kind": h.workload_kind or None,
        "workload_name": h.workload_name or None,
        "started_at": iso(h.started_at, tz),
        "ended_at": iso(h.ended_at, tz),
        "gpu_hours": hours(h.gpu_seconds),
        "kwh": kwh(h.energy_joules),
    }


def event(m: Mark, tz: tzinfo) -> dict[str, Any]:
    return {
        "time": iso(m.time, tz),
        "kind": m.kind,
        "cluster": m.cluster,
        "node": m.node,
        "chassis": m.chassis,
        "slot": m.slot,
        "serial": m.serial,
        "uuid": m.uuid,
        "check": m.check or None,
        "state": m.state or None,
        "previous_state": m.previous_state or None,
        "action": m.action or None,
        "xid": m.xid,
        "old_serial": m.old_serial or None,
        "new_serial": m.new_serial or None,
        "what": m.describe(),
    }


def usage(row: UsageRow, columns: tuple[str, ...]) -> dict[str, Any]:
    return {
        **dict(zip(columns, row.group, strict=True)),
        "gpu_hours": hours(row.gpu_seconds),
        "kwh": kwh(row.energy_joules),
    }


def as_dict(answer: Answer, tz: tzinfo) -> dict[str, Any]:
    body: dict[str, Any] = {"question": answer.question, "subject": answer.subject}
    if answer.at is not None:
        body["at"] = iso(answer.at, tz)
    if answer.since is not None or answer.until is not None:
        body["since"] = iso(answer.since, tz)
        body["until"] = iso(answer.until, tz)
    if answer.question == "usage":
        body["by"] = answer.by
        body["usage"] = [usage(r, answer.usage_columns) for r in answer.usage]
        body["total"] = {
            "gpu_hours": hours(sum(r.gpu_seconds for r in answer.usage)),
            "kwh": kwh(sum(r.energy_joules for r in answer.usage)),
        }
        return body
    if answer.question != "pod":
        body["placements"] = [placement(p, tz) for p in answer.placements]
    body["allocations"] = [allocation(h, tz) for h in answer.holdings]
    body["events"] = [event(m, tz) for m in answer.marks]
    return body


def to_json(answer: Answer, tz: tzinfo) -> str:
    return orjson.dumps(as_dict(answer, tz), option=orjson.OPT_INDENT_2).decode() + "\n"


def to_csv(answer: Answer, tz: tzinfo) -> str:
    out = io.StringIO()
    if answer.question == "usage":
        writer = csv.DictWriter(out, [*answer.usage_columns, "gpu_hours", "kwh"])
        writer.writeheader()
        writer.writerows(usage(r, answer.usage_columns) for r in answer.usage)
        return out.getvalue()
    rows: list[dict[str, Any]] = []
    if answer.question != "pod":
        rows += [{"record": "placement", **_flat(placement(p, tz))} for p in answer.placements]
    rows += [{"record": "allocation", **allocation(h, tz)} for h in answer.holdings]
    rows += [{"record": "event", **event(m, tz)} for m in answer.marks]
    columns = list(dict.fromkeys(["record", *(k for r in rows for k in r)]))
    writer = csv.DictWriter(out, columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    return {k: " ".join(v) if isinstance(v, list) else v for k, v in row.items()}
