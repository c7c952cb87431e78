"""A pod's workload: its ownerReferences walked up (ReplicaSet → Deployment, Job → CronJob).

StatefulSet, DaemonSet and custom controllers own their pods directly. Lookups are cached by
owner UID; a refused or failed lookup is retried after a while and, meanwhile, a Deployment
is still named from the ReplicaSet's `pod-template-hash` suffix. Every field read here comes
from the API as JSON and is checked for its type: an odd object yields no workload, never an
exception.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.sources.kube.client import KubeClient

_log = log.get("pods")
OWNER_CACHE_SIZE = 4096
OWNER_RETRY_SECONDS = 600.0  # after a lookup was refused or failed
_HASH_SUFFIX = re.compile(r"^(?P<name>.+)-(?P<hash>[a-z0-9]{1,10})$")


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    name: str


def _text(mapping: Mapping[str, Any], key: str) -> str:
    value = mapping.get(key)
    return value if isinstance(value, str) else ""


def controller(meta: Any) -> Mapping[str, Any] | None:
    """The controlling ownerReference of an object's metadata (else its first one)."""
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    found = [r for r in refs if isinstance(r, Mapping)] if isinstance(refs, list) else []
    for ref in found:
        if ref.get("controller") is True:
            return ref
    return found[0] if found else None


class OwnerResolver:
    """Walks ownerReferences up to the workload, with lookups cached by owner UID."""

    def __init__(self, client: KubeClient, *, timeout: float, metrics: AttributionMetrics) -> None:
        self._client = client
        self._timeout = timeout
        self._metrics = metrics
        self._cache: OrderedDict[str, tuple[Workload, float | None]] = OrderedDict()

    async def workload(self, meta: Mapping[str, Any]) -> Workload | None:
        """The workload owning a pod, from the pod's metadata."""
        ref = controller(meta)
        if ref is None:
            return None
        kind, name = _text(ref, "kind"), _text(ref, "name")
        if kind not in ("ReplicaSet", "Job"):
            return Workload(kind, name)  # StatefulSet, DaemonSet, a custom controller, …
        namespace = _text(meta, "namespace")
        uid = _text(ref, "uid") or f"{kind}/{namespace}/{name}"
        cached = self._cache.get(uid)
        if cached is not None and (cached[1] is None or cached[1] > time.monotonic()):
            self._cache.move_to_end(uid)
            self._metrics.owner_lookups.labels("cached").inc()
            return cached[0]
        labels = meta.get("labels")
        found, retry_at = await self._parent(
            kind, name, namespace, labels if isinstance(labels, Mapping) else {}
        )
        self._cache[uid] = (found, retry_at)
        if len(self._cache) > OWNER_CACHE_SIZE:
            self._cache.popitem(last=False)
        return found

    async def _parent(
        self, kind: str, name: str, namespace: str, labels: Mapping[str, Any]
    ) -> tuple[Workload, float | None]:
        group, plural = ("apps/v1", "replicasets") if kind == "ReplicaSet" else ("batch/v1", "jobs")
        try:
            if not name or not namespace:
                raise KubeApiError(0, f"{kind} reference without a name or namespace")
            where = f"{quote(namespace, safe='')}/{plural}/{quote(name, safe='')}"
            path = f"/apis/{group}/namespaces/{where}"
            owner = await self._client.request_json("GET", path, within=self._timeout)
        except (KubeApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            status = getattr(exc, "status", 0)
            outcome = {403: "forbidden", 404: "not_found"}.get(status, "error")
            self._metrics.owner_lookups.labels(outcome).inc()
            _log.debug("owner lookup failed", extra={"kind": kind, "error": str(exc)[:300]})
            return _inferred(kind, name, labels), time.monotonic() + OWNER_RETRY_SECONDS
        self._metrics.owner_lookups.labels("api").inc()
        parent = controller(owner.get("metadata") if isinstance(owner, Mapping) else None)
        if parent is not None and parent.get("kind") in ("Deployment", "CronJob"):
            return Workload(_text(parent, "kind"), _text(parent, "name")), None
        return Workload(kind, name), None  # a bare ReplicaSet or Job is the workload


def _inferred(kind: str, name: str, labels: Mapping[str, Any]) -> Workload:
    """Without read access to ReplicaSets, a Deployment's is `<deployment>-<pod-template-hash>`
    and the pod carries that hash as a label: enough to name the Deployment."""
    match = _HASH_SUFFIX.match(name)
    if kind == "ReplicaSet" and match and labels.get("pod-template-hash") == match["hash"]:
        return Workload("Deployment", match["name"])
    return Workload(kind, name)
