"""A spool backlog drains in joined requests, new records are not stuck behind it, and
SIGTERM during its drain leaves the rest in the spool, whole (issue 19, item 3)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.exporters.otlp import OtlpExporter
from gpuid_agent.delivery.pending import WINDOW, Pending, StoredBatch
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.delivery.store import MemoryBatches
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.agent_subprocess import start_agent
from tests.exporter_support import readings, spool_files, spooled_record_ids
from tests.servers.otlp import OtlpReceiver
from tests.servers.receiver import Receiver, Reply
from tests.waiting import eventually

POLICY = BatchPolicy(flush_interval=0.02, retry_count=0, backoff_base=0.01, timeout=10.0)


def ids(records: list[AnyRecord]) -> list[str]:
    return [str(to_wire(r)["record_id"]) for r in records]


async def backlog(directory: Path, records: list[AnyRecord], per_batch: int = 1) -> list[str]:
    """Store `records` as batches of `per_batch` with the spool's own writer; their ids."""
    spool = DiskSpool(directory, 1 << 30)
    for start in range(0, len(records), per_batch):
        await spool.add(records[start : start + per_batch])
    return ids(records)


async def drain(worker: ExporterWorker, until: int) -> None:
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.describe()["delivered_records"] >= until, within=30)
    worker.close_intake()
    await asyncio.wait_for(task, 10)


async def test_http_sends_a_backlog_of_one_record_files_in_one_request(
    receiver: Receiver, tmp_path: Path
) -> None:
    expected = await backlog(tmp_path, readings(50))  # 200 files, one record each
    spool = DiskSpool(tmp_path, 1 << 30)
    exporter = HttpExporter(receiver.url)
    await drain(ExporterWorker(exporter, POLICY, AgentMetrics(), store=spool), len(expected))
    await exporter.close()
    [request] = receiver.requests
    assert request.record_ids == expected  # each once, in the order stored
    assert request.headers["X-Records-Count"] == "200"
    assert spool_files(tmp_path) == []


async def test_http_joins_up_to_1000_records_a_request_in_order(
    receiver: Receiver, tmp_path: Path
) -> None:
    # 40 files of 100 records (about 44 KB each): ten files a request
    expected = await backlog(tmp_path, readings(1000), per_batch=100)
    exporter = HttpExporter(receiver.url)
    worker = ExporterWorker(exporter, POLICY, AgentMetrics(), store=DiskSpool(tmp_path, 1 << 30))
    await drain(worker, len(expected))
    await exporter.close()
    assert [i for r in receiver.requests for i in r.record_ids] == expected
    assert [len(r.records) for r in receiver.requests] == [1000] * 4
    assert all(r.size < 1024 * 1024 for r in receiver.requests)


async def test_batches_held_in_memory_join_up_to_1000_records(receiver: Receiver) -> None:
    records = readings(625)
    store = MemoryBatches(10_000)
    for record in records:
        await store.add([record])
    exporter = HttpExporter(receiver.url)
    await drain(ExporterWorker(exporter, POLICY, AgentMetrics(), store=store), len(records))
    await exporter.close()
    assert [len(r.records) for r in receiver.requests] == [1000, 1000, 500]
    assert [i for r in receiver.requests for i in r.record_ids] == ids(records)


async def test_otlp_sends_a_backlog_as_one_valid_export_request(
    otlp_receiver: OtlpReceiver, tmp_path: Path
) -> None:
    expected = await backlog(tmp_path, readings(50))
    exporter = OtlpExporter(otlp_receiver.url)
    worker = ExporterWorker(exporter, POLICY, AgentMetrics(), store=DiskSpool(tmp_path, 1 << 30))
    await drain(worker, len(expected))
    await exporter.close()
    [request] = otlp_receiver.requests
    assert request.status == 200 and otlp_receiver.malformed == 0
    assert request.record_ids == expected
    assert spool_files(tmp_path) == []


async def test_new_records_go_out_after_at_most_one_backlog_request(
    receiver: Receiver, tmp_path: Path
) -> None:
    old = await backlog(tmp_path, readings(1000), per_batch=100)  # four requests' worth
    receiver.default = Reply(delay=0.3)
    exporter = HttpExporter(receiver.url)
    worker = ExporterWorker(exporter, POLICY, AgentMetrics(), store=DiskSpool(tmp_path, 1 << 30))
    task = asyncio.create_task(worker.run())
    await eventually(lambda: receiver.requests)  # the backlog's first request is in flight
    new = readings(1, node="fresh")
    await worker.store_now(new)
    await eventually(lambda: worker.describe()["delivered_records"] >= len(old) + 4, within=30)
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    await exporter.close()
    sent = [r.record_ids for r in receiver.requests]
    assert sent[1] == ids(new)  # right after the request in flight, not after the backlog
    assert [i for r in sent[:1] + sent[2:] for i in r] == old
    assert len(sent) == 5


