"""Store faults on a real filesystem (read-only tmpfs, full tmpfs, a directory replaced by a
file): the exporter degrades with the reason, keeps delivering, stays bounded, recovers."""

from __future__ import annotations

import asyncio
import io
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker, Pipeline
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.delivery_support import Tmpfs, tiny_tmpfs, tmp_files, tmpfs
from tests.exporter_support import readings
from tests.waiting import eventually

__all__ = ["tiny_tmpfs", "tmpfs"]

FAST = BatchPolicy(
    batch_size=4,
    flush_interval=0.01,
    queue_size=40,
    retry_count=0,
    timeout=2.0,
    backoff_base=0.01,
    backoff_max=0.02,
)


def ids(stream: io.BytesIO) -> list[str]:
    return [orjson.loads(line)["record_id"] for line in stream.getvalue().splitlines()]


def dropped(metrics: AgentMetrics, exporter: str, reason: str) -> float:
    labels = {"exporter": exporter, "reason": reason}
    return metrics.registry.get_sample_value("gpuid_dropped_records_total", labels) or 0.0


class Failing(Exporter):
    """A sink that is down (like an unreachable server), counting its health probes and
    noting when each probe and delivery came (monotonic clock)."""

    name = "failing"

    def __init__(self) -> None:
        self.down = True
        self.probes = 0
        self.probed_at: list[float] = []
        self.exported_at: list[float] = []

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        self.exported_at.append(time.monotonic())
        if self.down:
            raise ExportError("connection refused", error_type="connection")

    async def health(self) -> ExporterHealth:
        self.probes += 1
        self.probed_at.append(time.monotonic())
        return ExporterHealth(ok=not self.down, reason=None if not self.down else "down")


