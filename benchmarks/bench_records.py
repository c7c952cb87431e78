"""The one serializer on the spool's path: records to JSON lines (what a spool file and stdout
hold) and back to typed records (what a JSON-lines spool does before each re-delivery), beside
orjson's parse of the same bytes alone, in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import orjson

from benchmarks.common import Row, median
from gpuid_agent.records.serialize import from_json_lines, json_lines, to_wire
from tests.exporter_support import readings

RECORDS = 10_000
ROUNDS = 5


def _best_of(work: Callable[[], Any]) -> float:
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return median(times)


async def run() -> list[Row]:
    records = readings(RECORDS // 4, step=timedelta(milliseconds=1))
    data = json_lines(records)
    assert from_json_lines(data) == records
    wire = _best_of(lambda: [to_wire(r) for r in records])
    encode = _best_of(lambda: json_lines(records))
    decode = _best_of(lambda: from_json_lines(data))
    parse = _best_of(lambda: orjson.loads(b"[" + data.strip().replace(b"\n", b",") + b"]"))
    note = f"{len(records):,} readings, {len(data) / len(records):.0f} B each, median of {ROUNDS}"
    return [
        Row("records", "to_wire (id hashed)", len(records) / wire, "records/s", note),
        Row("records", "json lines encode", len(records) / encode, "records/s", note),
        Row(
            "records",
            "json lines read back (typed, ids checked)",
            len(records) / decode,
            "records/s",
            note,
        ),
        Row("records", "orjson parse alone", len(records) / parse, "records/s", "same bytes"),
        Row("records", "read back / parse alone", decode / parse, "x", "time ratio, same run"),
    ]
