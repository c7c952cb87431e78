"""The OTLP exporter: encoding cost, bytes on the wire, and delivery to a decoding receiver.

- encode: records/s through `OtlpExporter.body` (records to an ExportLogsServiceRequest,
  serialised, gzipped) for one 10,000-record batch, with and without gzip;
- bytes/record on the wire, beside the HTTP exporter's gzipped JSON of the same records;
- delivery: records/s through the pipeline's worker into the OTLP receiver of the tests
  (decoding every request with opentelemetry-proto) in its own process.
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

from benchmarks.common import Row, median
from gpuid_agent.delivery.exporters.otlp import OtlpExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.records.serialize import gpuid_shape, json_bytes, to_wire
from gpuid_agent.records.types import ReadingRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import readings
from tests.servers.postgres import free_port

ENCODE_BATCH = 10_000
DELIVERED = 20_000


def _records(n: int) -> list[ReadingRecord]:
    return readings(n // 4, step=timedelta(milliseconds=1))


def bench_encode(records: list[ReadingRecord]) -> list[Row]:
    out: list[Row] = []
    for compression in ("gzip", "none"):
        exporter = OtlpExporter("http://127.0.0.1:1/v1/logs", compression=compression)
        times, size = [], 0
        for _ in range(3):
            started = time.perf_counter()
            size = len(exporter.body(records))
            times.append(time.perf_counter() - started)
        note = f"{len(records):,}-record batch, median of 3"
        out.append(
            Row("otlp", f"encode {compression}", len(records) / median(times), "records/s", note)
        )
        out.append(Row("otlp", f"wire {compression}", size / len(records), "bytes/record"))
    http_json = gzip.compress(json_bytes([gpuid_shape(to_wire(r)) for r in records]), 6)
    out.append(
        Row("otlp", "wire http json gzip", len(http_json) / len(records), "bytes/record",
            "the HTTP exporter's body of the same records, for comparison")
    )  # fmt: skip
    return out


def _start_receiver(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.servers.otlp", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(400):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("OTLP receiver did not start")


async def bench_delivery(records: list[ReadingRecord]) -> list[Row]:
    port = free_port()
    proc = await asyncio.to_thread(_start_receiver, port)
    out: list[Row] = []
    try:
        for batch_size in (10, 1000):
            exporter = OtlpExporter(f"http://127.0.0.1:{port}/v1/logs")
            policy = BatchPolicy(
                batch_size=batch_size, flush_interval=0.01, queue_size=len(records)
            )
            worker = ExporterWorker(exporter, policy, AgentMetrics())
            task = asyncio.create_task(worker.run())
            started = time.perf_counter()
            for record in records:
                await worker.put(record)
            deadline = time.monotonic() + 600
            while worker.describe()["delivered_records"] < len(records):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{worker.describe()['delivered_records']}/{len(records)} delivered"
                    )
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
            worker.close_intake()
            await asyncio.wait_for(task, 30)
            await exporter.close()
            note = f"{len(records):,} records, gzip, decoding receiver in its own process"
            out.append(
                Row(
                    "otlp", f"deliver batch {batch_size}", len(records) / elapsed, "records/s", note
                )
            )
    finally:
        proc.terminate()
        proc.wait(10)
    return out


async def run() -> list[Row]:
    rows = await asyncio.to_thread(bench_encode, _records(ENCODE_BATCH))
    rows += await bench_delivery(_records(DELIVERED))
    return rows
