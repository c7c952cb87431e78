"""Pods on this node as the Kubernetes API describes them: UID, labels, owning workload.

A node-scoped cache: one LIST and then a WATCH of `pods?fieldSelector=spec.nodeName=<node>`,
resumed from the last resourceVersion when the watch ends and re-listed after 410 Gone. Owner
references are walked in the background (ReplicaSet → Deployment, Job → CronJob; StatefulSet
and DaemonSet own their pods directly) and cached by owner UID. `lookup` is a dict read: no
API call ever happens on behalf of a scrape. Without API access (no configuration, RBAC
forbids it) the cache says so on /status, is `ready` anyway, and attribution carries on from
the kubelet alone. Malformed list items and watch events are counted
(`gpuid_pod_cache_malformed_total`), logged (once a minute per reason) and skipped; a list
reply that is no PodList leaves the cached pods in place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient
from gpuid_agent.sources.kube.list_watch import ListWatch, api_given, failure_reason, list_version
from gpuid_agent.sources.kube.owners import OwnerResolver, Workload, controller

_log = log.get("pods")
COMPONENT = "kube-pods"
TOMBSTONE_SECONDS = 300.0  # a deleted pod's metadata outlives it while its containers wind down


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

    @property
    def revision(self) -> object:
        """Equal between two reads only if `lookup` answers the same in between (attribution
        is recomputed when it moves)."""
        ...


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
        timeout: float = 30.0,
        watch_timeout: float = 300.0,
        backoff_max: float = 60.0,
    ) -> None:
        self.node = node
        self.board = board or StatusBoard()
        self.changed = changed or asyncio.Event()
        self.label_allowlist = tuple(label_allowlist)
        self._metrics = metrics or AttributionMetrics(CollectorRegistry(auto_describe=True))
        self.registry = self._metrics.registry
        self._timeout = timeout
        self._client: KubeClient | None = None
        self._owners: OwnerResolver | None = None
        self._follow = ListWatch(
            "pod",
            node,
            self,
            logger=_log,
            timeout=timeout,
            watch_timeout=watch_timeout,
            backoff_max=backoff_max,
        )
        self._pods: dict[tuple[str, str], PodMeta] = {}
        self._raw_owner: dict[tuple[str, str], Any] = {}
        self._deleted: dict[tuple[str, str], tuple[PodMeta, float]] = {}
        self._by_uid: dict[str, PodMeta] | None = None  # from the two above; None: rebuild
        self._ready = False
        self._changes = 0
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

    @property
    def revision(self) -> object:
        # a tombstone that runs out changes `lookup` with no event: count the live ones
        now = time.monotonic()
        live = sum(1 for _, until in self._deleted.values() if until > now)
        return (self._changes, live)

    def _changed(self) -> None:
        self._changes += 1
        self.changed.set()

    @property
    def resource_version(self) -> str | None:
        """Where the watch resumes; None until listed (or while a list is due)."""
        return self._follow.resource_version

    def status(self) -> dict[str, Any]:
        return {
            "api": None if self._client is None else self._client.source,
            "pods": len(self._pods),
            "ready": self._ready,
            "resource_version": self.resource_version,
            "last_error": self.last_error,
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self, shared: KubeClient | None) -> bool:
        """Use the agent's API client; without one the cache is ready anyway, with the reason
        on /status."""
        self._client = shared
        return api_given(shared, self.board, COMPONENT, self.no_api)

    def no_api(self, reason: str) -> None:
        """Attribute from the kubelet alone (no pod UIDs, owners or labels)."""
        self.last_error = reason
        self.board.set(COMPONENT, "unavailable", f"{reason}; pods attributed from the kubelet")
        self._ready = True
        self._changed()

    async def run(self) -> None:
        assert self._client is not None, "open() first"
        self._owners = OwnerResolver(
            self._client, timeout=min(self._timeout, 5.0), metrics=self._metrics
        )
        await self._follow.run()

    # ---- what the list+watch loop hands over -----------------------------------------------

    async def relist(self, lister: ListWatch) -> str:
        assert self._client is not None
        listed = await lister.list(self._client, "/api/v1/pods")
        self._metrics.pod_cache_relists.inc()
        items = listed.get("items") if isinstance(listed, Mapping) else None
        if not isinstance(items, list):
            # Not a PodList: keep serving the cached pods rather than take it for "no pods".
            raise KubeApiError(0, "the pod list reply is not a PodList")
        pods: dict[tuple[str, str], PodMeta] = {}
        for raw in items:
            meta = await self._meta(raw)
            if meta is None:
                lister.skipped("pod list item without a name and namespace")
            else:
                pods[(meta.namespace, meta.name)] = meta
        for key in self._pods.keys() - pods.keys():
            self._tombstone(key)
        self._pods = pods
        self._by_uid = None
        self._metrics.pod_cache_pods.set(len(pods))
        self._ready = True
        self.last_error = None
        self.board.set(COMPONENT, "ok")
        self._changed()
        return list_version(listed)

    async def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            gone = _key(obj.get("metadata"))
            if gone is None:
                self._follow.skipped("pod DELETED event without a name and namespace")
            else:
                self._tombstone(gone)
                self._changed()
            return
        meta = await self._meta(obj)
        if meta is None:
            self._follow.skipped(f"pod {kind} event without a name and namespace")
        elif self._pods.get(key := (meta.namespace, meta.name)) != meta:
            self._pods[key] = meta
            self._by_uid = None
            self._deleted.pop(key, None)
            self._changed()

    def synced(self) -> None:
        self.board.set(COMPONENT, "ok")
        self._metrics.pod_cache_pods.set(len(self._pods))

    def failed(self, exc: Exception) -> None:
        why = failure_reason(exc, "pods")
        self.last_error = str(exc)
        if not self._ready:
            self.no_api(why)  # do not hold the allocation trail back
        elif self.board.set(COMPONENT, "degraded", f"{why}; serving the cached pods"):
            _log.warning("pod cache degraded", extra={"error": str(exc)[:300]})

    def malformed(self, what: str) -> None:
        self._metrics.pod_cache_malformed.inc()

    def _tombstone(self, key: tuple[str, str]) -> None:
        now = time.monotonic()
        gone = self._pods.pop(key, None)
        self._by_uid = None
        self._raw_owner.pop(key, None)
        if gone is not None:
            self._deleted[key] = (gone, now + TOMBSTONE_SECONDS)
        for old in [k for k, (_, until) in self._deleted.items() if until <= now]:
            del self._deleted[old]

    async def _meta(self, raw: Any) -> PodMeta | None:
        """A pod's metadata as the cache keeps it; None when it names no pod."""
        meta = raw.get("metadata") if isinstance(raw, Mapping) else None
        key = _key(meta)
        if key is None:
            return None
        assert isinstance(meta, Mapping)
        raw_labels = meta.get("labels")
        labels: Mapping[str, Any] = raw_labels if isinstance(raw_labels, Mapping) else {}
        ref = controller(meta)
        previous = self._pods.get(key)
        if previous is not None and self._raw_owner.get(key) == ref:
            workload = Workload(previous.workload_kind, previous.workload_name)
        else:
            self._raw_owner[key] = ref
            assert self._owners is not None, "run() first"
            workload = await self._owners.workload(meta) or Workload("", "")
        allowed = {
            k: str(labels[k]) for k in self.label_allowlist if isinstance(labels.get(k), str)
        }
        uid = meta.get("uid")
        return PodMeta(
            key[0],
            key[1],
            uid if isinstance(uid, str) else "",
            MappingProxyType(allowed),
            workload.kind,
            workload.name,
            container_ids(raw.get("status")),
        )


def _key(meta: Any) -> tuple[str, str] | None:
    """(namespace, name) of an object's metadata; None unless both are non-empty strings."""
    if not isinstance(meta, Mapping):
        return None
    namespace, name = meta.get("namespace"), meta.get("name")
    if isinstance(namespace, str) and isinstance(name, str) and namespace and name:
        return namespace, name
    return None
