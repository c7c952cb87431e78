"""A simulated fleet: N nodes' real exporters and workers (disk spool, COPY form, retries) in
one process, fed on the agent's default schedules compressed in time, into real sinks.

Time compression: the fleet's clock runs `compress` times faster than the wall clock. Every
schedule is divided by it (heartbeat, allocation churn, start jitter, FLUSH_INTERVAL,
POSTGRES_IDLE_TIMEOUT, retry backoff), so a node's deliveries per fleet-second and the
connections the fleet holds (Little's law: rate x holding time) are those of the uncompressed
fleet. The work of a delivery (connect, COPY, commit) is not compressed: latencies are wall
seconds, and the server carries `compress` times the fleet's real load.

Sinks are pluggable (`Sink`): each node runs one worker per sink (as the agent's pipeline does),
every sink gets every record, and each sink's figures are rows of their own; another backend
adds a class with the same methods to the bench's list (PostgreSQL and an OTLP receiver).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.readings import reading_records
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import allocation, inventory


@dataclass(frozen=True, slots=True)
class Schedule:
    """The agent's defaults, and the workload assumed around them (fleet seconds)."""

    heartbeat: float = 3600.0  # HEARTBEAT_INTERVAL
    pod_life: float = 7200.0  # mean life of a pod on one GPU (assumed workload): churn
    gpus: int = 4
    start_window: float = 120.0  # a rollout starts every agent within two minutes
    idle_timeout: float = 30.0  # POSTGRES_IDLE_TIMEOUT
    flush_interval: float = 2.0  # FLUSH_INTERVAL
    backoff_base: float = 0.5  # RETRY_BACKOFF
    backoff_max: float = 30.0  # RETRY_BACKOFF_MAX
    batch_size: int = 10  # BATCH_SIZE

    def deliveries_per_node(self) -> float:
        """Deliveries per fleet-second of one node at steady state: one per heartbeat and one
        per allocation start or end (each arrives alone, so each flushes alone)."""
        return 1 / self.heartbeat + 2 * self.gpus / self.pod_life


