"""The wiring root: builds the sources, the collector and the consumers of its snapshots, runs
them as supervised tasks beside the HTTP server, and stops them in order.

    sources ─► Collector ─NodeSnapshot─► SnapshotBus ─┬─► renderer (/gpu/metrics)
                                                     ├─► readings, allocations, health ─► Pipeline
                                                     └─► node labels, Node conditions, Events
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.node.conditions import NodeConditionWriter
from gpuid_agent.node.events import NodeEventWriter
from gpuid_agent.node.labels.service import NodeLabelling
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.hardware import HardwareWatch
from gpuid_agent.records.health import HealthPublisher
from gpuid_agent.records.readings import ReadingEmitter
from gpuid_agent.records.runner import run_emitter
from gpuid_agent.runtime import log
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.runtime.metrics import AgentMetrics, exposition_registry
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.runtime.supervisor import Supervisor
from gpuid_agent.serving.app import build_app
from gpuid_agent.serving.listener import Listener, bind, connection_limit, mark_busy
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.serving.request_log import REQUEST_LOG
from gpuid_agent.serving.status_page import StatusPage
from gpuid_agent.setup.delivery import build_delivery, otlp_metrics_push
from gpuid_agent.setup.environment import node_environment
from gpuid_agent.setup.node import (
    attribution_config,
    collector_config,
    labelling_config,
    status_config,
)
from gpuid_agent.sources.kube.client import KubeClient, open_shared_client, request_counter
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.state.attribution.process_service import ProcessTracker
from gpuid_agent.state.attribution.service import build_attributor
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.collector import Collector, NodeIdentity
from gpuid_agent.state.state_file import StateDir

if TYPE_CHECKING:
    from gpuid_agent.delivery.otlp_metrics import OtlpMetricsPush

_log = log.get("agent")


def bind_error(address: str, port: int, exc: OSError) -> ConfigError:
    """Why the server could not listen, naming the setting to change."""
    where = f"{address or '*'}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(
            {"SERVER_PORT": f"{where} is already in use; set another (--server-port 9090)"},
            "cannot start",
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(
            {"SERVER_PORT": f"no permission to listen on {where}; use a port above 1023"},
            "cannot start",
        )
    detail = os.strerror(exc.errno).lower() if exc.errno and exc.errno > 0 else str(exc)
    return ConfigError({"SERVER_ADDRESS": f"cannot listen on {where}: {detail}"}, "cannot start")


class Agent:
    def __init__(
        self,
        settings: Settings,
        *,
        nvml_api: NvmlApi | None = None,
        exporters: Sequence[Exporter] | None = None,
    ) -> None:
        s = self.settings = settings
        node = s.effective_node_name()
        self.metrics, self.board, self.supervisor = AgentMetrics(), StatusBoard(), Supervisor()
        self.bus = SnapshotBus()
        self.environment = node_environment(s, nvml_api)
        self.pipeline = build_delivery(s, self.metrics, exporters)
        self.identity = NodeIdentity(node, s.cluster_name, *self.environment.machine())
        self.source = f"{s.pod_namespace}/{s.pod_name}" if s.pod_name else f"gpuid-agent/{node}"
        env = self.environment
        self.attributor, self.pods = build_attributor(
            attribution_config(s), env.pod_resources_socket, self.board, self.metrics.attribution
        )
        if env.pod_directory is not None:  # a simulated node's pods, without an API server
            self.attributor.pods, self.pods = env.pod_directory, None
        # every state file under STATE_DIR is read through this one (odd files set aside)
        state_dir = StateDir(
            s.state_dir, self.metrics.state_files_rejected,
            newer=self.metrics.state_files_newer, board=self.board,
        )  # fmt: skip
        nvml = NvmlSource(env.nvml_api, call_timeout=s.effective_stall_timeout())
        processes = ProcessTracker(enabled=env.process_attribution, host_proc=env.host_proc)
        self.collector = Collector(
            collector_config(s, state_dir), self.identity, nvml, self.attributor, self.bus,
            metrics=self.metrics, board=self.board, processes=processes,
        )  # fmt: skip
        self.renderer = MetricsRenderer(
            s.metrics_naming, s.pod_label_allowlist, self.pods, self.metrics.render_duration
        )
        # None unless OTEL_METRICS_EXPORTER=otlp: only then is opentelemetry-proto loaded
        self.otlp_metrics: OtlpMetricsPush | None = otlp_metrics_push(
            s, self.renderer.families, self.metrics
        )
        self.emitter = ReadingEmitter(
            source=self.source, heartbeat_interval=s.heartbeat_interval,
            publish=self.pipeline.publish,
        )  # fmt: skip
        self.trail = AllocationTrail(
            TrailIdentity(s.cluster_name, node, self.source),
            publish_durable=self.pipeline.publish_durable, state_dir=state_dir,
            usage_interval=s.accounting_interval,
        )  # fmt: skip
        self.health_records = HealthPublisher(self.pipeline.publish, source=self.source)
        self.hardware = HardwareWatch(
            cluster=s.cluster_name,
            source=self.source,
            publish_durable=self.pipeline.publish_durable,
            state_dir=state_dir,
        )
        self.labelling = NodeLabelling(
            labelling_config(s), node, self.metrics, self.board, self.identity.use_machine
        )
        self.conditions = NodeConditionWriter(node, self.board) if s.node_conditions else None
        self.events = (
            NodeEventWriter(node, self.board, self.metrics.node_events) if s.node_events else None
        )
        self.page = StatusPage(
            status_config(s, env), identity=self.identity, bus=self.bus,
            stalled=self.collector.stalled, board=self.board, supervisor=self.supervisor,
            pipeline=self.pipeline, metrics=self.metrics, attribution=self.attributor,
            parts={
                "labels": self.labelling,
                "pods": self.pods,
                "trail": self.trail,
                "hardware": self.hardware,
            },
        )  # fmt: skip
        self.kube: KubeClient | None = None
        self._runner: web.AppRunner | None = None
        self._listener: Listener | None = None
        self.bound_port: int | None = None

    async def _serve(self) -> None:
        s = self.settings
        served = exposition_registry(self.metrics.registry, s.metrics_created_series)
        app = build_app(self.page, self.renderer, served, middlewares=[mark_busy])
        # keepalive_timeout bounds a request line and headers trickled in (slowloris), from the
        # first byte or the last answer; bodies are never read: one still arriving after the
        # answer gets a second at most
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=REQUEST_LOG,
            keepalive_timeout=s.server_idle_timeout, lingering_time=1.0,
        )  # fmt: skip
        await self._runner.setup()
        try:
            sockets = bind(s.server_address, s.server_port)
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise bind_error(s.server_address, s.server_port, exc) from exc
        assert self._runner.server is not None
        limit = connection_limit(s.server_max_connections)
        if limit < s.server_max_connections:
            _log.info(
                "HTTP connections limited to half the file-descriptor limit",
                extra={"limit": limit, "server_max_connections": s.server_max_connections},
            )
        self._listener = Listener(
            self._runner.server, sockets, limit=limit,
            idle_timeout=s.server_idle_timeout, metrics=self.metrics.server,
        )  # fmt: skip
        self.bound_port = sockets[0].getsockname()[1]

    async def start(self) -> None:
        log.set_context(node=self.identity.node)
        await self._serve()
        await self.environment.start()
        spawn, bus = self.supervisor.spawn, self.bus
        for worker in self.pipeline.workers:
            spawn(f"exporter:{worker.name}", worker.run())
            spawn(f"probe:{worker.name}", worker.probe_loop())
        spawn("render", self.renderer.run(bus.subscribe("render")))
        if self.otlp_metrics is not None:
            spawn("otlp-metrics", self.otlp_metrics.run(bus.subscribe("otlp-metrics")))
        spawn("emitter", run_emitter(bus.subscribe("readings"), self.emitter))
        spawn("allocations", run_emitter(bus.subscribe("allocations"), self.trail))
        spawn(
            "health-records", run_emitter(bus.subscribe("health", events=True), self.health_records)
        )
        spawn("hardware", run_emitter(bus.subscribe("hardware"), self.hardware))
        observer = request_counter(self.metrics.kube_api_requests)
        kube = self.kube = await open_shared_client(
            self.settings.kube_api, observer=observer, board=self.board
        )
        await self.labelling.start(spawn, kube)
        spawn(
            "labels-feed", bus.subscribe("labels").feed(lambda n: self.labelling.offer(n.inventory))
        )
        if self.pods is not None and self.pods.open(kube):
            spawn("pods", self.pods.run())
        if (slices := self.attributor.slices) is not None:
            local = self.environment.resource_slices()
            if local is not None:  # a simulated node's driver: no API server to ask
                slices.load(local, "the simulated node's DRA driver")
            elif slices.open(kube):
                spawn("resourceslices", slices.run())
        spawn("pod-resources", self.attributor.source.run())
        spawn("attribution", self.collector.follow_attribution())
        if self.collector.health.kernel is not None:
            spawn("kernel-log", self.collector.follow_kernel_log())
        if (conditions := self.conditions) is not None and conditions.open(kube):
            spawn("node-conditions", conditions.run())
            spawn(
                "conditions-feed",
                bus.subscribe("conditions").feed(lambda n: conditions.offer(n.health)),
            )
        if (events := self.events) is not None and events.open(kube):
            spawn("node-events", events.run())
            spawn("events-feed", bus.subscribe("events", events=True).feed(events.offer))
            self.hardware.listeners.append(events.offer_replaced)
        spawn("readiness", self.page.run(bus.subscribe("readiness")))
        spawn("collector", self.collector.run())
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
        """Stop collecting, publish what the last snapshot owes, flush what is queued within the
        grace period, release everything."""
        deadline = time.monotonic() + self.settings.shutdown_grace

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        # The XID thread ends at the end of its current wait: let that wait run out meanwhile.
        self.collector.health.xid.request_stop()
        sup = self.supervisor
        await sup.stop(
            "collector", "pod-resources", "pods", "resourceslices", "attribution", "readiness",
            "kernel-log",
        )  # fmt: skip
        self.collector.release_held()
        self.bus.close()  # each consumer publishes what the last snapshot owes, then returns
        for name in (
            "emitter",
            "health-records",
            "allocations",
            "hardware",
            "render",
            "otlp-metrics",
        ):
            if not await sup.wait(name, left()):
                await sup.stop(name)
        for worker in self.pipeline.workers:
            worker.close_intake(stop_by=deadline)
        names = [f"exporter:{w.name}" for w in self.pipeline.workers]
        if not all(await asyncio.gather(*(sup.wait(n, left()) for n in names))):
            pending = sum(w.pending for w in self.pipeline.workers)
            _log.error("grace period over with records unsent", extra={"pending": pending})
        await sup.stop()
        for worker in self.pipeline.workers:
            await worker.exporter.close()
        if self.otlp_metrics is not None:
            await self.otlp_metrics.close()
        await self.collector.health.close(min(left(), 2.0))
        await self.collector.nvml.close(max(0.5, min(left(), 2.0)))
        await self.attributor.source.client.close()
        if self.kube is not None:
            await self.kube.close()
        await self.environment.stop()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        _log.info("agent stopped")


async def run_agent(settings: Settings, stop: asyncio.Event) -> None:
    """Build, start and run the agent until `stop` is set. A stop while it is still being
    built or started ends it there: a start held up by a file or a driver that does not
    answer never holds up SIGTERM."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        building = _build_in_thread(settings)
        await asyncio.wait((building, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not building.done():
            _log.warning("stopped while starting: the agent was still being built")
            return
        agent = building.result()
        starting = asyncio.ensure_future(agent.start())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            _log.warning("stopped while starting")
            starting.cancel()
            await asyncio.wait((starting,))
        else:
            starting.result()  # a start that failed (a port in use) raises here, as before
        try:
            await stop.wait()
        finally:
            await agent.stop()
    finally:
        stopping.cancel()


def _build_in_thread(settings: Settings) -> asyncio.Future[Agent]:
    """`Agent(settings)` built in a daemon thread: the loop stays free to take a signal while
    the build reads files and loads libraries, and a build that never returns (a FIFO, a hung
    mount) is left behind at exit instead of holding it."""
    loop = asyncio.get_running_loop()
    built: asyncio.Future[Agent] = loop.create_future()

    def settle(agent: Agent | None, exc: BaseException | None) -> None:
        if built.done():
            return
        if exc is not None:
            built.set_exception(exc)
        elif agent is not None:
            built.set_result(agent)

    def build() -> None:
        agent: Agent | None = None
        failure: BaseException | None = None
        try:
            agent = Agent(settings)
        except BaseException as exc:  # handed to the loop, raised where the agent is awaited
            failure = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: stopped while building
            loop.call_soon_threadsafe(settle, agent, failure)

    threading.Thread(target=build, name="agent-build", daemon=True).start()
    return built
