"""Keep the agent's own Node labelled: read it, diff against the inventory, patch only the
difference, and re-check on a resync period so drift (a label someone removed or edited) is
repaired.

Only labels matching our layout under our prefix (and our one annotation) are ever written or
removed; every other label on the Node is left exactly as it is. Patches carry the
resourceVersion that was read, so a Node changed in between is re-read instead of overwritten.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuid_agent.facts import NodeInventory
from gpuid_agent.node.labels.layout import (
    DesiredState,
    annotation_key,
    desired_state,
    is_own_label,
)
from gpuid_agent.node.labels.policy import REASONS, Failure, classify
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import LabelMetrics
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, node_path

_log = log.get("labels")
COMPONENT = "labels"
_HINTS = {
    "forbidden": "the service account needs get and patch on nodes",
    "unauthorized": "the service account token was refused",
    "not_found": "NODE_NAME must be this Node's name (downward API spec.nodeName)",
    "invalid": "the API server rejected a label or annotation value",
}
# A 403 from an admission policy is no RBAC gap: the chart's own-node policy refuses any Node
# but the one named in the pod's token, so NODE_NAME names another node.
_POLICY_HINT = "an admission policy refused the patch: NODE_NAME must be the node this pod runs on"


def _hint(failure: Failure) -> str | None:
    if failure.reason == "forbidden" and "AdmissionPolicy" in failure.detail:
        return _POLICY_HINT
    return _HINTS.get(failure.reason)


@dataclass(frozen=True, slots=True)
class LabelledNode:
    """What the labeller needs from the Node it read."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    resource_version: str | None
    provider_id: str


def labelled_node(node: Any) -> LabelledNode:
    """The fields the labeller reads from a Node's JSON; ValueError when it is not a Node."""
    meta = node.get("metadata") if isinstance(node, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ValueError("the Node reply has no metadata")
    spec = node.get("spec")
    version = meta.get("resourceVersion")
    provider_id = spec.get("providerID") if isinstance(spec, Mapping) else None
    return LabelledNode(
        labels=_strings(meta.get("labels")),
        annotations=_strings(meta.get("annotations")),
        resource_version=version if isinstance(version, str) else None,
        provider_id=provider_id if isinstance(provider_id, str) else "",
    )


def _strings(found: Any) -> dict[str, str]:
    if not isinstance(found, Mapping):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def plan_patch(node: LabelledNode, desired: DesiredState, prefix: str) -> dict[str, Any] | None:
    """The strategic-merge patch that makes `node` match `desired` (None: nothing to do).

    A `null` value removes a key. resourceVersion makes the patch fail with 409 if the Node
    changed since it was read.
    """
    labels: dict[str, str | None] = {
        k: v for k, v in desired.labels.items() if node.labels.get(k) != v
    }
    labels.update(
        {k: None for k in node.labels if is_own_label(k, prefix) and k not in desired.labels}
    )
    annotations: dict[str, str | None] = {}
    key = annotation_key(prefix)
    if desired.annotation is None:
        if key in node.annotations:
            annotations[key] = None
    elif node.annotations.get(key) != desired.annotation:
        annotations[key] = desired.annotation
    if not labels and not annotations:
        return None
    meta: dict[str, Any] = {}
    if node.resource_version:
        meta["resourceVersion"] = node.resource_version
    if labels:
        meta["labels"] = dict(sorted(labels.items()))
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta}


