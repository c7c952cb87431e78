"""Fleet simulation: N nodes' real PostgreSQL and OTLP exporters (one worker each) on the
default schedules, compressed in time (see benchmarks/fleet.py), into one real PostgreSQL and
one OTLP receiver process (benchmarks/fleet_otlp.py). Without PostgreSQL, the OTLP sink alone.

Phases per fleet size: a jittered start (every agent within START_WINDOW), a steady window
(connections sampled every 100 ms from pg_stat_activity and from the receiver's own server,
deliveries counted, end-to-end p99 from the records' own times), a server outage of 60 fleet-seconds while the fleet keeps emitting,
then the reconnect storm until everything emitted is stored. Figures per 1,000 nodes are the
measured ones scaled linearly. `GPUID_BENCH_QUICK=1` runs 100 and 300 nodes for a short while.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common import Row
from benchmarks.fleet import (
    Expected,
    Schedule,
    SimNode,
    Sink,
    compression_for,
    deliveries,
    failures,
    sample_during,
)
from benchmarks.fleet_otlp import KEEPALIVE, OtlpSink
from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.servers.postgres import PostgresCluster

QUICK = os.environ.get("GPUID_BENCH_QUICK", "") not in ("", "0")
SIZES = (100, 300) if QUICK else (500, 2000)
STEADY_SECONDS = 10.0 if QUICK else 30.0  # wall clock
OUTAGE = 60.0  # fleet seconds
WALL_DELIVERIES = 25.0  # deliveries per wall-clock second the compression aims at
APP = "gpuid-fleet"


class PostgresSink:
    name = "postgres"

    def __init__(self) -> None:
        self.cluster = PostgresCluster()
        self._conn: Any = None

    async def start(self) -> None:
        await asyncio.to_thread(self.cluster.start)

    def exporter(self, node: str, schedule: Schedule, compress: float) -> Exporter:
        from gpuid_agent.delivery.exporters.postgres import PostgresExporter

        return PostgresExporter(
            **self.cluster.connect_kwargs(),
            sslmode="disable",
            timeout=30.0,
            idle_timeout=schedule.idle_timeout / compress,
            application_name=f"{APP} {node}",
        )

    async def _db(self) -> Any:
        import asyncpg

        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(**self.cluster.connect_kwargs(), timeout=5)
        return self._conn

    async def connections(self) -> int | None:
        try:
            db = await self._db()
            return int(
                await db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                    APP + " %",
                )
            )
        except Exception:  # the server is down or restarting: no sample
            self._conn = None
            return None

    async def stored(self, expected: Expected) -> Expected:
        db = await self._db()
        readings = await db.fetch(
            "SELECT record_id FROM gpu_readings WHERE record_id = ANY($1::text[])",
            list(expected.readings),
        )
        allocations = await db.fetch(
            "SELECT start_record_id, end_record_id FROM gpu_allocations WHERE node LIKE 'fleet-%'"
        )
        return Expected(
            {r[0] for r in readings},
            {r[0] for r in allocations if r[0]} & expected.allocations_started,
            {r[1] for r in allocations if r[1]} & expected.allocations_ended,
        )

    async def stop_server(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None
        await asyncio.to_thread(self.cluster.stop_server, "immediate")

    async def start_server(self) -> None:
        await asyncio.to_thread(self.cluster.start_server)

    async def latency_p99(self, since: datetime) -> float | None:
        """Emission (a reading's read_time, an allocation's start) to the start of the
        transaction that stored it (created_at)."""
        db = await self._db()
        value = await db.fetchval(
            "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY lag) FROM ("
            " SELECT extract(epoch FROM created_at - read_time) AS lag FROM gpu_readings"
            " WHERE read_time >= $1 AND node LIKE 'fleet-%'"
            " UNION ALL"
            " SELECT extract(epoch FROM created_at - started_at) FROM gpu_allocations"
            " WHERE started_at >= $1 AND node LIKE 'fleet-%') AS lags",
            since,
        )
        return None if value is None else float(value)

    async def max_connections(self) -> int:
        return int(await (await self._db()).fetchval("SHOW max_connections"))

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
        await asyncio.to_thread(self.cluster.close)


async def _simulate(sinks: list[Sink], nodes: int, schedule: Schedule) -> dict[str, Any]:
    """Run the fleet against every sink at once; the figures of each sink by its name."""
    compress = compression_for(nodes, schedule, WALL_DELIVERIES)
    metrics = AgentMetrics()
    expected = Expected()
    rng = random.Random(nodes)
    root = Path(tempfile.mkdtemp(prefix="gpuid-fleet-"))
    stop = asyncio.Event()
    fleet = [
        SimNode(
            f"fleet-{i:05d}",
            [sink.exporter(f"fleet-{i:05d}", schedule, compress) for sink in sinks],
            schedule,
            compress,
            root,
            metrics,
            expected,
            random.Random(rng.getrandbits(64)),
        )
        for i in range(nodes)
    ]
    tasks = [asyncio.create_task(node.run(stop)) for node in fleet]
    out: dict[str, dict[str, Any]] = {s.name: {"compress": compress} for s in sinks}

    async def phase(seconds: float, until: Callable[[], Awaitable[bool]] | None = None) -> float:
        """Sample every sink's connections for `seconds` (or until `until()`)."""
        runs = await asyncio.gather(*(sample_during(s, seconds, until) for s in sinks))
        for sink, (samples, _) in zip(sinks, runs, strict=True):
            out[sink.name]["samples"] = samples
        return max(wall for _, wall in runs)

    def failed(sink: Sink) -> float:
        return sum(failures(metrics, sink.name).values())

    try:
        # Start: every agent within the start window; over once each delivered its first
        # readings (to every sink) and one idle timeout passed.
        async def started() -> bool:
            return all(
                w.describe()["delivered_records"] >= schedule.gpus for n in fleet for w in n.workers
            )

        await phase(600.0, started)
        first = {s.name: out[s.name]["samples"] for s in sinks}
        await phase(schedule.idle_timeout / compress)
        for sink in sinks:
            f = out[sink.name]
            f["start_peak"] = max(first[sink.name].peak, f["samples"].peak)
            f["start_failures"] = failed(sink)
            f["before"] = deliveries(metrics, sink.name)

        since = datetime.now(UTC)
        wall = await phase(STEADY_SECONDS)
        for sink in sinks:
            f = out[sink.name]
            f["steady_peak"], f["steady_mean"] = f["samples"].peak, f["samples"].mean
            f["tx_per_s"] = (deliveries(metrics, sink.name) - f["before"]) / (wall * compress)
            f["p99"] = await sink.latency_p99(since)
            f["before_outage"] = failed(sink)

        await asyncio.gather(*(s.stop_server() for s in sinks))
        await asyncio.sleep(OUTAGE / compress)
        await asyncio.gather(*(s.start_server() for s in sinks))
        pending_at_restart = expected.total

        # every sink drains at once (the fleet's workers retry into all of them together)
        async def drain(sink: Sink) -> None:
            async def drained() -> bool:
                return (await sink.stored(expected)).total >= pending_at_restart

            samples, wall = await sample_during(sink, 600.0, drained)
            f = out[sink.name]
            f["storm_peak"] = samples.peak
            f["drain_fleet_s"], f["drain_wall_s"] = wall * compress, wall
            f["outage_failures"] = failed(sink) - f["before_outage"]

        await asyncio.gather(*(drain(s) for s in sinks))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Every node stops at once: a final flush the sink refuses stays in that node's spool
        # (the agent sends it at its next start) and is not lost.
        spooled = {
            s.name: sum(w.store.records for n in fleet for w in n.workers if w.name == s.name)
            for s in sinks
        }
        shutil.rmtree(root, ignore_errors=True)
    for sink in sinks:
        f = out[sink.name]
        f["emitted"] = expected.total
        f["spooled"] = spooled[sink.name]
        f["lost"] = expected.total - (await sink.stored(expected)).total - f["spooled"]
        f["failures"] = failures(metrics, sink.name)
        f["max_connections"] = await sink.max_connections()
    return out


