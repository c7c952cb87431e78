"""This node's DRA ResourceSlices: which GPU (UUID) each DRA device of a GPU driver is.

A node-scoped list+watch of `resourceslices?fieldSelector=spec.nodeName=<node>` over the
agent's one API client, in whichever version of resource.k8s.io the server serves (v1 from
Kubernetes 1.34, v1beta2 and v1beta1 before; the first that answers is kept). NVIDIA's driver
publishes each GPU and each MIG device it has created with attributes `uuid` (and
`parentUUID` for MIG), so a MIG device the driver creates while the agent runs appears as a
watch event and is joined at once. `lookup` is a dict read: no API call on behalf of a scrape.

Without the API (no configuration, RBAC forbids it, no resource.k8s.io) the cache says so on
/status and `available` is False: attribution then falls back to the node-local mapping of
full GPUs and marks it as such.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient
from gpuid_agent.sources.kube.list_watch import (
    ListWatch,
    api_given,
    failure_reason,
    list_version,
)
from gpuid_agent.sources.kubelet.claims import GPU_DRIVERS

_log = log.get("resourceslices")
COMPONENT = "kube-resourceslices"
# Newest first: the first version the server serves is used.
VERSIONS = ("v1", "v1beta2", "v1beta1")


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device of a ResourceSlice and the GPU identity its attributes give."""

    driver: str
    pool: str
    name: str
    uuid: str | None = None
    parent_uuid: str | None = None


SliceKey = tuple[str, str, str]  # (driver, pool, device)


def _attribute(attributes: Mapping[str, Any], driver: str, name: str) -> str | None:
    """A string attribute, named bare or qualified with the driver's domain."""
    value = attributes.get(name)
    if value is None:
        value = attributes.get(f"{driver}/{name}")
    if isinstance(value, Mapping):
        text = value.get("string")
        if isinstance(text, str) and 0 < len(text) <= 128:
            return text
    return None


