"""Kubernetes Events on the agent's own Node (NODE_EVENTS=true; needs create and patch on
events.k8s.io events in the `default` namespace).

Health transitions (from the snapshot bus) and replaced GPUs (from the hardware watch) are
turned into Event texts at once and queued (bounded at QUEUE_LIMIT, the oldest dropped and
counted); one task writes them, so the collector never waits on the API server. What is
written and when is the ledger's: a repeat joins its Event's series (patched at most every
`patch_every` seconds), a new Event over the write budget is dropped and counted.

A write that fails for a reason time may cure (5xx, 429, timeouts, no connection) is retried
with the one backoff policy; one the API server refuses (401/403/404/422) is dropped, counted
and shown as the `node-events` component on /status, logged once with a hint. The Node's UID,
which `regarding` names, is read once, with the first Event: a quiet node costs no API call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from gpuid_agent.node.events.ledger import Decision, EventLedger
from gpuid_agent.node.events.notes import REASONS, EventText, replaced_event, transition_event
from gpuid_agent.node.events.objects import (
    NodeRef,
    event_name,
    event_object,
    events_path,
    series_patch,
)
from gpuid_agent.node.labels.policy import Failure, classify
from gpuid_agent.records.types import HardwareRecord
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.metrics import NodeEventMetrics
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import JSON, MERGE_PATCH, KubeClient, node_path
from gpuid_agent.state.health.workloads import gpu_holders
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("node_events")
COMPONENT = "node-events"
QUEUE_LIMIT = 1000
DROP_CAUSES = ("budget", "queue_full", "refused")
_NAME_TRIES = 3  # a 409 on create: the random name was taken, take another
_HINTS = {
    "forbidden": "the service account needs create and patch on events.k8s.io events in "
    "namespace default (chart value health.nodeEvents)",
    "unauthorized": "the service account token was refused",
    "not_found": "NODE_NAME must be this Node's name, and the default namespace must exist",
    "invalid": "the API server rejected the Event",
}
_RETRYABLE = (KubeApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError)


class NodeEventWriter:
    def __init__(
        self,
        node: str,
        board: StatusBoard,
        metrics: NodeEventMetrics,
        *,
        ledger: EventLedger | None = None,
        queue_limit: int = QUEUE_LIMIT,
        timeout: float = 10.0,
    ) -> None:
        self.node = node
        self._board = board
        self._metrics = metrics
        self.ledger = ledger or EventLedger()
        self._queue: deque[EventText] = deque()
        self._queue_limit = queue_limit
        self._timeout = timeout
        self._wake = asyncio.Event()
        self._client: KubeClient | None = None
        self._ref: NodeRef | None = None
        self._holding: EventText | None = None  # decided CREATE (its token taken), not written
        for reason in REASONS:  # every series at 0 from the start, for increase() and alerts
            metrics.created.labels(reason)
            metrics.repeats.labels(reason)
            for cause in DROP_CAUSES:
                metrics.dropped.labels(reason, cause)

    def open(self, client: KubeClient | None) -> bool:
        """Write through the agent's API client; False (and disabled on /status) without one."""
        self._client = client
        if client is None:
            self._board.set(COMPONENT, "disabled", "no Kubernetes API configuration found")
            return False
        self._board.set(COMPONENT, "ok")  # nothing to write yet: the API is asked nothing
        return True

    # ---- what to tell (never blocks) -----------------------------------------------------

    def offer(self, snapshot: NodeSnapshot) -> None:
        """The Events of a snapshot's health transitions."""
        gpus = snapshot.inventory.gpu_by_uuid()
        for transition in snapshot.transitions:
            gpu = gpus.get(transition.uuid) if transition.uuid else None
            text = transition_event(transition, gpu.serial if gpu else None)
            if text is not None:
                self._enqueue(text)

    def offer_replaced(self, records: Sequence[HardwareRecord], snapshot: NodeSnapshot) -> None:
        """The Events of GPUs found replaced in `snapshot` (added ones are records only)."""
        inventory = snapshot.inventory
        for record in records:
            if record.event != "replaced":
                continue
            holders = (
                gpu_holders(snapshot.attribution, inventory, record.uuid) if record.uuid else ()
            )
            self._enqueue(replaced_event(record, holders, inventory.read_time))

    def _enqueue(self, text: EventText) -> None:
        if len(self._queue) >= self._queue_limit:
            lost = self._queue.popleft()
            self._metrics.dropped.labels(lost.reason, "queue_full").inc()
            _log.debug("node event dropped: queue full", extra={"reason": lost.reason})
        self._queue.append(text)
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queue) + (self._holding is not None)

    # ---- writing -------------------------------------------------------------------------

    async def run(self) -> None:
        backoff = Backoff(base=1.0, cap=60.0)
        while True:
            try:
                await self._write_queued()
                await self._write_series()
            except _RETRYABLE as exc:
                failure = classify(exc)
                self._failed(failure)
                await asyncio.sleep(backoff.next(failure.retry_after))
                continue
            backoff.reset()
            await self._idle()

    async def _idle(self) -> None:
        self._wake.clear()
        if self._queue:
            return
        delay = self.ledger.next_due_in()
        if delay is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)

    async def _node(self) -> NodeRef:
        """The Node as `regarding` names it, read once, when the first Event is written."""
        if self._ref is None:
            client = self._api()
            node = await client.request_json("GET", node_path(self.node), within=self._timeout)
            meta = node.get("metadata") if isinstance(node, Mapping) else None
            uid = meta.get("uid") if isinstance(meta, Mapping) else None
            if not isinstance(uid, str) or not uid:
                raise ValueError("the Node has no metadata.uid")
            self._ref = NodeRef(self.node, uid)
        return self._ref

    def _api(self) -> KubeClient:
        if self._client is None:
            raise RuntimeError("the writer runs only once opened with an API client")
        return self._client

    async def _write_queued(self) -> None:
        while self._holding is not None or self._queue:
            if self._holding is None:
                text = self._queue.popleft()
                decision = self.ledger.decide(text)
                if decision is Decision.REPEAT:
                    self._metrics.repeats.labels(text.reason).inc()
                    continue
                if decision is Decision.DROP:
                    self._metrics.dropped.labels(text.reason, "budget").inc()
                    continue
                self._holding = text
            await self._create(self._holding)  # a failure time may cure raises: kept
            self._holding = None

    async def _create(self, text: EventText) -> None:
        ref = await self._node()
        for _ in range(_NAME_TRIES):
            name = event_name(self.node)
            try:
                await self._send("POST", events_path(), event_object(text, name, ref), JSON)
            except KubeApiError as exc:
                failure = classify(exc)
                if failure.retry == "now":
                    continue  # 409: the name is taken
                if failure.retry == "resync":
                    self._refused(text.reason, failure, name)
                    return
                raise
            self.ledger.created(text, name)
            self._metrics.created.labels(text.reason).inc()
            self._board.set(COMPONENT, "ok")
            return
        raise ValueError("no free Event name")

    async def _write_series(self) -> None:
        for series in self.ledger.due():
            if not self.ledger.take():
                return  # the budget is spent: the series waits for a token
            count = series.count
            try:
                await self._send(
                    "PATCH", events_path(series.name), series_patch(series), MERGE_PATCH
                )
            except KubeApiError as exc:
                failure = classify(exc)
                if exc.status == 404:  # expired or deleted: the next repeat makes a new one
                    self.ledger.forget(series)
                    continue
                if failure.retry != "resync":
                    raise
                self.ledger.patched(series, count)  # refused: these repeats stay unwritten
                self._refused(series.text.reason, failure, series.name)
                continue
            self.ledger.patched(series, count)
            self._board.set(COMPONENT, "ok")

    async def _send(self, method: str, path: str, body: Any, content_type: str) -> None:
        await self._api().request_json(
            method, path, body=body, content_type=content_type, within=self._timeout
        )

    def _refused(self, reason: str, failure: Failure, name: str) -> None:
        self._metrics.dropped.labels(reason, "refused").inc()
        # the same refusal in the same words for every Event: said once
        self._failed(failure, failure.detail.replace(f' "{name}"', ""))

    def _failed(self, failure: Failure, detail: str | None = None) -> None:
        hint = _HINTS.get(failure.reason)
        said = f"{failure.reason}: {detail or failure.detail}"
        if self._board.set(COMPONENT, "degraded", said) and hint:
            _log.warning("node events not written", extra={"node": self.node, "hint": hint})