def sinks() -> list[Sink]:
    """The sinks every simulated node delivers to (one worker each); PostgreSQL where this
    machine has it."""
    chosen: list[Sink] = [OtlpSink()]
    if not PostgresCluster.unavailable():
        chosen.insert(0, PostgresSink())
    return chosen


async def run() -> list[Row]:
    schedule = Schedule()
    rows: list[Row] = []
    reason = PostgresCluster.unavailable()
    if reason:
        rows.append(Row("fleet", "postgres", 0, "-", f"skipped: {reason}"))
    for nodes in SIZES:
        chosen = sinks()
        await asyncio.gather(*(s.start() for s in chosen))
        started = time.monotonic()
        try:
            figures = await _simulate(chosen, nodes, schedule)
        finally:
            await asyncio.gather(*(s.close() for s in chosen))
        took = time.monotonic() - started
        for name, f in figures.items():
            rows += _rows(nodes, schedule, name, f, took)
    return rows


def _rows(nodes: int, schedule: Schedule, sink: str, f: dict[str, Any], took: float) -> list[Row]:
    per_k = 1000 / nodes
    # Little's law: a node holds a connection for about one idle timeout (PostgreSQL) or
    # keep-alive (OTLP) per delivery.
    c = f["compress"]
    group = f"fleet {nodes} {sink}"
    pg = sink == "postgres"
    # PostgreSQL: one transaction per delivery, held for POSTGRES_IDLE_TIMEOUT (compressed);
    # OTLP: one POST per delivery on a connection kept alive 15 s (compressed)
    per_delivery, unit, done = (
        ("transactions", "tx/s", "commit") if pg else ("requests", "req/s", "2xx answer")
    )
    limit = f["max_connections"]
    limit_note = f"server max_connections {limit}" if limit is not None else "server sets no limit"
    held = schedule.idle_timeout if pg else KEEPALIVE
    arithmetic = f" (arithmetic: {1000 * schedule.deliveries_per_node() * held:.0f})"
    return [
        Row(
            group,
            "connections at start, peak",
            f["start_peak"],
            "conns",
            f"{f['start_peak'] * per_k:.0f} per 1,000 nodes; all start within "
            f"{schedule.start_window:.0f} s; {limit_note}; "
            f"{f['start_failures']:.0f} attempts refused or failed; time compressed {c:.0f}x",
        ),
        Row(
            group,
            "connections steady, peak",
            f["steady_peak"],
            "conns",
            f"{f['steady_peak'] * per_k:.0f} per 1,000 nodes",
        ),
        Row(
            group,
            "connections steady, mean",
            f["steady_mean"],
            "conns",
            f"{f['steady_mean'] * per_k:.1f} per 1,000 nodes{arithmetic}",
        ),
        Row(
            group,
            f"{per_delivery}/s (fleet time)",
            f["tx_per_s"],
            unit,
            f"{f['tx_per_s'] * per_k:.2f} per 1,000 nodes (arithmetic: "
            f"{1000 * schedule.deliveries_per_node():.2f})",
        ),
        Row(
            group,
            f"delivery p99, emission to {done}",
            f["p99"] or 0,
            "s",
            f"wall s, FLUSH_INTERVAL compressed to {schedule.flush_interval / c:.2f} s",
        ),
        Row(
            group,
            "after 60 s outage: connections peak",
            f["storm_peak"],
            "conns",
            f"{f['storm_peak'] * per_k:.0f} per 1,000 nodes; outage {OUTAGE / c:.1f} s wall",
        ),
        Row(
            group,
            "after 60 s outage: time to drain",
            f["drain_fleet_s"],
            "s (fleet)",
            f"{f['drain_wall_s']:.2f} s wall; {f['outage_failures']:.0f} failed attempts "
            "during outage and drain (jittered backoff)",
        ),
        Row(
            group,
            "records lost",
            f["lost"],
            "records",
            f"of {f['emitted']:,} emitted; {f['spooled']} more in the spools when every node "
            f"stopped at once; failed attempts by type {f['failures'] or 'none'}; {took:.0f} s",
        ),
    ]
