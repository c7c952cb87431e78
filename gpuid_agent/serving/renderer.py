"""The /gpu/metrics renderer: a snapshot's page is rendered when it is scraped, or just before
a scrape is due; a snapshot nobody scrapes is never rendered.

A snapshot arriving only replaces the page, unrendered. The first scrape of it renders it in a
worker thread (at 1,024 pods with dcgm naming a render takes tens of milliseconds of CPU; on
the loop it would hold up every probe for that long), the scrapes that arrive meanwhile wait
on that same render, and later ones reuse its bytes. A scrape never gets a page older than the
last snapshot that arrived before it; the one exception is a text render that failed, where
the last good text page is served (and logged) and the next scrape tries again.

Waiting for a render on every scrape is avoidable: scrapers keep a steady cadence
(scrape_cadence.py learns it). A snapshot that is the last one expected before the next scrape
(the next scrape is nearer than the gap since the snapshot before) is rendered as it arrives;
any other is rendered just before that scrape is due, if no newer one came meanwhile. So a
page is rendered about once per scrape, and the scrape finds it ready.

Only some clients ask for OpenMetrics (Prometheus does by default; curl and most tools do
not), and only they get it rendered. dcgm naming is served as text only, as dcgm-exporter is:
its counters' names lack the `_total` OpenMetrics requires.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import Histogram

from gpuid_agent.runtime import log
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.exposition import Family
from gpuid_agent.serving.scrape_cadence import ScrapeCadence
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("renderer")
EMPTY: dict[gpu_metrics.Format, bytes] = {"text": b"", "openmetrics": b"# EOF\n"}
SWITCH_INTERVAL = 0.001
# how long before a scrape is due its page is rendered: this plus twice the last render's time
LEAD = 0.05

# Called in the rendering thread with the format and the snapshot's seq, before the render.
RenderObserver = Callable[[gpu_metrics.Format, int], None]


@dataclass(frozen=True, slots=True)
class Rendered:
    """A text page as served, with the snapshot it is of (None: nothing published yet)."""

    text: bytes
    snapshot: NodeSnapshot | None = None

    @property
    def seq(self) -> int:
        return 0 if self.snapshot is None else self.snapshot.seq


@dataclass(eq=False)
class Page:
    """One snapshot's bodies, each rendered once, by the first scrape (or the render ahead of
    one) that wants it, and shared by every scrape of that snapshot."""

    snapshot: NodeSnapshot | None
    renders: dict[gpu_metrics.Format, asyncio.Task[bytes]] = field(default_factory=dict)

    @property
    def seq(self) -> int:
        return 0 if self.snapshot is None else self.snapshot.seq


class MetricsRenderer:
    def __init__(
        self,
        naming: gpu_metrics.Naming,
        pod_labels: Sequence[str],
        pods: object,
        durations: Histogram | None = None,
    ) -> None:
        self._naming = naming
        self.openmetrics_offered = naming != "dcgm"
        self._options = gpu_metrics.RenderOptions(
            workload_labels=pods is not None,
            pod_labels=gpu_metrics.pod_label_columns(pod_labels),
        )
        self._durations = durations  # gpuid_gpu_metrics_render_duration_seconds, by format
        self._page = Page(None)
        self._subscription: Subscription | None = None
        self._last_good = Rendered(b"")  # the newest text page rendered
        self._took: dict[gpu_metrics.Format, float] = {}  # the last render's seconds
        self._cadence = ScrapeCadence()
        self._arrived: float | None = None  # loop time the newest snapshot arrived
        self._gap: float | None = None  # between the last two snapshots' arrivals
        self._ahead: asyncio.TimerHandle | None = None
        self.observer: RenderObserver | None = None

    @property
    def seq(self) -> int:
        """Seq of the newest snapshot arrived, rendered or not (0: none yet)."""
        return self._newest().seq

    def offer(self, snapshot: NodeSnapshot) -> None:
        """Take a new snapshot: its page is unrendered until it is scraped or a scrape is due."""
        if snapshot.seq <= self._page.seq:
            return
        self._page = Page(snapshot)
        now = asyncio.get_running_loop().time()
        if self._arrived is not None:
            self._gap = now - self._arrived
        self._arrived = now
        self._plan(now)

    async def run(self, subscription: Subscription) -> None:
        # A render holds the GIL for most of a second; the loop gets it back only at each
        # switch interval, and a request needs several hand-overs. 1 ms instead of the default
        # 5 ms halves /healthz p99 during renders (benchmarks/bench_serving.py).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self._subscription = subscription
        try:
            async for snapshot in subscription:
                self.offer(snapshot)
        finally:
            if self._ahead is not None:
                self._ahead.cancel()

    async def body(self, fmt: gpu_metrics.Format, scraper: str | None = None) -> bytes:
        """The page of the newest snapshot in `fmt`, rendered now unless it was already.
        `scraper` (the client's address) teaches the renderer when to render ahead."""
        page = self._newest()
        if scraper is not None:
            self._cadence.scraped(scraper, fmt, asyncio.get_running_loop().time())
        if fmt == "text":
            return (await self._text(page)).text
        if page.snapshot is None:
            return EMPTY[fmt]
        # shielded: a scraper that hangs up does not cancel the render the others wait on
        return await asyncio.shield(self._render_task(page, fmt))

    async def rendered(self) -> Rendered:
        """The text page a scrape would get now, with the snapshot it is of."""
        return await self._text(self._newest())

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

    async def _text(self, page: Page) -> Rendered:
        if page.snapshot is None:
            return Rendered(EMPTY["text"])
        try:
            text = await asyncio.shield(self._render_task(page, "text"))
        except Exception:
            if self._last_good.snapshot is None:
                raise
            return self._last_good
        return Rendered(text, page.snapshot)

    def _newest(self) -> Page:
        # a snapshot published since the subscription's task last ran is taken here, so a
        # scrape always sees the last one published before it
        if self._subscription is not None and (snapshot := self._subscription.take()):
            self.offer(snapshot)
        return self._page

    def _plan(self, now: float) -> None:
        """Render the new page ahead of the next scrape, if one is expected: now if no other
        snapshot is expected before it (the last gap is longer than the wait), else just
        before it is due (unless a newer snapshot re-plans first)."""
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None
        due = self._cadence.next_due(now)
        if due is None:
            return
        if self._gap is not None and due.at - now <= self._gap:
            self._render_ahead(due.format)
            return
        when = due.at - LEAD - 2 * self._took.get(due.format, 0.0)
        loop = asyncio.get_running_loop()
        self._ahead = loop.call_at(max(now, when), self._render_ahead, due.format)

    def _render_ahead(self, fmt: gpu_metrics.Format) -> None:
        self._ahead = None
        if self._page.snapshot is not None:
            self._render_task(self._page, fmt)

    def _render_task(self, page: Page, fmt: gpu_metrics.Format) -> asyncio.Task[bytes]:
        task = page.renders.get(fmt)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # the first ask for this page in this format (or the last try failed)
            assert page.snapshot is not None
            task = asyncio.create_task(self._rendered(page.snapshot, fmt))
            task.add_done_callback(_settled)
            page.renders[fmt] = task
        return task

    async def _rendered(self, snapshot: NodeSnapshot, fmt: gpu_metrics.Format) -> bytes:
        try:
            body = await asyncio.to_thread(self._render, snapshot, fmt)
        except Exception:
            _log.exception(
                "rendering /gpu/metrics failed", extra={"seq": snapshot.seq, "format": fmt}
            )
            raise
        if fmt == "text" and snapshot.seq > self._last_good.seq:
            self._last_good = Rendered(body, snapshot)
        return body

    def _render(self, snapshot: NodeSnapshot, fmt: gpu_metrics.Format) -> bytes:
        if self.observer is not None:
            self.observer(fmt, snapshot.seq)
        started = time.perf_counter()
        body = gpu_metrics.expose(self.families(snapshot), fmt)
        self._took[fmt] = took = time.perf_counter() - started
        if self._durations is not None:
            self._durations.labels(fmt).observe(took)
        return body


def _settled(task: asyncio.Task[bytes]) -> None:
    # a render made ahead may fail with no scrape awaiting it; it was logged where it failed
    if not task.cancelled():
        task.exception()
