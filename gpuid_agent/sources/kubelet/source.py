"""Polling the kubelet for which containers hold which GPU devices.

`List` is asked every interval in the background; consumers read the last good snapshot
through `current()`, never the kubelet. Staleness rule: after a failed poll the last good
snapshot is still served for `stale_after` seconds (a kubelet restart should not make every
GPU look idle for a moment), then `current()` returns None until the kubelet answers again,
so a mapping that can no longer be checked is not presented as current forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import PodResourcesError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.retry import backoff_delay
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.claims import ClaimAssignment, claims_from
from gpuid_agent.sources.kubelet.client import PodResourcesClient
from gpuid_agent.sources.kubelet.devices import ResourceMatcher

_log = log.get("podresources")
COMPONENT = "pod-resources"


@dataclass(frozen=True, slots=True)
class DeviceAssignment:
    """One device id assigned to one container, as the kubelet reports it."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_id: str


@dataclass(frozen=True, slots=True)
class PodResourcesSnapshot:
    """GPU devices assigned to containers (device plugins) and consumed through DRA claims;
    `allocatable` is None when the kubelet lacks it."""

    assignments: tuple[DeviceAssignment, ...]
    allocatable: tuple[tuple[str, str], ...] | None = None
    pods: int = 0
    claims: tuple[ClaimAssignment, ...] = ()
    # Drivers of DRA devices seen but not GPUs (ignored; not part of equality)
    ignored_drivers: frozenset[str] = field(default=frozenset(), compare=False)


def snapshot_from(
    response: Any, matches: ResourceMatcher, allocatable: Any = None
) -> PodResourcesSnapshot:
    """Keep the devices of GPU resources from a List (and GetAllocatableResources) response."""
    # One walk, each field read once: on protobuf messages every read builds a Python object.
    found: set[tuple[str, str, str, str, str]] = set()
    claimed: list[tuple[str, str, str, Any]] = []
    for pod in response.pod_resources:
        namespace, name = pod.namespace, pod.name
        for container in pod.containers:
            container_name = container.name
            for devices in container.devices:
                resource = devices.resource_name
                if matches(resource):
                    for dev_id in devices.device_ids:
                        found.add((namespace, name, container_name, resource, dev_id))
            if dynamic := container.dynamic_resources:
                claimed.append((namespace, name, container_name, dynamic))
    free = None
    if allocatable is not None:
        free = tuple(
            sorted(
                (devices.resource_name, dev_id)
                for devices in allocatable.devices
                if matches(devices.resource_name)
                for dev_id in devices.device_ids
            )
        )
    claims, ignored = claims_from(claimed)
    return PodResourcesSnapshot(
        assignments=tuple(DeviceAssignment(*a) for a in sorted(found)),  # in field order
        allocatable=free,
        pods=len(response.pod_resources),
        claims=claims,
        ignored_drivers=ignored,
    )


