"""Pods on this node as the Kubernetes API describes them: UID, labels, owning workload.

A node-scoped cache: one LIST and then a WATCH of `pods?fieldSelector=spec.nodeName=<node>`,
resumed from the last resourceVersion when the watch ends and re-listed after 410 Gone. Owner
references are walked in the background (ReplicaSet → Deployment, Job → CronJob; StatefulSet
and DaemonSet own their pods directly) and cached by owner UID. `lookup` is a dict read: no
API call ever happens on behalf of a scrape. Without API access (no configuration, RBAC
forbids it) the cache says so on /status, is `ready` anyway, and attribution carries on from
the kubelet alone.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import aiohttp
import orjson
from kubernetes_asyncio import client as k8s
from prometheus_client import CollectorRegistry

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError, KubeConfigError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.sources.kube.client import request_json as _json
from gpuid_agent.sources.kube.client import status_message as _status_message

_log = log.get("pods")
COMPONENT = "kube-pods"
TOMBSTONE_SECONDS = 300.0  # a deleted pod's metadata outlives it while its containers wind down
OWNER_CACHE_SIZE = 4096
OWNER_RETRY_SECONDS = 600.0  # after a lookup was refused or failed
_HASH_SUFFIX = re.compile(r"^(?P<name>.+)-(?P<hash>[a-z0-9]{1,10})$")


@dataclass(frozen=True, slots=True)
class PodMeta:
    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    workload_kind: str = ""
    workload_name: str = ""
    # runtime container id (no "containerd://" prefix) → container name, from the status
    containers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


class PodDirectory(Protocol):
    """Pod metadata kept up to date in the background; lookups never call the API."""

    changed: asyncio.Event

    def lookup(self, namespace: str, name: str) -> PodMeta | None: ...

    def by_uid(self, uid: str) -> PodMeta | None: ...

    @property
    def ready(self) -> bool:
        """True once the first list is in (or the API is known to be out of reach)."""
        ...


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    name: str


_STATUS_LISTS = ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses")


def container_ids(status: Any) -> Mapping[str, str]:
    """Container id → name from a pod's status (`containerd://<id>`, `cri-o://<id>`, …)."""
    found: dict[str, str] = {}
    if not isinstance(status, Mapping):
        return MappingProxyType(found)
    for key in _STATUS_LISTS:
        entries = status.get(key)
        for entry in entries if isinstance(entries, list) else ():
            if not isinstance(entry, Mapping):
                continue
            name, cid = entry.get("name"), entry.get("containerID")
            if isinstance(name, str) and isinstance(cid, str) and cid:
                found[cid.rpartition("://")[2].lower()] = name
    return MappingProxyType(found)