def slice_devices(obj: Mapping[str, Any]) -> tuple[int, list[SliceDevice]]:
    """(pool generation, GPU driver devices) of one ResourceSlice in any served version:
    v1 and v1beta2 list attributes on the device, v1beta1 under `basic`."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return 0, []
    driver = spec.get("driver")
    pool = spec.get("pool")
    if not isinstance(driver, str) or driver not in GPU_DRIVERS or not isinstance(pool, Mapping):
        return 0, []
    pool_name = pool.get("name")
    generation = pool.get("generation")
    if not isinstance(pool_name, str):
        return 0, []
    devices: list[SliceDevice] = []
    for raw in spec.get("devices") or []:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
            continue
        basic = raw.get("basic")
        body: Mapping[str, Any] = basic if isinstance(basic, Mapping) else raw
        attributes = body.get("attributes")
        if not isinstance(attributes, Mapping):
            attributes = {}
        devices.append(
            SliceDevice(
                driver,
                pool_name,
                raw["name"],
                _attribute(attributes, driver, "uuid"),
                _attribute(attributes, driver, "parentUUID"),
            )
        )
    return (generation if isinstance(generation, int) else 0), devices


class ResourceSliceCache:
    """The node's GPU DRA devices, kept by a list+watch; `changed` is set on every change."""

    def __init__(
        self,
        node: str,
        *,
        board: StatusBoard | None = None,
        changed: asyncio.Event | None = None,
        timeout: float = 30.0,
        watch_timeout: float = 300.0,
        backoff_max: float = 60.0,
        versions: Collection[str] | None = None,
        metrics: AttributionMetrics | None = None,
    ) -> None:
        self.node = node
        self._metrics = metrics
        self.board = board or StatusBoard()
        self.changed = changed or asyncio.Event()
        self._versions = tuple(v for v in VERSIONS if versions is None or v in versions)
        self._client: KubeClient | None = None
        self._path: str | None = None  # the collection of the version served
        self._follow = ListWatch(
            "resourceslice",
            node,
            self,
            logger=_log,
            timeout=timeout,
            watch_timeout=watch_timeout,
            backoff_max=backoff_max,
        )
        # slice name → (driver, pool, generation, devices)
        self._slices: dict[str, tuple[str, str, int, list[SliceDevice]]] = {}
        self._index: dict[SliceKey, SliceDevice] = {}
        self._available = False
        self.version: str | None = None
        self._origin: str | None = None  # slices not from the API (a simulated node)
        self.last_error: str | None = None
        self._changes = 0
        self._malformed = 0  # watch lines and events skipped (ListWatch logs them)

    # ---- what consumers read ---------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True while the slices are listed and followed: a device missing from them is not
        (yet) published by its driver."""
        return self._available

    def lookup(self, driver: str, pool: str, device: str) -> SliceDevice | None:
        return self._index.get((driver, pool, device))

    @property
    def revision(self) -> int:
        """Moves whenever `available` or a `lookup` answer may have changed."""
        return self._changes

    def devices(self) -> tuple[SliceDevice, ...]:
        """Every device of the pools' newest generations."""
        return tuple(self._index.values())

    def status(self) -> dict[str, Any]:
        return {
            "available": self._available,
            "version": None if self.version is None else f"resource.k8s.io/{self.version}",
            **({"from": self._origin} if self._origin else {}),
            "slices": len(self._slices),
            "devices": len(self._index),
            "with_uuid": sum(1 for d in self._index.values() if d.uuid),
            "resource_version": self._follow.resource_version,
            "malformed": self._malformed,
            "last_error": self.last_error,
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self, shared: KubeClient | None) -> bool:
        """Use the agent's API client (never closed here); False without one."""
        self._client = shared
        return api_given(shared, self.board, COMPONENT, self.no_api)

    def no_api(self, reason: str) -> None:
        self.last_error = reason
        self._set_available(False)
        self.board.set(COMPONENT, "unavailable", f"{reason}; DRA GPUs mapped node-locally")

    def load(self, items: list[dict[str, Any]], origin: str) -> None:
        """Use slices the node itself provides (a simulated node) instead of the API."""
        self.version, self._origin = None, origin
        self._replace(items, origin)

    async def run(self) -> None:
        assert self._client is not None, "open() first"
        await self._follow.run()

    # ---- what the list+watch loop hands over -----------------------------------------------

    async def relist(self, lister: ListWatch) -> str | None:
        """List through the version found before, or find the first one served."""
        if self._path is not None:
            assert self._client is not None
            listed = await lister.list(self._client, self._path)
        elif (listed := await self._discover(lister)) is None:
            return None
        items = listed.get("items") if isinstance(listed, Mapping) else None
        self._replace(items, f"resource.k8s.io/{self.version}")
        return list_version(listed)

    async def _discover(self, lister: ListWatch) -> Any:
        """The list reply of the first served version (then kept); None when none is."""
        assert self._client is not None
        for version in self._versions:
            path = f"/apis/resource.k8s.io/{version}/resourceslices"
            try:
                listed = await lister.list(self._client, path)
            except KubeApiError as exc:
                if exc.status == 404:
                    continue
                raise
            self.version, self._path = version, path
            _log.info("resourceslices followed", extra={"version": f"resource.k8s.io/{version}"})
            return listed
        self.version = None
        self.no_api("resource.k8s.io ResourceSlices not served")
        return None

    async def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind != "DELETED":
            self._store(obj)
            self._reindex()
            return
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if self._slices.pop(str(name or ""), None):
            self._reindex()

    def synced(self) -> None:
        self._set_available(True)
        self.board.set(COMPONENT, "ok", f"resource.k8s.io/{self.version}")

    def failed(self, exc: Exception) -> None:
        status = getattr(exc, "status", 0)
        if status == 404:
            self._path = None  # the version went away: find the one served now
        why = failure_reason(exc, "resourceslices")
        self.last_error = str(exc)[:300]
        if status in (401, 403, 404) or not self._available:
            if self.board.set(COMPONENT, "unavailable", f"{why}; DRA GPUs mapped node-locally"):
                _log.warning("resourceslices unavailable", extra={"error": self.last_error})
            self._set_available(False)
        elif self.board.set(COMPONENT, "degraded", f"{why}; serving the cached slices"):
            _log.warning("resourceslice cache degraded", extra={"error": self.last_error})

    def malformed(self, what: str) -> None:
        self._malformed += 1
        if self._metrics is not None:
            self._metrics.resource_slices_malformed.inc()

    def _set_available(self, available: bool) -> None:
        if available != self._available:
            self._available = available
            self._changes += 1
            self.changed.set()

    def _replace(self, items: Any, source: str) -> None:
        """All the node's slices at once (a list's items; odd ones are passed over)."""
        self._slices = {}
        for raw in items if isinstance(items, list) else []:
            if isinstance(raw, Mapping):
                self._store(raw)
        self.last_error = None
        self._reindex()
        self._set_available(True)
        self.board.set(COMPONENT, "ok", source)

    def _store(self, raw: Mapping[str, Any]) -> None:
        meta = raw.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(name, str):
            return
        generation, devices = slice_devices(raw)
        if devices:
            first = devices[0]
            self._slices[name] = (first.driver, first.pool, generation, devices)
        else:
            self._slices.pop(name, None)

    def _reindex(self) -> None:
        """Only a pool's newest generation counts: older slices are being replaced."""
        newest: dict[tuple[str, str], int] = {}
        for driver, pool, generation, _ in self._slices.values():
            key = (driver, pool)
            newest[key] = max(generation, newest.get(key, generation))
        index = {
            (d.driver, d.pool, d.name): d
            for driver, pool, generation, devices in self._slices.values()
            if generation == newest[(driver, pool)]
            for d in devices
        }
        if index != self._index:
            self._index = index
            self._changes += 1
            self.changed.set()
