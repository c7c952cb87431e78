"""The /gpu/metrics renderer: one task that renders each snapshot off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gpuid_agent.serving import gpu_metrics
from gpuid_agent.state.bus import Subscription


class MetricsRenderer:
    def __init__(self, naming: gpu_metrics.Naming, pod_labels: Sequence[str], pods: object) -> None:
        self._naming = naming
        self._options = gpu_metrics.RenderOptions(
            workload_labels=pods is not None,
            pod_labels=gpu_metrics.pod_label_columns(pod_labels),
        )
        self.rendered = gpu_metrics.EMPTY
        self.seq = 0

    def current(self) -> gpu_metrics.RenderedMetrics:
        return self.rendered

    async def run(self, subscription: Subscription) -> None:
        async for snapshot in subscription:
            self.rendered = await asyncio.to_thread(
                gpu_metrics.render,
                snapshot.inventory,
                snapshot.samples,
                self._naming,
                snapshot.health,
                attribution=snapshot.attribution,
                options=self._options,
            )
            self.seq = snapshot.seq