def _controller(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    refs = [r for r in meta.get("ownerReferences") or [] if isinstance(r, Mapping)]
    for ref in refs:
        if ref.get("controller"):
            return ref
    return refs[0] if refs else None


class OwnerResolver:
    """Walks ownerReferences up to the workload, with lookups cached by owner UID."""

    def __init__(self, api: Any, *, timeout: float, metrics: AttributionMetrics) -> None:
        self._apps = k8s.AppsV1Api(api)
        self._batch = k8s.BatchV1Api(api)
        self._timeout = timeout
        self._metrics = metrics
        self._cache: OrderedDict[str, tuple[Workload, float | None]] = OrderedDict()

    async def workload(self, pod: Mapping[str, Any]) -> Workload | None:
        meta = pod.get("metadata") or {}
        ref = _controller(meta)
        if ref is None:
            return None
        kind, name = str(ref.get("kind") or ""), str(ref.get("name") or "")
        if kind not in ("ReplicaSet", "Job"):
            return Workload(kind, name)  # StatefulSet, DaemonSet, a custom controller, …
        uid = str(ref.get("uid") or f"{kind}/{meta.get('namespace')}/{name}")
        cached = self._cache.get(uid)
        if cached is not None and (cached[1] is None or cached[1] > time.monotonic()):
            self._cache.move_to_end(uid)
            self._metrics.owner_lookups.labels("cached").inc()
            return cached[0]
        namespace = str(meta.get("namespace") or "")
        found, retry_at = await self._parent(kind, name, namespace, meta.get("labels") or {})
        self._cache[uid] = (found, retry_at)
        if len(self._cache) > OWNER_CACHE_SIZE:
            self._cache.popitem(last=False)
        return found

    async def _parent(
        self, kind: str, name: str, namespace: str, labels: Mapping[str, Any]
    ) -> tuple[Workload, float | None]:
        read = (
            self._apps.read_namespaced_replica_set
            if kind == "ReplicaSet"
            else self._batch.read_namespaced_job
        )
        try:
            owner = await _json(read, name, namespace, request_timeout=self._timeout)
        except (KubeApiError, aiohttp.ClientError, TimeoutError) as exc:
            status = getattr(exc, "status", 0)
            outcome = {403: "forbidden", 404: "not_found"}.get(status, "error")
            self._metrics.owner_lookups.labels(outcome).inc()
            _log.debug("owner lookup failed", extra={"kind": kind, "error": str(exc)})
            return _inferred(kind, name, labels), time.monotonic() + OWNER_RETRY_SECONDS
        self._metrics.owner_lookups.labels("api").inc()
        parent = _controller(owner.get("metadata") or {})
        if parent is not None and parent.get("kind") in ("Deployment", "CronJob"):
            return Workload(str(parent["kind"]), str(parent.get("name") or "")), None
        return Workload(kind, name), None  # a bare ReplicaSet or Job is the workload


def _inferred(kind: str, name: str, labels: Mapping[str, Any]) -> Workload:
    """Without read access to ReplicaSets, a Deployment's is `<deployment>-<pod-template-hash>`
    and the pod carries that hash as a label: enough to name the Deployment."""
    match = _HASH_SUFFIX.match(name)
    if kind == "ReplicaSet" and match and labels.get("pod-template-hash") == match["hash"]:
        return Workload("Deployment", match["name"])
    return Workload(kind, name)


class PodCache:
    """PodDirectory over the Kubernetes API."""

    def __init__(
        self,
        node: str,
        *,
        board: StatusBoard | None = None,
        changed: asyncio.Event | None = None,
        label_allowlist: Sequence[str] = (),
        metrics: AttributionMetrics | None = None,
        mode: str = "auto",
        timeout: float = 30.0,
        watch_timeout: float = 300.0,
        backoff_max: float = 60.0,
        client_factory: Callable[..., Any] = create_kube_client,
    ) -> None:
        self.node = node
        self.board = board or StatusBoard()
        self.changed = changed or asyncio.Event()
        self.label_allowlist = tuple(label_allowlist)
        self._metrics = metrics or AttributionMetrics(CollectorRegistry(auto_describe=True))
        self.registry = self._metrics.registry
        self._mode = mode
        self._timeout = timeout
        self._watch_timeout = watch_timeout
        self._backoff_max = backoff_max
        self._client_factory = client_factory
        self._client: KubeClient | None = None
        self._owns_client = True
        self._pods: dict[tuple[str, str], PodMeta] = {}
        self._raw_owner: dict[tuple[str, str], Any] = {}
        self._deleted: dict[tuple[str, str], tuple[PodMeta, float]] = {}
        self._by_uid: dict[str, PodMeta] | None = None  # from the two above; None: rebuild
        self._ready = False
        self.resource_version: str | None = None
        self.last_error: str | None = None

    # ---- what consumers read ---------------------------------------------------------------

    def lookup(self, namespace: str, name: str) -> PodMeta | None:
        key = (namespace, name)
        found = self._pods.get(key)
        if found is None and (gone := self._deleted.get(key)) is not None:
            found = gone[0] if gone[1] > time.monotonic() else None
        return found

    def by_uid(self, uid: str) -> PodMeta | None:
        """The pod with this UID (a deleted one while its tombstone lasts); a dict read."""
        if not uid:
            return None
        index = self._by_uid
        if index is None:
            index = {m.uid: m for m, _ in self._deleted.values() if m.uid}
            index.update({m.uid: m for m in self._pods.values() if m.uid})
            self._by_uid = index
        return index.get(uid)

    @property
    def ready(self) -> bool:
        return self._ready

    def status(self) -> dict[str, Any]:
        return {
            "api": None if self._client is None else self._client.source,
            "pods": len(self._pods),
            "ready": self._ready,
            "resource_version": self.resource_version,
            "last_error": self.last_error,
        }

    # ---- lifecycle -------------------------------------------------------------------------

    async def open(self, shared: KubeClient | None = None) -> bool:
        """Use the agent's API client (`shared`, not closed here) or find one; False (and
        ready, with the reason on /status) when there is none."""
        self._owns_client = shared is None
        try:
            self._client = shared or await self._client_factory(self._mode)
        except KubeConfigError as exc:
            self.no_api(str(exc))
            return False
        if self._client is None:
            self.no_api("no Kubernetes API configuration found")
            return False
        self.board.set(COMPONENT, "starting")
        return True

    def no_api(self, reason: str) -> None:
        """Attribute from the kubelet alone (no pod UIDs, owners or labels)."""
        self.last_error = reason
        self.board.set(COMPONENT, "unavailable", f"{reason}; pods attributed from the kubelet")
        self._ready = True
        self.changed.set()

    async def close(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.close()
        self._client = None

    async def run(self) -> None:
        assert self._client is not None, "open() first"
        core = k8s.CoreV1Api(self._client.api)
        owners = OwnerResolver(
            self._client.api, timeout=min(self._timeout, 5.0), metrics=self._metrics
        )
        backoff = Backoff(base=1.0, cap=self._backoff_max)
        while True:
            try:
                if self.resource_version is None:
                    await self._relist(core, owners)
                started = time.monotonic()
                await self._watch(core, owners)
                backoff.reset()
                if time.monotonic() - started < 1.0:
                    await asyncio.sleep(1.0)  # a server ending every watch at once: no spin
            except (KubeApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if isinstance(exc, KubeApiError) and exc.status == 410:
                    _log.info("pod watch expired; listing again")
                    self.resource_version = None
                    continue
                self._failed(exc)
                await asyncio.sleep(backoff.next())

    def _failed(self, exc: Exception) -> None:
        status = getattr(exc, "status", 0)
        why = {401: "unauthorized", 403: "forbidden (RBAC: list/watch pods)"}.get(
            status, f"{type(exc).__name__}: {exc}"
        )
        self.last_error = str(exc)
        if not self._ready:
            self.no_api(why)  # do not hold the allocation trail back
        elif self.board.set(COMPONENT, "degraded", f"{why}; serving the cached pods"):
            _log.warning("pod cache degraded", extra={"error": str(exc)[:300]})

    # ---- list and watch --------------------------------------------------------------------

    def _selector(self) -> str:
        return f"spec.nodeName={self.node}"

    async def _relist(self, core: Any, owners: OwnerResolver) -> None:
        listed = await _json(
            core.list_pod_for_all_namespaces,
            field_selector=self._selector(),
            request_timeout=self._timeout,
        )
        self._metrics.pod_cache_relists.inc()
        pods: dict[tuple[str, str], PodMeta] = {}
        for raw in listed.get("items") or []:
            meta = await self._meta(raw, owners)
            if meta is not None:
                pods[(meta.namespace, meta.name)] = meta
        for key in self._pods.keys() - pods.keys():
            self._tombstone(key)
        self._pods = pods
        self._by_uid = None
        self.resource_version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
        self._metrics.pod_cache_pods.set(len(pods))
        self._ready = True
        self.last_error = None
        self.board.set(COMPONENT, "ok")
        self.changed.set()

    async def _watch(self, core: Any, owners: OwnerResolver) -> None:
        """Follow events until the server ends the watch (then resume from the last
        resourceVersion); a 410 raises KubeApiError(410) and the caller lists again."""
        resp = await core.list_pod_for_all_namespaces(
            field_selector=self._selector(),
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self._watch_timeout),
            _preload_content=False,
            _request_timeout=self._watch_timeout + self._timeout,
        )
        try:
            if not 200 <= resp.status < 300:
                raise KubeApiError(resp.status, _status_message(await resp.read()))
            while line := await resp.content.readline():
                if line.strip():
                    await self._event(orjson.loads(line), owners)
        finally:
            resp.release()

    async def _event(self, event: Mapping[str, Any], owners: OwnerResolver) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise KubeApiError(int(obj.get("code") or 0), str(obj.get("message") or ""))
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            meta = await self._meta(obj, owners)
            if meta is not None:
                key = (meta.namespace, meta.name)
                if self._pods.get(key) != meta:
                    self._pods[key] = meta
                    self._by_uid = None
                    self._deleted.pop(key, None)
                    self.changed.set()
        elif kind == "DELETED":
            meta_obj = obj.get("metadata") or {}
            key = (str(meta_obj.get("namespace") or ""), str(meta_obj.get("name") or ""))
            self._tombstone(key)
            self.changed.set()
        if rv:
            self.resource_version = str(rv)
        self.board.set(COMPONENT, "ok")
        self._metrics.pod_cache_pods.set(len(self._pods))

    def _tombstone(self, key: tuple[str, str]) -> None:
        now = time.monotonic()
        gone = self._pods.pop(key, None)
        self._by_uid = None
        self._raw_owner.pop(key, None)
        if gone is not None:
            self._deleted[key] = (gone, now + TOMBSTONE_SECONDS)
        for old in [k for k, (_, until) in self._deleted.items() if until <= now]:
            del self._deleted[old]

    async def _meta(self, raw: Mapping[str, Any], owners: OwnerResolver) -> PodMeta | None:
        meta = raw.get("metadata") or {}
        name, namespace = meta.get("name"), meta.get("namespace")
        if not isinstance(name, str) or not isinstance(namespace, str):
            return None
        raw_labels = meta.get("labels")
        labels: Mapping[str, Any] = raw_labels if isinstance(raw_labels, Mapping) else {}
        key = (namespace, name)
        ref = _controller(meta)
        previous = self._pods.get(key)
        if previous is not None and self._raw_owner.get(key) == ref:
            workload = Workload(previous.workload_kind, previous.workload_name)
        else:
            self._raw_owner[key] = ref
            workload = await owners.workload(raw) or Workload("", "")
        allowed = {
            k: str(labels[k]) for k in self.label_allowlist if isinstance(labels.get(k), str)
        }
        return PodMeta(
            namespace,
            name,
            str(meta.get("uid") or ""),
            MappingProxyType(allowed),
            workload.kind,
            workload.name,
            container_ids(raw.get("status")),
        )
