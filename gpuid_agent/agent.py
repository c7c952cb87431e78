"""Wiring: sources → inventory → sinks, supervised tasks, the HTTP server, and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.pipeline import BatchPolicy, build_pipeline
from gpuid_agent.model import GpuSample, NodeInventory
from gpuid_agent.node.conditions import NodeConditionWriter
from gpuid_agent.node.labels.service import NodeLabelling
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.health import HealthPublisher, health_records
from gpuid_agent.records.readings import ReadingEmitter
from gpuid_agent.runtime import log
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.errors import NvmlUnavailableError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.runtime.supervisor import Supervisor
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.app import build_app
from gpuid_agent.sources.kube.pods import PodCache
from gpuid_agent.sources.kubelet import (
    PodResourcesClient,
    PodResourcesSource,
    ResourceMatcher,
)
from gpuid_agent.sources.machine import local_machine_id
from gpuid_agent.sources.nvml.api import NvmlApi, PynvmlApi
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.reader import NvmlReading, NvmlSource, with_health_fields
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.sources.nvml.xid import XidWatcher
from gpuid_agent.state.attribution import Attribution, count_allocatable_gpus
from gpuid_agent.state.attribution.service import Attributor
from gpuid_agent.state.health.model import Transition
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.inventory import build_inventory

_log = log.get("agent")
NVML_BACKOFF_MAX = 300.0


def make_nvml_api(settings: Settings) -> NvmlApi:
    if settings.simulate:
        from gpuid_agent.simulate.nvml_backend import SimulatedNvml

        return SimulatedNvml(settings.simulate, settings.effective_node_name(), settings.fault)
    return PynvmlApi(settings.nvml_library_path)


def make_exporters(settings: Settings) -> list[Exporter]:
    """The configured exporters; each module is imported only when chosen, so an unused
    exporter's client library (asyncpg, aiobotocore) is never loaded."""
    exporters: list[Exporter] = []
    for name in settings.exporter_type:
        if name == "stdout":
            from gpuid_agent.delivery.exporters.stdout import StdoutExporter

            exporters.append(StdoutExporter())
        elif name == "http":
            from gpuid_agent.delivery.exporters.http import HttpExporter

            exporters.append(HttpExporter.from_settings(settings))
        elif name == "postgres":
            from gpuid_agent.delivery.exporters.postgres import PostgresExporter

            exporters.append(PostgresExporter.from_settings(settings))
        elif name == "s3":
            from gpuid_agent.delivery.exporters.s3 import S3Exporter

            exporters.append(S3Exporter.from_settings(settings))
        else:  # pragma: no cover - config validation admits only the names above
            raise ValueError(f"unknown exporter {name}")
    return exporters