class Sink(Protocol):
    name: str

    async def start(self) -> None: ...
    def exporter(self, node: str, schedule: Schedule, compress: float) -> Exporter: ...
    async def connections(self) -> int | None:
        """Server-side connections the fleet holds now (None: the sink has no such notion,
        or cannot be asked right now)."""
        ...

    async def stored(self, expected: Expected) -> Expected: ...
    async def stop_server(self) -> None: ...
    async def start_server(self) -> None: ...
    async def latency_p99(self, since: datetime) -> float | None: ...
    async def max_connections(self) -> int | None:
        """The server's connection limit (None: it sets none)."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class Expected:
    """What the fleet emitted (or, returned by a sink, what the sink holds of it)."""

    readings: set[str] = field(default_factory=set)
    allocations_started: set[str] = field(default_factory=set)
    allocations_ended: set[str] = field(default_factory=set)

    @property
    def total(self) -> int:
        return len(self.readings) + len(self.allocations_started) + len(self.allocations_ended)


class SimNode:
    def __init__(
        self,
        name: str,
        exporters: list[Exporter],
        schedule: Schedule,
        compress: float,
        spool_root: Path,
        metrics: AgentMetrics,
        expected: Expected,
        rng: random.Random,
    ) -> None:
        self.name = name
        self.schedule = schedule
        self.compress = compress
        self.expected = expected
        self.rng = rng
        policy = BatchPolicy(
            batch_size=schedule.batch_size,
            flush_interval=schedule.flush_interval / compress,
            backoff_base=schedule.backoff_base / compress,
            backoff_max=schedule.backoff_max / compress,
            health_probe_interval=30.0 / compress,
        )
        # one worker per sink, each with its own spool, as the agent's pipeline builds them
        self.workers = [
            ExporterWorker(
                e,
                policy,
                metrics,
                store=DiskSpool(spool_root / name / e.name, 64 << 20, form=e.stored_form),
            )
            for e in exporters
        ]
        self.pods: dict[int, tuple[str, datetime]] = {}  # GPU → (pod, started)
        self.serial = f"SN-{name}"

    async def _put(self, records: list[AnyRecord]) -> None:
        for record in records:
            for worker in self.workers:
                await worker.put(record)

    async def _readings(self, reason: str) -> None:
        inv = inventory(
            node=self.name,
            machine=f"m-{self.name}",
            serials=[f"{self.serial}-{i // 2}" for i in range(self.schedule.gpus)],
            read_time=datetime.now(UTC),
        )
        records = reading_records(inv, source="fleet/bench", reason=reason)
        self.expected.readings.update(to_wire(r)["record_id"] for r in records)
        await self._put(records)

    async def _churn(self, gpu: int) -> None:
        """A pod leaves the GPU (allocation end) or a new one takes it (allocation start)."""
        now = datetime.now(UTC)
        held = self.pods.pop(gpu, None)
        kw: dict[str, Any] = {
            "node": self.name,
            "uuid": f"GPU-{self.name}-{gpu}",
            "serial": f"{self.serial}-{gpu // 2}",
        }
        if held is not None:
            pod, started = held
            record = allocation(pod=pod, started_at=started, ended_at=now, **kw)
            self.expected.allocations_ended.add(record.record_id)
        else:
            pod = f"p-{self.name}-{gpu}-{self.rng.getrandbits(32):x}"
            self.pods[gpu] = (pod, now)
            record = allocation(pod=pod, started_at=now, **kw)
            self.expected.allocations_started.add(record.record_id)
        await self._put([record])

    async def run(self, stop: asyncio.Event) -> None:
        """Start (jittered), then heartbeats and allocation churn until `stop`."""
        senders = [asyncio.create_task(w.run()) for w in self.workers]
        c, s = self.compress, self.schedule
        try:
            if await _wait(stop, self.rng.uniform(0, s.start_window) / c):
                return
            await self._readings("startup")
            loop = asyncio.get_running_loop()
            # Heartbeat phase uniform, as in a fleet long past its rollout. (Right after a
            # rollout, the first heartbeats come together one HEARTBEAT_INTERVAL later, within
            # the start window: a burst the size of the rollout's.)
            next_beat = loop.time() + self.rng.uniform(0, s.heartbeat) / c
            churn_rate = s.gpus / (s.pod_life / 2)  # events per fleet-second, all GPUs
            while True:
                next_churn = loop.time() + self.rng.expovariate(churn_rate) / c
                wake = min(next_beat, next_churn)
                if await _wait(stop, max(0.0, wake - loop.time())):
                    return
                if wake == next_beat:
                    await self._readings("heartbeat")
                    next_beat += s.heartbeat / c
                else:
                    await self._churn(self.rng.randrange(s.gpus))
        finally:
            for worker in self.workers:
                worker.close_intake()
            try:
                await asyncio.wait_for(asyncio.gather(*senders), 120)
            finally:
                for worker in self.workers:
                    await worker.exporter.close()


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; True when `stop` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


@dataclass(slots=True)
class Samples:
    values: list[int] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.values, default=0)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0


async def sample_during(
    sink: Sink, seconds: float, until: Callable[[], Awaitable[bool]] | None = None
) -> tuple[Samples, float]:
    """Sample the sink's connections every 100 ms for `seconds` (or until `until()` holds);
    the samples and the seconds it took."""
    samples = Samples()
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        count = await sink.connections()
        if count is not None:
            samples.values.append(count)
        if until is not None and await until():
            break
        await asyncio.sleep(0.1)
    return samples, time.monotonic() - started


def deliveries(metrics: AgentMetrics, sink: str) -> float:
    return float(metrics.export_success.labels(sink)._value.get())


def failures(metrics: AgentMetrics, sink: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.export_failure.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("exporter") == sink and s.value:
                out[s.labels["error_type"]] = s.value
    return out


def compression_for(nodes: int, schedule: Schedule, deliveries_per_second: float) -> float:
    """The compression that makes the fleet deliver `deliveries_per_second` on the wall clock
    (what two shared cores can carry while opening a connection per delivery)."""
    return max(1.0, deliveries_per_second / (nodes * schedule.deliveries_per_node()))


def figures(**values: Any) -> dict[str, Any]:
    return values
