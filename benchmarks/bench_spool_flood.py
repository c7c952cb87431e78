"""A spool flood: a real agent started over N one-record stored batches, its sink up.

The backlog is written by the spool's own writer (`DiskSpool.add`, one record a batch, in the
exporter's on-disk form) before the agent starts; the spool lies on tmpfs so that writing
100,000 fsync'd files is not the benchmark. Then a real agent process (simulated h100x8 node,
one exporter, that SPOOL_DIR) starts against a real receiver: the test suite's aiohttp HTTP
receiver, its OTLP/HTTP receiver, or a real PostgreSQL. Measured from the agent's start: the
time until every backlog record is delivered, until the first record of the new run is
delivered, the agent's peak RSS (VmHWM), the requests the backlog took, and backlog records
lost or delivered twice. Goals (issue 19, at 100,000 files): drain ≤ 300 s, first new ≤ 30 s,
peak RSS ≤ 160 MiB, ≤ 1,000 HTTP requests, 0 lost, 0 duplicates.

`python -m benchmarks spool_flood --flood-files=10000` runs only the 10,000-file case
(default: 10,000 and 100,000); `--flood-sinks=otlp` one sink (default: http,otlp,postgres).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from benchmarks.agentproc import free_port, start_agent, stop
from benchmarks.bench_memory import ROOT, peak_mib
from benchmarks.common import Row
from gpuid_agent.delivery.exporters.base import StoredForm
from gpuid_agent.delivery.exporters.postgres import PostgresExporter
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.serialize import to_wire
from tests.exporter_support import readings
from tests.servers.otlp import OtlpReceiver
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver

BACKLOG_NODE = "flood-backlog"  # the backlog's records name this node; the agent's do not
LIMIT_S = 900.0
GOALS = {"drain": 300.0, "first_new": 30.0, "rss": 160.0, "requests": 1000}


def _sinks() -> tuple[str, ...]:
    for arg in sys.argv[1:]:
        if arg.startswith("--flood-sinks="):
            return tuple(arg.split("=", 1)[1].split(","))
    return ("http", "otlp", "postgres")


def _sizes() -> tuple[int, ...]:
    for arg in sys.argv[1:]:
        if arg.startswith("--flood-files="):
            return tuple(int(n) for n in arg.split("=", 1)[1].split(","))
    return (10_000, 100_000)


@dataclass
class Seen:
    """What a sink has received so far: backlog records (distinct, and in all, repeats
    included), requests that carried backlog records, and when the first new record came."""

    distinct: int = 0
    total: int = 0
    requests: int = 0
    first_new: float | None = None


async def _fill(directory: Path, n: int, form: StoredForm | None) -> set[str]:
    records = readings(n // 4 + 1, step=timedelta(milliseconds=1), node=BACKLOG_NODE)[:n]
    spool = DiskSpool(directory, 1 << 40, form=form)
    for record in records:
        await spool.add([record])
    return {str(to_wire(r)["record_id"]) for r in records}


class _Watch:
    """Reads a sink's receipts incrementally (the requests since the last look)."""

    def __init__(self, started: float, backlog: set[str]) -> None:
        self.started = started
        self.backlog = backlog
        self.seen = Seen()
        self._ids: Counter[str] = Counter()
        self._done = 0

    def take(self, requests: list[tuple[float, list[str], bool]]) -> None:
        for at, ids, ok in requests[self._done :]:
            if not ok:
                continue
            backlog = [i for i in ids if i in self.backlog]
            if backlog:
                self.seen.requests += 1
                self._ids.update(backlog)
            if len(backlog) < len(ids) and self.seen.first_new is None:
                self.seen.first_new = at - self.started
        self._done = len(requests)
        self.seen.distinct, self.seen.total = len(self._ids), sum(self._ids.values())


async def _run_case(
    sink: str, n: int, env: dict[str, str], poll: Callable[[_Watch], None], backlog: set[str]
) -> list[Row]:
    started = time.monotonic()
    agent = start_agent(free_port(), env=env)
    watch = _Watch(started, backlog)
    drained: float | None = None
    try:
        while time.monotonic() - started < LIMIT_S:
            await asyncio.sleep(0.25)
            poll(watch)
            if drained is None and watch.seen.distinct >= len(backlog):
                drained = time.monotonic() - started
            if drained is not None and watch.seen.first_new is not None:
                break
            if agent.poll() is not None:
                break
        peak = peak_mib(agent.pid) if agent.poll() is None else 0.0
    finally:
        stop(agent)
    seen = watch.seen
    lost = len(backlog) - seen.distinct
    twice = seen.total - seen.distinct
    first = seen.first_new if seen.first_new is not None else float("nan")
    drain = drained if drained is not None else float("nan")
    miss = _misses(drain, first, peak, seen.requests if sink != "postgres" else 0, lost, twice)
    note = f"{lost} lost, {twice} duplicates{miss}"
    group, name = "spool flood", f"{sink} {n:,} files"
    return [
        Row(group, f"{name}: drain", drain, "s", note),
        Row(group, f"{name}: first new record", first, "s", "from the agent's start"),
        Row(group, f"{name}: peak RSS", peak, "MiB", "VmHWM after the drain"),
        Row(
            group,
            f"{name}: requests",
            seen.requests,
            "requests",
            "COPY transactions are not counted" if sink == "postgres" else "carrying backlog",
        ),
    ]