class Agent:
    def __init__(
        self,
        settings: Settings,
        *,
        nvml_api: NvmlApi | None = None,
        exporters: Sequence[Exporter] | None = None,
    ) -> None:
        self.settings = settings
        self.node = settings.effective_node_name()
        self.metrics = AgentMetrics()
        self.registry = self.metrics.registry
        self.board = StatusBoard()
        self.supervisor = Supervisor()
        self.nvml = NvmlSource(nvml_api or make_nvml_api(settings))
        policy = BatchPolicy(
            batch_size=settings.batch_size,
            flush_interval=settings.flush_interval,
            queue_size=settings.queue_size,
            retry_count=settings.retry_count,
            timeout=settings.timeout,
            backoff_base=settings.retry_backoff,
            backoff_max=settings.retry_backoff_max,
        )
        chosen = list(exporters) if exporters is not None else make_exporters(settings)
        self.pipeline = build_pipeline(
            chosen,
            policy,
            self.metrics,
            spool_dir=settings.spool_dir,
            spool_max_bytes=settings.spool_max_bytes,
        )
        source = (
            f"{settings.pod_namespace}/{settings.pod_name}"
            if settings.pod_name
            else f"gpuid-agent/{self.node}"
        )
        self.source = source
        self.emitter = ReadingEmitter(
            source=source,
            heartbeat_interval=settings.heartbeat_interval,
            publish=self.pipeline.publish,
        )
        self.machine, self.machine_source = self._machine_identity()
        self.labelling = NodeLabelling(
            settings, self.node, self.metrics, self.board, self._use_machine
        )
        self._init_attribution(source)
        self.inventory: NodeInventory | None = None
        self.samples: dict[str, GpuSample] = {}
        self._rendered = gpu_metrics.EMPTY
        self._render_lock = asyncio.Lock()
        self._render_seq = self._installed_seq = 0
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None
        self.started_at = datetime.now(UTC)
        self._init_health()
        self.board.set("nvml", "starting")
        for worker in self.pipeline.workers:
            self.board.set(f"exporter:{worker.name}", "ok")

    def _init_attribution(self, source: str) -> None:
        settings = self.settings
        self._sim_dir: str | None = None
        self._sim_kubelet: Any = None
        socket_path = settings.pod_resources_socket
        # A simulated node runs its own kubelet unless pointed at one (the benchmark does).
        if settings.simulate and "pod_resources_socket" not in settings.model_fields_set:
            self._sim_dir = tempfile.mkdtemp(prefix="gpuid-kubelet-")
            socket_path = os.path.join(self._sim_dir, "kubelet.sock")
        self.pod_resources = PodResourcesSource(
            PodResourcesClient(socket_path, timeout=settings.pod_resources_timeout),
            interval=settings.pod_resources_interval,
            stale_after=settings.pod_resources_stale_after,
            resources=ResourceMatcher(settings.gpu_resource_names),
            board=self.board,
            metrics=self.metrics.attribution,
        )
        self.attributor = Attributor(
            self.pod_resources,
            label_allowlist=settings.pod_label_allowlist,
            metrics=self.metrics.attribution,
        )
        # pod UIDs, owners and labels from the API (list+watch of this node's pods)
        self.pods: PodCache | None = None
        if settings.kube_api != "off":
            self.pods = PodCache(
                self.node,
                board=self.board,
                changed=self.attributor.changed,
                label_allowlist=settings.pod_label_allowlist,
                metrics=self.metrics.attribution,
                mode=settings.kube_api,
            )
            self.attributor.pods = self.pods
        self.render_options = gpu_metrics.RenderOptions(
            workload_labels=self.pods is not None,
            pod_labels=gpu_metrics.pod_label_columns(settings.pod_label_allowlist),
        )
        self.trail = AllocationTrail(
            TrailIdentity(settings.cluster_name, self.node, source),
            publish_durable=self.pipeline.publish_durable,
            state_dir=settings.state_dir,
        )

    def _refresh_now(self) -> None:
        """Attribute and render /gpu/metrics on the loop, at once: after an NVML collection
        and an XID, so what the agent knows and what it serves move together."""
        attribution = self.attributor.refresh(self.inventory)
        if self.inventory is None:
            return
        self._render_seq += 1
        render = self._renderer(self.inventory, self.samples, attribution)
        self._install(self._render_seq, render())
        self._offer_trail(attribution)

    async def _refresh_attribution(self) -> None:
        """After a kubelet or pod-metadata change: attribute, and render in a thread, since a
        page of thousands of per-pod series (dcgm naming) takes long enough to stall scrapes.
        A render the loop installed meanwhile is newer and wins."""
        async with self._render_lock:
            inventory, samples = self.inventory, self.samples
            attribution = self.attributor.refresh(inventory)
            if inventory is None:
                return
            self._offer_trail(attribution)
            self._render_seq += 1
            seq = self._render_seq
            self._install(
                seq, await asyncio.to_thread(self._renderer(inventory, samples, attribution))
            )

    def _offer_trail(self, attribution: Attribution) -> None:
        # once pod metadata is in, so allocation ids carry the pod UID from the first record
        if self.inventory is not None and self.attributor.pods_ready:
            self.trail.offer(attribution, self.inventory)

    def _renderer(
        self, inventory: NodeInventory, samples: dict[str, GpuSample], attribution: Attribution
    ) -> Callable[[], gpu_metrics.RenderedMetrics]:
        return functools.partial(
            gpu_metrics.render,
            inventory,
            samples,
            self.settings.metrics_naming,
            self.health.snapshot(),
            attribution=attribution,
            options=self.render_options,
        )

    def _install(self, seq: int, rendered: gpu_metrics.RenderedMetrics) -> bool:
        """Serve `rendered` unless a render started later was installed already."""
        if seq < self._installed_seq:
            return False
        self._installed_seq, self._rendered = seq, rendered
        return True

    def _kubelet_gpu_count(self) -> int | None:
        """GPUs the kubelet can allocate (None without GetAllocatableResources)."""
        return count_allocatable_gpus(self.pod_resources.current(), self.inventory)

    async def _attribution_loop(self) -> None:
        while True:
            await self.attributor.wait_changed()
            await self._refresh_attribution()

    async def _start_simulated_kubelet(self) -> None:
        from gpuid_agent.simulate.kubelet import FakeKubelet, simulated_pods
        from gpuid_agent.simulate.nvml_backend import SimulatedNvml

        api = self.nvml.reader.api
        if not isinstance(api, SimulatedNvml):
            return
        pods, allocatable = simulated_pods(api.gpus)
        self._sim_kubelet = FakeKubelet(self.pod_resources.client.socket_path, pods, allocatable)
        await self._sim_kubelet.start()

    def _machine_identity(self) -> tuple[str, str]:
        if self.settings.simulate:
            return f"sim-{self.node}", "simulated"
        found = local_machine_id(self.settings.dmi_product_uuid_path, self.settings.machine_id_path)
        return found if found else (self.node, "node_name")

    def _use_machine(self, machine: str, source: str) -> None:
        """A better machine id (the Node's providerID); the next snapshot carries it, so a
        change is an inventory change with new records."""
        if (machine, source) != (self.machine, self.machine_source):
            _log.info("machine identity", extra={"machine": machine, "machine_source": source})
            self.machine, self.machine_source = machine, source

    # ---- collection ------------------------------------------------------------------------

    async def collect_once(self) -> bool:
        """One NVML pass: update the snapshot, /gpu/metrics and the emitter. False if NVML is
        unavailable (the reason is on the status board)."""
        if not self.nvml.initialised:
            try:
                await self.nvml.init()
            except NvmlUnavailableError as exc:
                self._nvml_down(str(exc), "init")
                return False
        started = time.perf_counter()
        try:
            reading = await self.nvml.read()
        except NvmlUnavailableError as exc:
            self._nvml_down(str(exc), "read")
            return False
        self.metrics.collection_duration.observe(time.perf_counter() - started)
        if reading.errors:
            self.metrics.collection_errors.labels("field").inc(reading.errors)
        if reading.lost:
            self.metrics.collection_errors.labels("gpu_lost").inc(len(reading.lost))
        inventory = build_inventory(
            reading.gpus,
            node=self.node,
            cluster=self.settings.cluster_name,
            machine=self.machine,
            machine_source=self.machine_source,
            driver_version=reading.driver_version,
            cuda_driver_version=reading.cuda_driver_version,
            read_time=datetime.now(UTC),
        )
        self.inventory = inventory
        self.samples = reading.samples
        signals = await self._check_health(inventory, reading)
        # ECC, remapped rows and clock events were read once, for health; /gpu/metrics too
        self.samples = with_health_fields(reading.samples, signals.values())
        self._refresh_now()
        self.metrics.gpu_count.set(len(inventory.gpus))
        self.metrics.nvml_up.set(1)
        if reading.lost:
            lost = ", ".join(f"GPU {i}" for i in sorted(reading.lost))
            self.board.set("nvml", "degraded", f"unreadable: {lost}")
        else:
            self.board.set("nvml", "ok")
        self.emitter.offer(inventory)
        self.labelling.offer(inventory)
        return True

    def _nvml_down(self, reason: str, stage: str) -> None:
        self.metrics.nvml_up.set(0)
        self.metrics.collection_errors.labels(stage).inc()
        self.board.set("nvml", "unavailable", reason)

    async def _collect_loop(self) -> None:
        failures = 0
        while True:
            if await self.collect_once():
                failures = 0
                delay = self.settings.collect_interval
            else:
                # Exponential from the collection interval, jittered so a fleet whose driver
                # came back at once does not retry in lockstep.
                failures += 1
                cap = min(NVML_BACKOFF_MAX, self.settings.collect_interval * 2.0**failures)
                delay = random.uniform(cap / 2, cap)
            await asyncio.sleep(delay)

    # ---- health ----------------------------------------------------------------------------

    def _init_health(self) -> None:
        settings = self.settings
        self.health = HealthTracker(window=settings.health_window, xid_hold=settings.xid_hold)
        self.health_reader = HealthReader(self.nvml.reader.api)
        self.health_publisher = HealthPublisher(self.pipeline.publish)
        # XID waits are sliced to the collection interval (50 ms..1 s): the slice bounds how
        # long stopping the XID thread takes.
        wait_ms = int(min(1000.0, max(50.0, settings.collect_interval * 1000)))
        self.xid = XidWatcher(self.nvml.reader.api, self._xid_from_thread, wait_ms=wait_ms)
        # The kubelet's allocatable GPU count, when a pod-resources client provides it; used
        # when EXPECTED_GPU_COUNT is -1.
        self.allocatable_gpu_count: Callable[[], int | None] = self._kubelet_gpu_count
        self._loop: asyncio.AbstractEventLoop | None = None
        self.conditions = (
            NodeConditionWriter(self.node, self.board, kube_api=settings.kube_api)
            if settings.node_conditions
            else None
        )

    def _expected_gpus(self) -> tuple[int | None, str]:
        if self.settings.expected_gpu_count >= 0:
            return self.settings.expected_gpu_count, "EXPECTED_GPU_COUNT"
        return self.allocatable_gpu_count(), "kubelet allocatable"

    async def _check_health(
        self, inventory: NodeInventory, reading: NvmlReading
    ) -> dict[int, GpuHealthSignals]:
        readable = {g.index: g.uuid for g in inventory.gpus if g.index not in reading.lost}
        try:
            signals = await self.nvml.run(lambda: self.health_reader.read(readable))
        except Exception as exc:  # a health bug must not stop collection
            self.board.set("health", "degraded", f"health read failed: {exc!r}")
            return {}
        self._loop = asyncio.get_running_loop()
        self.xid.watch(readable)
        expected, source = self._expected_gpus()
        transitions = self.health.observe(
            inventory.gpus,
            signals,
            reading.lost,
            expected_gpus=expected,
            expected_source=source,
            xid_unsupported=self.xid.unsupported,
            xid_unavailable=self.xid.unavailable,
        )
        if self.xid.unavailable:
            self.board.set("health", "degraded", self.xid.unavailable)
        else:
            self.board.set("health", "ok")
        self._publish_health(transitions)
        if self.conditions is not None:
            self.conditions.offer(self.health.snapshot())
        return signals

    def _xid_from_thread(self, event: XidEvent) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # the loop may close between the check and the call
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_xid, event)

    def _on_xid(self, event: XidEvent) -> None:
        self._publish_health(self.health.record_xid(event))
        if self.conditions is not None:
            self.conditions.offer(self.health.snapshot())
        self._refresh_now()

    def _publish_health(self, transitions: list[Transition]) -> None:
        if not transitions or self.inventory is None:
            return
        for t in transitions:
            level = 30 if t.current.state in ("degraded", "unhealthy") else 20
            _log.log(
                level,
                f"GPU health: {t.check} is {t.current.state}",
                extra={
                    "gpu": t.index,
                    "uuid": t.uuid,
                    "check": t.check,
                    "previous": t.previous.state if t.previous else None,
                    "reason": t.current.reason,
                    "action": t.current.action,
                },
            )
        self.health_publisher.offer(health_records(transitions, self.inventory, source=self.source))

    async def _stop_xid(self, within: float) -> None:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.xid.stop, within):
            _log.warning("XID thread still waiting at shutdown")

    # ---- AgentView for the server ----------------------------------------------------------

    def gpu_metrics(self) -> gpu_metrics.RenderedMetrics:
        return self._rendered

    def liveness(self) -> tuple[bool, list[str]]:
        problems = self.supervisor.problems()
        return not problems, problems

    async def readiness(self) -> tuple[bool, list[str]]:
        problems = list(self.supervisor.problems())
        nvml = self.board.get("nvml")
        if nvml is None or nvml.state not in ("ok", "degraded"):
            reason = nvml.reason if nvml and nvml.reason else "not read yet"
            problems.append(f"nvml: {reason}")
        # Fan-out policy (docs/exporters/README.md): a failing exporter whose records are held
        # is degraded, not a readiness problem; unready only when every exporter is losing data.
        healths = await self.pipeline.health()
        for name, health in healths.items():
            self.board.set(f"exporter:{name}", health.state, health.reason)
        if not self.pipeline.ready(healths):
            problems.extend(f"exporter {n}: {h.reason}" for n, h in healths.items())
        ok = not problems
        self.metrics.health_check_success.set(1 if ok else 0)
        return ok, problems

    async def status(self) -> dict[str, Any]:
        ready, problems = await self.readiness()
        inventory = self.inventory
        return {
            "version": __version__,
            "node": self.node,
            "cluster": self.settings.cluster_name,
            "machine": {"id": self.machine, "source": self.machine_source},
            "started_at": self.started_at,
            "ready": ready,
            "problems": problems,
            "components": self.board.as_dict(),
            "labels": self.labelling.status(),
            "health": self.health.snapshot().as_dict(),
            "inventory": None
            if inventory is None
            else {
                "read_time": inventory.read_time,
                "driver_version": inventory.driver_version,
                "cuda_driver_version": inventory.cuda_driver_version,
                "gpu_count": len(inventory.gpus),
                "serials": inventory.serials,
                "chassis": inventory.chassis_serials,
                "gpus": [dataclasses.asdict(g) for g in inventory.gpus],
            },
            "attribution": {
                **self.attributor.status(),
                "pods": None if self.pods is None else self.pods.status(),
                "trail": self.trail.status(),
            },
            "exporters": [w.describe() for w in self.pipeline.workers],
            "config": self.settings.redacted(),
        }

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        log.set_context(node=self.node)
        app = build_app(self)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.settings.server_address,
            self.settings.server_port,
            reuse_address=True,
        )
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.settings.server_port
        if self._sim_dir is not None:
            await self._start_simulated_kubelet()
        for worker in self.pipeline.workers:
            self.supervisor.spawn(f"exporter:{worker.name}", worker.run())
        self.supervisor.spawn("emitter", self.emitter.run())
        await self.labelling.start(self.supervisor.spawn)
        self.supervisor.spawn("allocations", self.trail.run())
        # One API client for the agent (opened by the labelling, which also needs it for the
        # machine id), so every request is counted in gpuid_kube_api_requests_total.
        kube = self.labelling.kube
        if self.pods is not None and await self.pods.open(kube):
            self.supervisor.spawn("pods", self.pods.run())
        self.supervisor.spawn("pod-resources", self.pod_resources.run())
        self.supervisor.spawn("attribution", self._attribution_loop())
        self.supervisor.spawn("health-records", self.health_publisher.run())
        if self.conditions is not None and await self.conditions.open(kube):
            self.supervisor.spawn("node-conditions", self.conditions.run())
        self.supervisor.spawn("collector", self._collect_loop())
        _log.info(
            "agent started",
            extra={
                "version": __version__,
                "port": self.bound_port,
                "exporters": [w.name for w in self.pipeline.workers],
                "simulate": self.settings.simulate or None,
                "pid": os.getpid(),
            },
        )

    async def stop(self) -> None:
        """Stop collecting, flush what is queued within the grace period, release everything."""
        grace = self.settings.shutdown_grace
        deadline = time.monotonic() + grace
        await self.supervisor.stop("collector", "pod-resources", "pods", "attribution")
        await self._stop_xid(max(0.0, deadline - time.monotonic()))
        self.emitter.stop()
        self.health_publisher.stop()
        self.trail.stop()
        for name in ("emitter", "health-records", "allocations"):
            if not await self.supervisor.wait(name, max(0.0, deadline - time.monotonic())):
                await self.supervisor.stop(name)
        for worker in self.pipeline.workers:
            worker.close_intake()
        names = [f"exporter:{w.name}" for w in self.pipeline.workers]
        flushed = await asyncio.gather(
            *(self.supervisor.wait(n, max(0.0, deadline - time.monotonic())) for n in names)
        )
        if not all(flushed):
            left = sum(w.pending for w in self.pipeline.workers)
            _log.error("grace period over with records unsent", extra={"pending": left})
        await self.supervisor.stop()
        for worker in self.pipeline.workers:
            await worker.exporter.close()
        if self.conditions is not None:
            await self.conditions.close()
        await self.nvml.close()
        await self.labelling.close()
        await self.pod_resources.client.close()
        if self.pods is not None:
            await self.pods.close()
        await self._stop_simulated_kubelet()
        if self._runner is not None:
            await self._runner.cleanup()
        _log.info("agent stopped")

    async def _stop_simulated_kubelet(self) -> None:
        if self._sim_kubelet is not None:
            await self._sim_kubelet.stop()
        if self._sim_dir is not None:
            shutil.rmtree(self._sim_dir, ignore_errors=True)


async def run_agent(settings: Settings, stop: asyncio.Event) -> None:
    agent = Agent(settings)
    await agent.start()
    try:
        await stop.wait()
    finally:
        await agent.stop()
