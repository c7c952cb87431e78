"""Keeps the current attribution: recomputed when the kubelet mapping, the pod metadata or the
inventory changes, never inside a scrape. Unattributable device ids are counted and logged
once per change of their set."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from gpuid_agent.facts import NodeInventory
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.pods import PodCache, PodDirectory
from gpuid_agent.sources.kube.resourceslices import ResourceSliceCache
from gpuid_agent.sources.kubelet import PodResourcesClient, PodResourcesSource, ResourceMatcher
from gpuid_agent.state.attribution.dra import slice_gpu_count
from gpuid_agent.state.attribution.holders import UNAVAILABLE, Attribution, Unmapped
from gpuid_agent.state.attribution.mapping import attribute, count_allocatable_gpus

_log = log.get("attribution")
_EXAMPLES = 5


@dataclass(frozen=True, slots=True)
class AttributionConfig:
    node: str
    pod_resources_timeout: float
    pod_resources_interval: float
    pod_resources_stale_after: float
    gpu_resource_names: tuple[str, ...]
    pod_label_allowlist: tuple[str, ...]
    kube_api: Literal["auto", "off"]
    dra_resource_slices: bool


def build_attributor(
    config: AttributionConfig, socket_path: str, board: StatusBoard, metrics: AttributionMetrics
) -> tuple[Attributor, PodCache | None]:
    """The kubelet poller, unless KUBE_API=off the node's pod cache, and unless
    DRA_RESOURCE_SLICES is off its ResourceSlice cache (`attributor.slices`), behind one
    Attributor; the pod cache is returned too, for the wiring to open and run."""
    source = PodResourcesSource(
        PodResourcesClient(socket_path, timeout=config.pod_resources_timeout),
        interval=config.pod_resources_interval,
        stale_after=config.pod_resources_stale_after,
        resources=ResourceMatcher(config.gpu_resource_names),
        board=board,
        metrics=metrics,
    )
    attributor = Attributor(source, label_allowlist=config.pod_label_allowlist, metrics=metrics)
    pods = None
    if config.kube_api != "off":
        pods = attributor.pods = PodCache(
            config.node,
            board=board,
            changed=attributor.changed,
            label_allowlist=config.pod_label_allowlist,
            metrics=metrics,
        )
    if config.dra_resource_slices:  # from the API, or from a simulated node's driver
        attributor.slices = ResourceSliceCache(
            config.node, board=board, changed=attributor.changed, metrics=metrics
        )
    return attributor, pods


class Attributor:
    def __init__(
        self,
        source: PodResourcesSource,
        *,
        pods: PodDirectory | None = None,
        slices: ResourceSliceCache | None = None,
        label_allowlist: Sequence[str] = (),
        metrics: AttributionMetrics | None = None,
    ) -> None:
        self.source = source
        self.pods = pods
        self.slices = slices
        self.label_allowlist = tuple(label_allowlist)
        self.current: Attribution = UNAVAILABLE
        self._unmapped: frozenset[Unmapped] = frozenset()
        self._reasons: set[str] = set()
        # One event for every input: the kubelet poller sets it, and so does the pod cache
        # (built with `changed=attributor.changed`).
        self.changed = source.changed
        self._metrics = metrics or AttributionMetrics(CollectorRegistry(auto_describe=True))
        self._inputs: tuple[object, ...] | None = None  # what `current` was computed from
        self._inventory: NodeInventory | None = None
        self._allocatable: tuple[object, NodeInventory | None, int | None] | None = None

    @property
    def pods_ready(self) -> bool:
        return self.pods is None or self.pods.ready

    def dra_gpu_count(self) -> int | None:
        """Full GPUs in the node's ResourceSlices (None while they are not followed)."""
        if self.slices is None or not self.slices.available:
            return None
        return slice_gpu_count(self.slices.devices())

    def refresh(self, inventory: NodeInventory | None) -> Attribution:
        """The attribution for `inventory`: recomputed only when it, the kubelet's snapshot,
        the pod metadata or the ResourceSlices moved since the last call."""
        snapshot = self.source.current()
        inputs = (
            snapshot,
            None if self.pods is None else self.pods.revision,
            None if self.slices is None else self.slices.revision,
        )
        if inputs == self._inputs and _same(inventory, self._inventory):
            return self.current
        attribution = attribute(
            inventory,
            snapshot,
            pods=self.pods.lookup if self.pods is not None else None,
            label_allowlist=self.label_allowlist,
            slices=self.slices.lookup if self.slices and self.slices.available else None,
        )
        self._inputs, self._inventory = inputs, inventory
        self._note(attribution)
        self.current = attribution
        return attribution

    def allocatable_gpus(self, inventory: NodeInventory | None) -> int | None:
        """count_allocatable_gpus of the kubelet's current snapshot, counted again only when
        the snapshot or the inventory moved."""
        snapshot = self.source.current()
        cached = self._allocatable
        if cached is not None and cached[0] is snapshot and _same(inventory, cached[1]):
            return cached[2]
        count = count_allocatable_gpus(snapshot, inventory)
        self._allocatable = (snapshot, inventory, count)
        return count

    def _note(self, attribution: Attribution) -> None:
        if attribution.state != "current":
            return  # keep the last counts: nothing was checked
        unmapped = frozenset(attribution.unmapped)
        self._metrics.holders.set(len({a.holder for a in attribution.allocations}))
        if unmapped == self._unmapped:
            return
        new = unmapped - self._unmapped
        self._unmapped = unmapped
        for reason, count in Tally(u.reason for u in new).items():
            self._metrics.unmapped_total.labels(reason).inc(count)
        now = Tally(u.reason for u in unmapped)
        self._reasons.update(now)
        for reason in self._reasons:
            self._metrics.unmapped_now.labels(reason).set(now.get(reason, 0))
        if new:
            examples = sorted(new, key=lambda u: (u.namespace, u.pod, u.device_id))[:_EXAMPLES]
            _log.warning(
                "kubelet device ids not attributed",
                extra={
                    "count": len(unmapped),
                    "examples": [
                        {
                            "pod": f"{u.namespace}/{u.pod}",
                            "container": u.container,
                            "resource": u.resource_name,
                            "device_id": u.device_id[:80],
                            "reason": u.reason,
                            **({"claim": u.claim[:160]} if u.claim else {}),
                        }
                        for u in examples
                    ],
                },
            )
        elif not unmapped:
            _log.info("all kubelet device ids attributed again")

    async def wait_changed(self) -> None:
        """Return once the kubelet mapping or the pod metadata changed, or on request."""
        await self.changed.wait()
        self.changed.clear()

    def status(self) -> dict[str, Any]:
        current = self.current
        return {
            "state": current.state,
            "kubelet": self.source.status(),
            "allocations": len(current.allocations),
            "holders": len({a.holder for a in current.allocations}),
            "unmapped": [
                {
                    "pod": f"{u.namespace}/{u.pod}",
                    "container": u.container,
                    "resource": u.resource_name,
                    "device_id": u.device_id[:80],
                    "reason": u.reason,
                    **({"claim": u.claim[:160]} if u.claim else {}),
                }
                for u in sorted(current.unmapped, key=lambda u: (u.namespace, u.pod))[:20]
            ],
            "pods_ready": self.pods_ready,
            "dra": self._dra_status(current),
        }

    def _dra_status(self, current: Attribution) -> dict[str, Any]:
        """Which container holds which GPU through which claim, and how it was joined."""
        claimed = [a for a in current.allocations if a.claim is not None]
        return {
            "resource_slices": None if self.slices is None else self.slices.status(),
            "allocations": len(claimed),
            "fallback": sum(1 for a in claimed if a.claim and a.claim.source == "dra-fallback"),
            "claims": [
                {
                    "pod": f"{a.holder.namespace}/{a.holder.pod}",
                    "container": a.holder.container,
                    "claim": f"{a.claim.namespace}/{a.claim.name}",
                    "device": a.device_id[:80],
                    "uuid": a.gpu_uuid,
                    "mig_uuid": a.mig_uuid,
                    "source": a.claim.source,
                }
                for a in claimed[:50]
                if a.claim is not None
            ],
        }


def _same(a: NodeInventory | None, b: NodeInventory | None) -> bool:
    """Whether two inventories attribute alike: the same GPUs (read times differ)."""
    return a is b or (a is not None and b is not None and a.gpus == b.gpus)