async def test_read_only_spool_degrades_keeps_delivering_and_recovers(tmpfs: Tmpfs) -> None:
    spool = DiskSpool(tmpfs.path / "stdout", 1 << 20, memory_limit=20)
    on_disk = readings(1, node="before")
    assert await spool.add(on_disk) == []
    tmpfs.read_only()
    out, metrics = io.BytesIO(), AgentMetrics()
    worker = ExporterWorker(StdoutExporter(out), FAST, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    try:
        during = readings(3, node="during")
        await Pipeline([worker], metrics).publish(during)
        expected = [to_wire(r)["record_id"] for r in on_disk + during]
        await eventually(lambda: ids(out) == expected)
        health = worker.health()
        assert health.state == "degraded"
        assert f"spool {spool.directory}: [Errno 30] Read-only file system" in (health.reason or "")
        # delivered but its file would not go: forgotten here, never sent twice
        assert spool.batches == 0
        assert len(list(spool.directory.glob("*.ndjson"))) == 1
        assert (
            metrics.registry.get_sample_value(
                "gpuid_exporter_state", {"exporter": "stdout", "state": "degraded"}
            )
            == 1
        )
        tmpfs.writable()
        await worker.put(readings(1, node="after")[0])
        await eventually(lambda: worker.health().ok)
        await eventually(lambda: not list(spool.directory.glob("*.ndjson")))  # the leftover too
        assert len(ids(out)) == len(set(ids(out))) == len(expected) + 1
    finally:
        worker.close_intake()
        await asyncio.wait_for(task, 5)
    assert not task.cancelled() and task.exception() is None


async def test_full_disk_keeps_a_bounded_memory_fallback(tiny_tmpfs: Tmpfs) -> None:
    spool = DiskSpool(tiny_tmpfs.path / "x", 1 << 30, memory_limit=20)
    kept: list[int] = []
    for i in range(40):  # 64 KiB holds about a dozen 4-record batches
        for batch in await spool.add(readings(1, node=f"n{i}")):
            assert batch.dropped_for == "spool_unwritable"
            kept.append(batch.count)
        assert spool.memory_records <= 20
    assert spool.problem is not None and "No space left on device" in spool.problem
    assert sum(kept) > 0
    assert spool.batches * 4 == 40 * 4 - sum(kept)
    assert tmp_files(tiny_tmpfs.path) == []
    # the memory fallback is also bounded by bytes of payload
    spool.max_bytes = 3000
    await spool.add(readings(1, node="last"))
    held = [b for b in spool._pending.values() if b.records is not None]
    assert sum(b.size for b in held) <= 3000


async def test_full_disk_with_a_failing_sink_drops_oldest_counted(tiny_tmpfs: Tmpfs) -> None:
    metrics = AgentMetrics()
    policy = FAST
    spool = DiskSpool(tiny_tmpfs.path / "failing", 1 << 30, memory_limit=20)
    sink = Failing()
    worker = ExporterWorker(sink, policy, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    try:
        pipeline = Pipeline([worker], metrics)
        for i in range(60):  # at a pace the batcher keeps up with: drops come from the store
            await asyncio.wait_for(pipeline.publish(readings(1, node=f"n{i}")), 10)
            await eventually(lambda: worker.pending == worker.store.records)
        await eventually(lambda: dropped(metrics, "failing", "spool_unwritable") > 0)
        assert worker.max_memory_records <= policy.queue_size
        assert worker.health().state == "unavailable"
        assert "No space left on device" in (worker.health().reason or "")
        # a write may be failing in its thread right now: it removes its temporary file itself
        await eventually(lambda: tmp_files(tiny_tmpfs.path) == [])
    finally:
        worker.close_intake()
        await asyncio.wait_for(task, 5)


async def test_spool_directory_replaced_by_a_file(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "stdout", 1 << 20, memory_limit=20)
    await spool.add(readings(1, node="first"))
    first = spool.oldest()
    assert first is not None
    records = await spool.load(first)  # read before the directory goes
    shutil.rmtree(spool.directory)
    spool.directory.write_text("not a directory")
    assert await spool.add(readings(1, node="second")) == []
    assert spool.problem is not None and "Not a directory" in spool.problem
    await spool.remove(first)  # its file cannot be unlinked: forgotten, no exception
    second = spool.oldest()
    assert second is not None and second.records is not None
    assert records[0].node == "first"
    kept, _ = await spool.set_aside(second)  # rejected/ is gone with it
    assert not kept
    assert spool.batches == 0


async def test_publish_does_not_wait_for_a_stuck_worker() -> None:
    metrics = AgentMetrics()
    policy = BatchPolicy(batch_size=4, queue_size=20, timeout=0.2)
    stuck = ExporterWorker(StdoutExporter(io.BytesIO()), policy, metrics)  # never run
    out = io.BytesIO()
    alive = ExporterWorker(StdoutExporter(out), policy.__class__(flush_interval=0.01), metrics)
    task = asyncio.create_task(alive.run())
    try:
        await asyncio.wait_for(Pipeline([stuck, alive], metrics).publish(readings(25)), 10)
        await eventually(lambda: len(ids(out)) == 100)
        assert stuck.health().state == "unavailable"
        assert "intake not drained" in (stuck.health().reason or "")
        assert dropped(metrics, "stdout", "intake_full") == stuck.describe()["dropped_records"] > 0
    finally:
        alive.close_intake()
        await asyncio.wait_for(task, 5)


async def test_publish_durable_keeps_order_and_returns_on_a_broken_disk(tmpfs: Tmpfs) -> None:
    metrics = AgentMetrics()
    policy = BatchPolicy(batch_size=100, flush_interval=3600, queue_size=1000)
    spool = DiskSpool(tmpfs.path / "failing", 1 << 20, memory_limit=500)
    sink = Failing()
    worker = ExporterWorker(sink, policy, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    pipeline = Pipeline([worker], metrics)
    try:
        first, second, third = readings(1, node="a"), readings(1, node="b"), readings(1, node="c")
        await pipeline.publish(first)  # waits in the intake for an hour's flush
        await pipeline.publish_durable(second)
        names = sorted(p.name for p in spool.directory.glob("*.ndjson"))
        stored = [
            orjson.loads(line)["node"]
            for n in names
            for line in (spool.directory / n).read_bytes().splitlines()
        ]
        assert stored == ["a"] * 4 + ["b"] * 4  # fsync'd, after what was published before
        tmpfs.read_only()
        await asyncio.wait_for(pipeline.publish_durable(third), 5)  # kept in memory
        assert spool.memory_records == 4
        assert worker.health().state == "degraded"
        assert worker.describe()["durable"]
    finally:
        tmpfs.writable()
        worker.close_intake()
        await asyncio.wait_for(task, 10)


async def test_prober_runs_only_when_idle_and_health_reads_do_no_io() -> None:
    sink = Failing()
    sink.down = False
    policy = BatchPolicy(flush_interval=0.01, health_probe_interval=0.05, timeout=1.0)
    worker = ExporterWorker(sink, policy, AgentMetrics())
    for _ in range(100):
        assert worker.health().ok
    assert sink.probes == 0  # reading health never probes
    prober = asyncio.create_task(worker.probe_loop())
    try:
        await eventually(lambda: sink.probes >= 2)
        sink.down = True
        await eventually(lambda: worker.health().state == "degraded")
        assert worker.health().reason == "down"
        sink.down = False
        await eventually(lambda: worker.health().ok)
        # While deliveries keep proving the sink it is not probed: every probe comes a whole
        # interval after the last delivery, whatever the loop's stalls made of the spacing.
        task = asyncio.create_task(worker.run())
        probes = sink.probes
        for i in range(20):
            await worker.put(readings(1, node=f"n{i}")[0])
            await asyncio.sleep(0.02)  # a hold: deliveries over several probe intervals
        worker.close_intake()
        await asyncio.wait_for(task, 5)
        assert len(sink.exported_at) >= 2
        for probed in sink.probed_at[probes:]:
            before = [t for t in sink.exported_at if t <= probed]
            assert not before or probed - before[-1] >= policy.health_probe_interval
    finally:
        prober.cancel()
