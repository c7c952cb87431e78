"""The /gpu/metrics renderer: one task that renders each snapshot off the event loop.

At 1,024 pods with dcgm naming a render takes tens of milliseconds of CPU (a quarter of a
second before exposition.py); on the loop it would hold up every probe for that long. So the
text format is rendered in a worker thread and installed when done, and a snapshot that
arrives meanwhile waits in the subscription's one slot, where a newer one replaces it (a
burst of XIDs costs one more render, not one per XID). Only some clients ask for OpenMetrics
(Prometheus does by default; curl and most tools do not): it is rendered, also in a thread,
the first time a client negotiates it for a snapshot, and shared by every scrape of that
snapshot. dcgm naming is served as text only, as dcgm-exporter is: its counters' names lack
the `_total` OpenMetrics requires.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuid_agent.runtime import log
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.exposition import Family
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("renderer")
EMPTY_OPENMETRICS = b"# EOF\n"
SWITCH_INTERVAL = 0.001

# Called in the rendering thread with the format and the snapshot's seq, before the render.
RenderObserver = Callable[[gpu_metrics.Format, int], None]


@dataclass(eq=False)
class Rendered:
    """The text body of one snapshot, and that snapshot's OpenMetrics once a client asked."""

    seq: int
    text: bytes
    snapshot: NodeSnapshot | None = None
    openmetrics_task: asyncio.Task[bytes] | None = field(default=None, repr=False)


class MetricsRenderer:
    def __init__(self, naming: gpu_metrics.Naming, pod_labels: Sequence[str], pods: object) -> None:
        self._naming = naming
        self.openmetrics_offered = naming != "dcgm"
        self._options = gpu_metrics.RenderOptions(
            workload_labels=pods is not None,
            pod_labels=gpu_metrics.pod_label_columns(pod_labels),
        )
        self._current = Rendered(0, b"")
        self._installed = asyncio.Event()
        self.renders = 0  # text renders done (a burst of snapshots coalesces into few)
        self.observer: RenderObserver | None = None

    @property
    def seq(self) -> int:
        """Seq of the snapshot whose body is served now (0: none yet)."""
        return self._current.seq

    def current(self) -> Rendered:
        return self._current

    def text(self) -> bytes:
        return self._current.text

    async def openmetrics(self) -> bytes:
        rendered = self._current
        if rendered.snapshot is None:
            return EMPTY_OPENMETRICS
        task = rendered.openmetrics_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # first ask for this snapshot (or the last try failed): one render, shared
            task = asyncio.create_task(
                asyncio.to_thread(self._render, rendered.snapshot, "openmetrics")
            )
            rendered.openmetrics_task = task
        # shielded: a scraper that hangs up does not cancel the render the others wait on
        return await asyncio.shield(task)

    async def wait_rendered(self, seq: int) -> Rendered:
        """Wait until the served body is of snapshot `seq` or a newer one."""
        while self._current.seq < seq:
            await self._installed.wait()
        return self._current

    def install(self, snapshot: NodeSnapshot, text: bytes) -> bool:
        """Serve `text` as the body of `snapshot`, unless a newer snapshot is served already."""
        if snapshot.seq <= self._current.seq:
            return False
        self._current = Rendered(snapshot.seq, text, snapshot)
        installed, self._installed = self._installed, asyncio.Event()
        installed.set()
        return True

    async def render(self, snapshot: NodeSnapshot) -> bool:
        text = await asyncio.to_thread(self._render, snapshot, "text")
        self.renders += 1
        return self.install(snapshot, text)

    async def run(self, subscription: Subscription) -> None:
        # A render holds the GIL for most of a second; the loop gets it back only at each
        # switch interval, and a request needs several hand-overs. 1 ms instead of the default
        # 5 ms halves /healthz p99 during renders (benchmarks/bench_serving.py).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        async for snapshot in subscription:
            try:
                await self.render(snapshot)
            except Exception:
                # the last good body stays served; the next snapshot tries again
                _log.exception("rendering /gpu/metrics failed", extra={"seq": snapshot.seq})

    def families(self, snapshot: NodeSnapshot) -> list[Family]:
        """The /gpu/metrics families of one snapshot (the OTLP metrics push reads them too)."""
        return gpu_metrics.collect(
            snapshot.inventory,
            snapshot.samples,
            self._naming,
            snapshot.health,
            attribution=snapshot.attribution,
            options=self._options,
            processes=snapshot.processes,
            accounting=snapshot.accounting,
        )

    def _render(self, snapshot: NodeSnapshot, fmt: gpu_metrics.Format) -> bytes:
        if self.observer is not None:
            self.observer(fmt, snapshot.seq)
        return gpu_metrics.expose(self.families(snapshot), fmt)