class NodeLabeler:
    """The reconcile loop; `offer` feeds it inventories, `run` is the supervised task."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        *,
        prefix: str,
        metrics: LabelMetrics,
        board: StatusBoard,
        mode: str = "on",
        annotation: bool = True,
        resync_interval: float = 600.0,
        startup_jitter: float = 30.0,
        debounce: float = 1.0,
        request_timeout: float = 10.0,
        backoff_base: float = 1.0,
        backoff_cap: float = 300.0,
        conflict_retries: int = 5,
        on_node: Callable[[LabelledNode], None] | None = None,
        rand: random.Random | None = None,
    ) -> None:
        self.node = node
        self.prefix = prefix
        self.metrics = metrics
        for reason in REASONS:
            metrics.errors.labels(reason)
        self.board = board
        self.dry_run = mode == "dry-run"
        self.annotation = annotation
        self.resync_interval = resync_interval
        self.startup_jitter = startup_jitter
        self.debounce = debounce
        self.request_timeout = request_timeout
        self.conflict_retries = conflict_retries
        self.on_node = on_node
        self._rand = rand or random.Random()
        self._backoff = Backoff(backoff_base, backoff_cap, self._rand)
        self._client = client
        self._desired: DesiredState | None = None
        self._changed = asyncio.Event()
        self._reported_rewrites: set[str] = set()
        self._logged_dry_run: dict[str, Any] | None = None
        self.last_failure: Failure | None = None
        board.set(COMPONENT, "starting", "waiting for the first inventory")

    # ---- input -----------------------------------------------------------------------------

    def offer(self, inventory: NodeInventory) -> None:
        """Take a new snapshot (never blocks); wakes the loop only if the labels change."""
        desired = desired_state(inventory, self.prefix, annotation=self.annotation)
        if desired == self._desired:
            return
        self._desired = desired
        self.metrics.desired.set(len(desired.labels))
        self.metrics.rewritten.set(len(desired.rewritten))
        fresh = [s for s in desired.rewritten if s not in self._reported_rewrites]
        if fresh:
            self._reported_rewrites.update(fresh)
            _log.warning(
                "serials are not valid label values; labelled with a hashed form",
                extra={"serials": [repr(s) for s in fresh]},
            )
        self._changed.set()

    @property
    def desired(self) -> DesiredState | None:
        return self._desired

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        # Spread a DaemonSet rollout over thousands of nodes instead of hitting the API at once.
        await asyncio.sleep(self._rand.uniform(0.0, self.startup_jitter))
        await self._changed.wait()
        while True:
            self._changed.clear()
            failure = await self.reconcile_once()
            if failure is None:
                self._backoff.reset()
                if await self._wait_for_change(within=self.resync_interval):
                    await asyncio.sleep(self.debounce)  # let a burst of changes settle
            elif failure.retry == "resync":
                self._backoff.reset()
                await asyncio.sleep(self.resync_interval)
            else:
                await asyncio.sleep(self._delay(failure))

    def _delay(self, failure: Failure) -> float:
        # A 429's Retry-After is a floor: never retry sooner than the server asked.
        return self._backoff.next(floor=failure.retry_after)

    async def _wait_for_change(self, *, within: float) -> bool:
        try:
            await asyncio.wait_for(self._changed.wait(), within)
        except TimeoutError:
            return False
        return True

    async def reconcile_once(self) -> Failure | None:
        """One reconciliation (conflicts re-read and retried within it); None on success."""
        desired = self._desired
        if desired is None:
            return None
        self.metrics.attempts.inc()
        for attempt in range(self.conflict_retries + 1):
            try:
                path = node_path(self.node)
                found = await self._client.request_json("GET", path, within=self.request_timeout)
                node = labelled_node(found)
                if self.on_node is not None:
                    self.on_node(node)
                patch = plan_patch(node, desired, self.prefix)
                if patch is not None and not self.dry_run:
                    await self._client.request_json(
                        "PATCH", path, body=patch, within=self.request_timeout
                    )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every API or transport failure is classified
                failure = classify(exc)
                self.metrics.errors.labels(failure.reason).inc()
                if failure.retry == "now" and attempt < self.conflict_retries:
                    continue
                if failure.retry == "now":
                    failure = Failure("conflict", "backoff", "the Node kept changing under us")
                self._failed(failure)
                return failure
            self._succeeded(patch)
            return None
        return None  # pragma: no cover - the loop always returns

    def _succeeded(self, patch: dict[str, Any] | None) -> None:
        self.last_failure = None
        self.metrics.last_success.set(time.time())
        if patch is None:
            self.metrics.in_sync.set(1)
            self.board.set(COMPONENT, "ok", "dry-run" if self.dry_run else None)
            return
        meta = patch["metadata"]
        labels = meta.get("labels", {})
        summary = {
            "set": sorted(k for k, v in labels.items() if v is not None),
            "removed": sorted(k for k, v in labels.items() if v is None),
            "annotation": "annotations" in meta,
        }
        if self.dry_run:
            self.metrics.in_sync.set(0)
            self.metrics.patches.labels("dry_run").inc()
            self.board.set(COMPONENT, "ok", "dry-run")
            shown = {k: v for k, v in meta.items() if k != "resourceVersion"}
            if shown != self._logged_dry_run:
                self._logged_dry_run = shown
                _log.info(
                    "dry-run: would patch node",
                    extra={"node": self.node, "patch": {"metadata": shown}},
                )
            return
        self.metrics.in_sync.set(1)
        self.metrics.patches.labels("applied").inc()
        self.board.set(COMPONENT, "ok")
        _log.info("node labels patched", extra={"node": self.node, **summary})

    def _failed(self, failure: Failure) -> None:
        self.last_failure = failure
        self.metrics.in_sync.set(0)
        reason = f"{failure.reason}: {failure.detail}"
        hint = _hint(failure)
        if self.board.set(COMPONENT, "degraded", reason) and hint:
            _log.warning(
                "labelling retried at the next resync",
                extra={
                    "node": self.node,
                    "hint": hint,
                    "resync_seconds": self.resync_interval,
                },
            )
