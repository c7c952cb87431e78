"""The durable spool and the memory store, on a real filesystem."""

from __future__ import annotations

import asyncio
import io
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool, MemoryBatches
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import CorruptBatchError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import allocation, readings
from tests.record_strategies import RECORDS
from tests.waiting import eventually


async def test_batches_survive_a_restart_in_order(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    batches = [readings(1, node=f"n{i}") for i in range(3)]
    for batch in batches:
        assert await spool.add(batch) == []
    files = sorted(p.name for p in tmp_path.glob("*.ndjson"))
    assert len(files) == 3
    assert all(name.endswith("-4.ndjson") for name in files)
    reopened = DiskSpool(tmp_path, 1 << 20)
    assert (reopened.batches, reopened.records, reopened.bytes) == (3, 12, spool.bytes)
    for expected in batches:
        oldest = reopened.oldest()
        assert oldest is not None
        assert await reopened.load(oldest) == expected
        await reopened.remove(oldest)
    assert reopened.batches == 0
    assert reopened.bytes == 0
    assert not list(tmp_path.glob("*.ndjson"))


async def test_interrupted_write_leaves_nothing_to_resend(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add(readings(1))
    # a crash between write and rename leaves only the hidden temporary file
    (tmp_path / (".00000000000000000001-" + "0" * 32 + "-4.ndjson.tmp")).write_bytes(b'{"half": ')
    (tmp_path / "notes.txt").write_text("an operator's file is left alone")
    reopened = DiskSpool(tmp_path, 1 << 20)
    assert reopened.batches == 1
    assert not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "notes.txt").exists()


async def test_full_spool_drops_oldest_first(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add(readings(1))
    size = spool.bytes
    spool.max_bytes = int(size * 2.5)  # room for two batches
    first = spool.oldest()
    dropped: list[Any] = []
    for i in range(4):
        dropped += await spool.add(readings(1, node=f"later{i}"))
    assert spool.batches == 2
    assert spool.bytes <= spool.max_bytes
    assert dropped[0] is first
    assert len(dropped) == 3
    remaining = [await spool.load(b) for b in list(spool._pending.values())]
    assert [r[0].node for r in remaining] == ["later2", "later3"]


async def test_in_flight_batch_is_never_dropped(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add(readings(1))
    spool.max_bytes = spool.bytes + 10
    head = spool.oldest()
    assert head is not None
    head.in_flight = True
    dropped = await spool.add(readings(1, node="b"))
    assert head not in dropped
    assert spool.oldest() is head


async def test_rejected_batches_move_aside_and_go_first_when_full(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add(readings(1))
    size = spool.bytes
    head = spool.oldest()
    assert head is not None
    kept, dropped = await spool.set_aside(head)
    assert kept
    assert dropped == []
    assert spool.batches == 0
    assert spool.rejected_batches == 1
    assert len(list((tmp_path / "rejected").glob("*.ndjson"))) == 1
    spool.max_bytes = int(size * 1.5)
    await spool.add(readings(1, node="new"))
    assert spool.rejected_batches == 0
    assert spool.batches == 1
    assert DiskSpool(tmp_path, 1 << 20).rejected_batches == 0


async def test_corrupt_file_is_reported(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add(readings(1))
    head = spool.oldest()
    assert head is not None
    assert head.path is not None
    head.path.write_bytes(b"garbage\n")
    with pytest.raises(CorruptBatchError):
        await spool.load(head)


def test_unwritable_directory_fails_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="file"):
        DiskSpool(blocker / "spool", 1 << 20)


async def test_memory_store_bound(tmp_path: Path) -> None:
    store = MemoryBatches(max_records=8)
    await store.add(readings(1))
    await store.add(readings(1, node="b"))
    dropped = await store.add(readings(1, node="c"))
    assert [d.count for d in dropped] == [4]
    assert store.records == 8
    oldest = store.oldest()
    assert oldest is not None
    assert (await store.load(oldest))[0].node == "b"


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(RECORDS, min_size=1, max_size=4))
async def test_any_record_round_trips(tmp_path: Path, records: list[AnyRecord]) -> None:
    spool = DiskSpool(tmp_path / os.urandom(4).hex(), 1 << 22)
    await spool.add(records)
    reopened = DiskSpool(spool.directory, 1 << 22)
    head = reopened.oldest()
    assert head is not None
    # as the wire has them: a field `to_wire` leaves out comes back as its default
    assert [to_wire(r) for r in await reopened.load(head)] == [to_wire(r) for r in records]


async def test_strings_json_cannot_encode_directly_round_trip(tmp_path: Path) -> None:
    hostile = replace(allocation(pod="p"), pod="\ud800x", namespace="a\x00b", replica=2**70)
    spool = DiskSpool(tmp_path, 1 << 20)
    await spool.add([hostile])
    head = DiskSpool(tmp_path, 1 << 20).oldest()
    assert head is not None
    assert await spool.load(head) == [hostile]


async def test_next_batch_is_read_ahead_while_one_is_sent(tmp_path: Path) -> None:
    for i in range(3):
        await DiskSpool(tmp_path, 1 << 20).add(readings(2, node=f"n{i}"))
    spool = DiskSpool(tmp_path, 1 << 20)  # as after a restart: nothing in memory
    first = spool.oldest()
    assert first is not None
    spool.prefetch_after(first)
    assert (await spool.load(first))[0].node == "n0"
    await spool.remove(first)
    second = spool.oldest()
    assert second is not None
    assert second.path is not None
    await eventually(  # the read-ahead runs in a thread; let it finish
        lambda: (
            second.meta.batch_id in spool._prefetched
            and spool._prefetched[second.meta.batch_id].done()
        )
    )
    second.path.rename(tmp_path / "moved-away")  # only the read-ahead copy can answer now
    assert [r.node for r in await spool.load(second)] == ["n1"] * 8


async def test_a_dropped_batch_cancels_its_read_ahead(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    for i in range(2):
        await spool.add(readings(1, node=f"n{i}"))
    first = spool.oldest()
    assert first is not None
    spool.prefetch_after(first)
    second = list(spool._pending.values())[1]
    assert second.meta.batch_id in spool._prefetched
    await spool.remove(second)
    assert spool._prefetched == {}


async def test_a_batch_that_does_not_read_back_into_records_is_set_aside(tmp_path: Path) -> None:
    # A file of the previous release whose record was changed on disk: its id no longer
    # matches. It goes to rejected/, whole, and the batches after it are delivered.
    spool = DiskSpool(tmp_path / "stdout", 1 << 20)
    await spool.add(readings(1, node="tampered"))
    await spool.add(readings(1, node="fine"))
    head = spool.oldest()
    assert head is not None and head.path is not None
    head.path.write_bytes(head.path.read_bytes().replace(b'"node":"tampered"', b'"node":"other"'))
    reopened = DiskSpool(tmp_path / "stdout", 1 << 20)
    out = io.BytesIO()
    metrics = AgentMetrics()
    worker = ExporterWorker(StdoutExporter(out), BatchPolicy(), metrics, store=reopened)
    worker.close_intake()
    await asyncio.wait_for(worker.run(), 10)
    assert {orjson.loads(line)["node"] for line in out.getvalue().splitlines()} == {"fine"}
    (kept,) = (tmp_path / "stdout" / "rejected").iterdir()
    assert b'"node":"other"' in kept.read_bytes()
    status = worker.describe()
    assert (status["set_aside_batches"], status["dropped_records"]) == (1, 0)