def _misses(drain: float, first: float, rss: float, requests: int, lost: int, twice: int) -> str:
    missed = [
        what
        for what, bad in (
            ("drain", not drain <= GOALS["drain"]),
            ("first new", not first <= GOALS["first_new"]),
            ("RSS", rss > GOALS["rss"]),
            ("requests", requests > GOALS["requests"]),
            ("lost", lost > 0),
            ("duplicates", twice > 0),
        )
        if bad
    ]
    return f"; goal MISSED: {', '.join(missed)}" if missed else "; goals met"


def _base_env(spool: Path) -> dict[str, str]:
    return {
        "SIMULATE": "h100x8",
        "NODE_NAME": "flood-node",
        "SPOOL_DIR": str(spool),
        "COLLECT_INTERVAL": "5s",
        "DMI_PRODUCT_UUID_PATH": "",
        "MACHINE_ID_PATH": "",
        "PYTHONPATH": ROOT,
    }


async def _http(n: int, spool: Path) -> list[Row]:
    backlog = await _fill(spool / "http", n, None)
    receiver = Receiver()
    url = await receiver.start()
    env = _base_env(spool) | {"EXPORTER_TYPE": "http", "HTTP_ENDPOINT": url}

    def poll(watch: _Watch) -> None:
        ok = [(r.at, r.record_ids, 200 <= r.status < 300) for r in receiver.requests]
        watch.take(ok)

    try:
        return await _run_case("http", n, env, poll, backlog)
    finally:
        await receiver.stop()


async def _otlp(n: int, spool: Path) -> list[Row]:
    backlog = await _fill(spool / "otlp", n, None)
    receiver = OtlpReceiver()
    url = await receiver.start()
    env = _base_env(spool) | {"EXPORTER_TYPE": "otlp", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": url}

    def poll(watch: _Watch) -> None:
        ok = [(r.at, r.record_ids, 200 <= r.status < 300) for r in receiver.requests]
        watch.take(ok)

    try:
        return await _run_case("otlp", n, env, poll, backlog)
    finally:
        await receiver.stop()


async def _postgres(n: int, spool: Path, cluster: PostgresCluster) -> list[Row]:
    backlog = await _fill(spool / "postgres", n, PostgresExporter.stored_form)
    table, database = f"flood{n}", str(cluster.connect_kwargs()["database"])
    await asyncio.to_thread(cluster.psql, f"DROP TABLE IF EXISTS {table}", database)
    env = _base_env(spool) | {"EXPORTER_TYPE": "postgres", "POSTGRES_TABLE": table}
    env |= cluster.env()
    count = (
        f"SELECT count(*) FILTER (WHERE node = '{BACKLOG_NODE}'), "
        f"count(DISTINCT record_id) FILTER (WHERE node = '{BACKLOG_NODE}'), "
        f"count(*) FILTER (WHERE node <> '{BACKLOG_NODE}') FROM {table}"
    )

    last = 0.0

    def poll(watch: _Watch) -> None:
        # The table is PostgreSQL's receipt, counted once a second (a count of 100,000 rows
        # four times a second would compete with the drain on this 2-core machine).
        nonlocal last
        if time.monotonic() - last < 1.0:
            return
        last = time.monotonic()
        try:
            out = cluster.psql(count, database)
        except Exception:  # not created yet
            return
        total, distinct, new = (int(v) for v in out.strip().split("|"))
        watch.seen.total, watch.seen.distinct = total, distinct
        if new and watch.seen.first_new is None:
            watch.seen.first_new = time.monotonic() - watch.started

    return await _run_case("postgres", n, env, poll, backlog)


async def run() -> list[Row]:
    rows: list[Row] = []
    reason = PostgresCluster.unavailable()
    cluster = PostgresCluster() if not reason else None
    if cluster is not None:
        await asyncio.to_thread(cluster.start)
    try:
        for n in _sizes():
            for sink in _sinks():
                with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
                    spool = Path(tmp) / "spool"
                    if sink == "http":
                        rows += await _http(n, spool)
                    elif sink == "otlp":
                        rows += await _otlp(n, spool)
                    elif cluster is not None:
                        rows += await _postgres(n, spool, cluster)
                    else:
                        rows.append(Row("spool flood", "postgres", 0, "-", f"skipped: {reason}"))
    finally:
        if cluster is not None:
            await asyncio.to_thread(cluster.close)
    return rows