# (add: count, backlog lane, held in memory, size) or (pop: which of the indexed)
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 50), st.booleans(), st.booleans(), st.integers(0, 999)
        ),
        st.tuples(st.just("pop"), st.integers(0, 200)),
    ),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(OPS, st.booleans())
def test_pending_sums_and_lanes_match_a_recount(ops: list[tuple[Any, ...]], new: bool) -> None:
    index = Pending()
    lanes: dict[bool, list[StoredBatch]] = {True: [], False: []}
    for op in ops:
        if op[0] == "add":
            _, count, in_backlog, held, size = op
            batch = StoredBatch(BatchMeta.new(), int(count), size=int(size))
            batch.backlog, batch.records = bool(in_backlog), [] if held else None
            index.add(batch)
            lanes[batch.backlog].append(batch)
        elif len(index):
            victim = list(index.values())[int(op[1]) % len(index)]
            assert index.pop(victim.meta.batch_id) is victim
            lanes[victim.backlog].remove(victim)
        everything = lanes[True] + lanes[False]
        assert list(index.values()) == everything  # the backlog first, each lane oldest first
        assert index.records == sum(b.count for b in everything)
        held = [b for b in everything if b.records is not None]
        assert index.memory_records == sum(b.count for b in held)
        assert index.memory_bytes == sum(b.size for b in held)
        head = index.head(new)
        assert head is (
            (lanes[False] or everything or [None])[0] if new else next(iter(everything), None)
        )
        if head is not None:
            lane = lanes[head.backlog]
            assert list(index.following(head)) == lane[lane.index(head) + 1 :]


def test_a_fed_backlog_is_counted_whole_and_taken_a_window_at_a_time() -> None:
    backlog = [StoredBatch(BatchMeta.new(), 2, backlog=True) for _ in range(3 * WINDOW)]
    taken: list[StoredBatch] = []

    def source() -> Iterator[StoredBatch]:
        for batch in backlog:
            taken.append(batch)
            yield batch

    index = Pending()
    newer = StoredBatch(BatchMeta.new(), 5)
    index.add(newer)
    index.feed(source(), len(backlog), 2 * len(backlog))
    assert len(taken) == WINDOW  # not the whole backlog
    sent: list[StoredBatch] = []
    while (head := index.head(False)) is not newer:
        assert head is not None
        assert len(index) == len(backlog) - len(sent) + 1
        assert index.records == 2 * (len(backlog) - len(sent)) + 5
        assert len(taken) - len(sent) <= WINDOW
        sent.append(head)
        index.pop(head.meta.batch_id)
    assert sent == backlog  # oldest first, each once
    assert len(index) == 1 and index.records == 5


async def test_sigterm_mid_drain_leaves_the_rest_whole_and_restart_sends_each_once(
    receiver: Receiver, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    spool = tmp_path / "spool"
    old = await backlog(spool / "http", readings(2000), per_batch=100)  # 80 files, 8 requests
    env = subprocess_env | {
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": receiver.url,
        "SPOOL_DIR": str(spool),
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "SHUTDOWN_GRACE": "4",
        "LOG_LEVEL": "warning",
        "POD_RESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
    }
    receiver.default = Reply(delay=1.0)  # a slow sink: the drain takes longer than the grace
    log = tmp_path / "agent.log"
    agent = start_agent(env, log)
    try:
        await eventually(lambda: receiver.requests, within=30)
        asked = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(agent.wait, 15)
        took = time.monotonic() - asked
    finally:
        if agent.poll() is None:
            agent.kill()
    assert rc == 0, log.read_text()
    assert took < 4 + 4, took  # the grace, and the interpreter's exit on a loaded machine
    assert "grace period over" not in log.read_text()
    delivered = receiver.accepted_ids()
    left = {i for path in spool_files(spool / "http") for i in spooled_record_ids(path)}
    assert set(old) - delivered, "the backlog should not have drained in the grace"
    assert set(old) <= delivered | left  # nothing lost
    assert not delivered & left  # nothing delivered is still spooled: no duplicate to come
    assert len(receiver.requests) == len([r for r in receiver.requests if r.status == 200])

    receiver.default = Reply()
    again = start_agent(env, log)
    try:
        await eventually(lambda: set(old) <= receiver.accepted_ids(), within=30)
    finally:
        again.send_signal(signal.SIGTERM)
        await asyncio.to_thread(again.wait, 15)
    received = Counter(i for r in receiver.requests if r.status == 200 for i in r.record_ids)
    assert received.most_common(1)[0][1] == 1  # each record once, across both runs
    assert os.path.isdir(spool / "http")
