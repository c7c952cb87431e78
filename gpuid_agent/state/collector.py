"""The collector: reads the node through its sources and publishes one `NodeSnapshot` per change.

A new snapshot follows every NVML collection, every XID event and every attribution change
(kubelet or pod metadata); consumers subscribe to the `SnapshotBus` and never call each other.
The collector is the only writer of the node's state, so it needs no locks: XID events arrive
from their thread through `call_soon_threadsafe`.

A collection that does not finish within the NVML source's call bound (STALL_TIMEOUT, given to
the source once) or an NVML call hung in the driver makes `stalled()` say so: liveness fails and
the kubelet restarts a wedged agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from gpuid_agent.facts import GpuSample, NodeInventory
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import NvmlError, NvmlStalledError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import Reason, StatusBoard
from gpuid_agent.sources.nvml.reader import NvmlReading, with_health_fields
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.attribution.process_service import ProcessTracker
from gpuid_agent.state.attribution.service import Attributor
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.health.monitor import HealthConfig, HealthMonitor, log_transitions
from gpuid_agent.state.health.verdicts import Transition
from gpuid_agent.state.health.workloads import with_holders
from gpuid_agent.state.inventory import build_inventory, shared_uuids
from gpuid_agent.state.snapshot import Cause, NodeSnapshot

_log = log.get("collector")
NVML_BACKOFF_MAX = 300.0
JOIN_WAIT = 15.0  # longest a transition waits at start for the kubelet and pod metadata


@dataclass(slots=True)
class NodeIdentity:
    """Who this node is; the machine id may improve while the agent runs (providerID)."""

    node: str
    cluster: str
    machine: str
    machine_source: str

    def use_machine(self, machine: str, source: str) -> None:
        """A better machine id: the next snapshot carries it, so a change is an inventory
        change with new records."""
        if (machine, source) != (self.machine, self.machine_source):
            _log.info("machine identity", extra={"machine": machine, "machine_source": source})
            self.machine, self.machine_source = machine, source


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    interval: float  # COLLECT_INTERVAL
    health: HealthConfig
    accounting: AccountingConfig = field(default_factory=AccountingConfig)


class Collector:
    def __init__(
        self,
        config: CollectorConfig,
        identity: NodeIdentity,
        nvml: NvmlSource,
        attributor: Attributor,
        bus: SnapshotBus,
        *,
        metrics: AgentMetrics,
        board: StatusBoard,
        processes: ProcessTracker,
    ) -> None:
        self.identity = identity
        self.nvml = nvml
        self.health = HealthMonitor(config.health, nvml, board, self.on_xid)
        self.attributor = attributor
        self.bus = bus
        self._metrics = metrics
        self._board = board
        interval = self._interval = config.interval
        self._backoff = Backoff(interval, max(interval, NVML_BACKOFF_MAX))
        self.inventory: NodeInventory | None = None
        self.samples: dict[str, GpuSample] = {}
        self.processes = processes
        self.accounting = Accountant(config.accounting, identity.node)
        self._seq = 0
        self._held: list[Transition] = []  # transitions waiting for the first attribution
        self._settled = False
        self._started: float | None = None
        self._busy_since: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # GPUs the kubelet can allocate (None without GetAllocatableResources); compared with
        # NVML's count when EXPECTED_GPU_COUNT is -1. A node whose GPUs are all handed out
        # through DRA has none: the DRA driver's ResourceSlices count them instead.
        board.set("nvml", "starting")

    # ---- snapshots -------------------------------------------------------------------------

    def _publish(self, cause: Cause, transitions: list[Transition] | None = None) -> None:
        self._held.extend(transitions or ())  # an XID before the first inventory waits for it
        if self.inventory is None:
            return
        attribution = self.attributor.refresh(self.inventory)
        processes = self.processes.view(
            self.inventory,
            self.samples,
            attribution,
            self.attributor.pods,
            self.attributor.label_allowlist,
        )
        joined: tuple[Transition, ...] = ()
        if self._joinable():
            joined = with_holders(self._held, self.inventory, attribution)
            self._held = []
            log_transitions(joined)
        accounting = self.accounting.advance(self.inventory, self.samples, attribution, processes)
        self._seq += 1
        self.bus.publish(
            NodeSnapshot(
                seq=self._seq,
                cause=cause,
                inventory=self.inventory,
                samples=self.samples,
                health=self.health.snapshot(),
                attribution=attribution,
                transitions=joined,
                pods_ready=self.attributor.pods_ready,
                processes=processes,
                expected_gpus=self.health.expected,
                accounting=accounting,
            )
        )

    def _joinable(self) -> bool:
        """Whether transitions can be joined to their holders now. At start the kubelet (its
        first poll, whatever the outcome) and the pod metadata may not have answered yet:
        transitions wait for them, at most JOIN_WAIT, so the first records name who held the
        GPU. Later, what is known at the moment is used."""
        if self._settled:
            return True
        now = time.monotonic()
        if self._started is None:
            self._started = now
        polled = self.attributor.source.polled.is_set()
        ready = polled and self.attributor.pods_ready
        if ready or now - self._started >= JOIN_WAIT:
            self._settled = True
        return self._settled

    def release_held(self) -> None:
        """Publish transitions still waiting for attribution (at shutdown)."""
        self._settled = True
        if self._held:
            self._publish("collection")

    # ---- collection ------------------------------------------------------------------------

    async def collect_once(self) -> bool:
        """One pass over NVML and a snapshot; False when NVML is unavailable (the reason is
        on the status board)."""
        self._busy_since = time.monotonic()
        try:
            return await self._collect()
        finally:
            self._busy_since = None

    async def _collect(self) -> bool:
        started = time.perf_counter()
        try:
            if not self.nvml.initialised:
                await self.nvml.init()
            reading = await self.nvml.read()
        except NvmlStalledError as exc:
            self._nvml_down(Reason(str(exc), exc.figures), "stalled", state="stalled")
            return False
        except NvmlError as exc:
            self._nvml_down(str(exc), "read" if self.nvml.initialised else "init")
            return False
        self._metrics.collection_duration.observe(time.perf_counter() - started)
        if reading.errors:
            self._metrics.collection_errors.labels("field").inc(reading.errors)
        if reading.lost:
            self._metrics.collection_errors.labels("gpu_lost").inc(len(reading.lost))
        ident = self.identity
        inventory = build_inventory(
            reading.gpus,
            node=ident.node,
            cluster=ident.cluster,
            machine=ident.machine,
            machine_source=ident.machine_source,
            driver_version=reading.driver_version,
            cuda_driver_version=reading.cuda_driver_version,
            read_time=datetime.now(UTC),
        )
        signals, transitions = await self._check_health(inventory, reading)
        await self.processes.collect(self.nvml, inventory.gpus)
        # Inventory and samples change together: a snapshot published meanwhile (attribution,
        # XID) must not pair the new GPUs with the last pass's telemetry.
        # ECC, remapped rows and clock events were read once, for health; /gpu/metrics too.
        self.inventory = inventory
        self.samples = with_health_fields(reading.samples, signals.values())
        self._publish("collection", transitions)
        await self.accounting.save_due()
        self._metrics.set_gpus(len(inventory.gpus))
        self._metrics.nvml_up.set(1)
        problems = []
        if reading.lost:
            problems.append("unreadable: " + ", ".join(f"GPU {i}" for i in sorted(reading.lost)))
        shared = shared_uuids(inventory.gpus)
        if shared:
            self._metrics.collection_errors.labels("duplicate_uuid").inc(len(shared))
            problems += [
                f"GPUs {', '.join(map(str, indexes))} report one UUID {uuid}: "
                "its holders are attributed to none of them"
                for uuid, indexes in sorted(shared.items())
            ]
        self._board.set("nvml", "degraded" if problems else "ok", "; ".join(problems) or None)
        return True

    async def _check_health(
        self, inventory: NodeInventory, reading: NvmlReading
    ) -> tuple[dict[int, GpuHealthSignals], list[Transition]]:
        self._loop = asyncio.get_running_loop()
        try:
            return await self.health.check(
                inventory,
                reading,
                self.nvml,
                self.attributor.allocatable_gpus(self.inventory),
                self.attributor.dra_gpu_count(),
            )
        except NvmlError as exc:
            self._board.set("health", "degraded", f"health read failed: {exc}")
        except Exception as exc:  # a health bug must not stop collection
            _log.exception("health check failed")
            self._board.set("health", "degraded", f"health read failed: {exc!r}")
        return {}, []

    def _nvml_down(
        self,
        reason: str | Reason,
        stage: str,
        state: Literal["unavailable", "stalled"] = "unavailable",
    ) -> None:
        self._metrics.nvml_up.set(0)
        self._metrics.collection_errors.labels(stage).inc()
        self._board.set("nvml", state, reason)

    async def run(self) -> None:
        while True:
            if await self.collect_once():
                self._backoff.reset()
                delay = self._interval
            else:
                # a fleet whose driver came back at once must not retry in lockstep
                delay = max(self._interval, self._backoff.next())
            await asyncio.sleep(delay)

    def stalled(self) -> Reason | None:
        """Why the collector counts as stalled (a pass or an NVML call past the NVML source's
        call bound). A hung NVML call is named first: it is the cause, and naming it whichever
        way the pass is going keeps the words (and so the log) steady while it hangs."""
        busy = self._busy_since
        if busy is None or time.monotonic() - busy <= self.nvml.call_timeout:
            return self.nvml.stalled()
        # past the bound, the NVML call the pass waits on is named however long it has run
        return self.nvml.stalled(bound=0) or Reason(
            "collection running past its bound", {"running_s": round(time.monotonic() - busy)}
        )

    # ---- events ----------------------------------------------------------------------------

    def on_xid(self, event: XidEvent) -> None:
        """Called on the XID thread: hand the event to the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop may close meanwhile
                loop.call_soon_threadsafe(self._xid, event)

    def _xid(self, event: XidEvent) -> None:
        self._publish("xid", self.health.record_xid(event))

    async def follow_kernel_log(self) -> None:
        """A new snapshot whenever a kernel log line changes a verdict (KERNEL_LOG set)."""
        if self.health.kernel is not None:
            await self.health.kernel.follow(
                lambda: self.inventory, lambda ts: self._publish("xid", ts)
            )

    async def follow_attribution(self) -> None:
        """A new snapshot whenever the kubelet mapping or the pod metadata changes."""
        while True:
            await self.attributor.wait_changed()
            if self.inventory is None:
                self.attributor.refresh(None)
            else:
                self._publish("attribution")