class PodResourcesSource:
    """Owns the poll loop and the last good snapshot; `changed` is set when `current()` moves."""

    def __init__(
        self,
        client: PodResourcesClient,
        *,
        interval: float,
        stale_after: float,
        resources: ResourceMatcher | None = None,
        board: StatusBoard | None = None,
        metrics: AttributionMetrics | None = None,
        backoff_max: float = 10.0,
        allocatable_every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.interval = interval
        self.stale_after = stale_after
        self.resources = resources or ResourceMatcher()
        self.board = board or StatusBoard()
        self.backoff_max = max(backoff_max, interval)
        self.allocatable_every = allocatable_every
        self._clock = clock
        self._metrics = metrics or AttributionMetrics(CollectorRegistry(auto_describe=True))
        self.registry = self._metrics.registry
        self.snapshot: PodResourcesSnapshot | None = None
        self.last_success: float | None = None
        self.last_success_at: datetime | None = None
        self.failure: PodResourcesError | None = None
        self.allocatable_supported: bool | None = None
        self._allocatable: Any = None
        self._allocatable_at: float | None = None
        self._allocatable_of = 0  # the client's `restarts` when it was read: whose it is
        self._stale = False
        self._ignored_drivers: set[str] = set()
        self._last_parse: tuple[bytes, Any, PodResourcesSnapshot] | None = None
        self.changed = asyncio.Event()
        self.polled = asyncio.Event()  # set after the first poll, whatever its outcome
        self.board.set(COMPONENT, "starting")

    # ---- what consumers read ---------------------------------------------------------------

    def current(self) -> PodResourcesSnapshot | None:
        """The last good snapshot while it is fresh enough to serve; None otherwise."""
        if self.snapshot is None or self._is_stale():
            return None
        return self.snapshot

    def age(self) -> float | None:
        return None if self.last_success is None else self._clock() - self.last_success

    def _is_stale(self) -> bool:
        age = self.age()
        return age is None or (self.failure is not None and age > self.stale_after)

    def status(self) -> dict[str, Any]:
        snapshot = self.snapshot
        return {
            "socket": self.client.socket_path,
            "last_success": self.last_success_at,
            "stale": self._stale,
            "last_error": None if self.failure is None else str(self.failure),
            "pods": None if snapshot is None else snapshot.pods,
            "gpu_devices_assigned": None if snapshot is None else len(snapshot.assignments),
            "dra_devices_claimed": None if snapshot is None else len(snapshot.claims),
            "allocatable_supported": self.allocatable_supported,
            "gpu_devices_allocatable": None
            if snapshot is None or snapshot.allocatable is None
            else len(snapshot.allocatable),
        }

    # ---- polling ---------------------------------------------------------------------------

    async def poll_once(self) -> bool:
        try:
            answer = await self.client.list_bytes()
            allocatable = await self._read_allocatable()
            snapshot = self._parsed(answer, allocatable)
        except PodResourcesError as exc:
            self._failed(exc)
            return False
        self._note_ignored(snapshot.ignored_drivers)
        recovered = self.failure is not None
        self.failure = None
        self.last_success = self._clock()
        self.last_success_at = datetime.now(UTC)
        self._metrics.pod_resources_polls.labels("ok").inc()
        self._metrics.pod_resources_up.set(1)
        self._metrics.pod_resources_last_success.set(time.time())
        self._set_stale(False)
        self.board.set(COMPONENT, "ok")
        if recovered:
            _log.info("kubelet pod-resources answering again")
        if snapshot != self.snapshot:
            self.snapshot = snapshot
            self.changed.set()
        self.polled.set()
        return True

    def _parsed(self, answer: bytes, allocatable: Any) -> PodResourcesSnapshot:
        """The snapshot of a List answer; the last one again when the kubelet sent the same
        bytes and the allocatable devices were not read again (most polls)."""
        last = self._last_parse
        if last is not None and last[0] == answer and last[1] is allocatable:
            return last[2]
        try:
            response = wire.parse_list(answer)
        except wire.WireError as exc:
            raise PodResourcesError("rpc_error", "kubelet List answer not parsable") from exc
        snapshot = snapshot_from(response, self.resources, allocatable)
        self._last_parse = (answer, allocatable, snapshot)
        return snapshot

    def _note_ignored(self, drivers: frozenset[str]) -> None:
        """Other DRA drivers' devices are not GPUs: said once per driver, at debug."""
        for driver in sorted(drivers - self._ignored_drivers):
            if len(self._ignored_drivers) >= 64:
                break
            self._ignored_drivers.add(driver)
            _log.debug("DRA devices of a non-GPU driver ignored", extra={"driver": driver})

    async def _read_allocatable(self) -> Any:
        """GetAllocatableResources now and then, and at once from a restarted kubelet (it may
        have other devices, or be a newer version); kubelets before 1.21 lack it (asked once
        per kubelet)."""
        if self.client.restarts != self._allocatable_of:
            self._allocatable_of = self.client.restarts
            self._allocatable_at = None
            if self.allocatable_supported is not None:
                _log.info("kubelet restarted; reading its allocatable devices again")
            self.allocatable_supported = None
        if self.allocatable_supported is False:
            return None
        now = self._clock()
        if self._allocatable_at is not None and now - self._allocatable_at < self.allocatable_every:
            return self._allocatable
        try:
            self._allocatable = await self.client.allocatable()
        except PodResourcesError as exc:
            if exc.reason != "unimplemented":
                raise
            self.allocatable_supported = False
            _log.info("kubelet has no GetAllocatableResources; using List only")
            return None
        self.allocatable_supported = True
        self._allocatable_at = now
        return self._allocatable

    def _failed(self, exc: PodResourcesError) -> None:
        self.failure = exc
        self._allocatable_at = None
        self._metrics.pod_resources_polls.labels(exc.reason).inc()
        self._metrics.pod_resources_up.set(0)
        self._refresh_state()
        self.polled.set()

    def _refresh_state(self) -> None:
        """Board state from the failure and staleness; reasons are stable so each change is
        logged once, not once per poll."""
        exc = self.failure
        if exc is None:
            return
        why = _describe(exc, self.client)
        if self.snapshot is None:
            self.board.set(COMPONENT, "unavailable", f"{why}; no attribution yet")
        elif self._is_stale():
            self._set_stale(True)
            self.board.set(COMPONENT, "unavailable", f"{why}; mapping stale, not served")
        else:
            self.board.set(COMPONENT, "degraded", f"{why}; serving the last good mapping")

    def _set_stale(self, stale: bool) -> None:
        if stale != self._stale:
            self._stale = stale
            self._metrics.pod_resources_stale.set(1 if stale else 0)
            self.changed.set()

    def _next_delay(self, failures: int) -> float:
        if not failures:
            return self.interval
        return backoff_delay(failures, self.interval, self.backoff_max)

    async def _sleep(self, delay: float) -> None:
        """Sleep, waking once on the way if the served mapping turns stale meanwhile."""
        age = self.age()
        if self.failure is not None and not self._stale and age is not None:
            until_stale = self.stale_after - age
            if 0 <= until_stale < delay:
                await asyncio.sleep(until_stale + 1e-3)
                self._refresh_state()
                delay -= until_stale
        await asyncio.sleep(delay)

    async def run(self) -> None:
        failures = 0
        try:
            while True:
                failures = 0 if await self.poll_once() else failures + 1
                await self._sleep(self._next_delay(failures))
        finally:
            await self.client.close()


def _describe(exc: PodResourcesError, client: PodResourcesClient) -> str:
    texts = {
        "socket_missing": f"socket {client.socket_path} missing",
        "unavailable": "kubelet not answering (UNAVAILABLE)",
        "deadline_exceeded": f"kubelet gave no answer within {client.timeout:g}s",
        "permission_denied": "kubelet refused access (PERMISSION_DENIED)",
    }
    return texts.get(exc.reason, f"kubelet call failed ({exc.reason})")
