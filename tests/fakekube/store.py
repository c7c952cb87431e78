"""The fake API server's object store: one resourceVersion sequence, a bounded event history
for watch resumption, and live watchers.

Like etcd behind a real API server, every write gets the next resourceVersion; a write that
changes nothing keeps the old one and produces no event; history older than the compaction
point answers a watch with 410 Expired.
"""

from __future__ import annotations

import asyncio
import copy
import uuid as uuidlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tests.fakekube.resources import BY_API_VERSION, BY_KIND, Resource

Key = tuple[str, str, str]  # (plural, namespace, name)
Predicate = Callable[[dict[str, Any]], bool]


@dataclass(slots=True)
class Event:
    rv: int
    resource: Resource
    type: str  # ADDED / MODIFIED / DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False, slots=True)
class Watcher:
    resource: Resource
    namespace: str | None
    matches: Predicate
    bookmarks: bool = False
    # events, raw lines written as they are (hostile input), None to end the stream
    queue: asyncio.Queue[dict[str, Any] | bytes | None] = field(default_factory=asyncio.Queue)

    def offer(self, event: Event) -> None:
        # One object, whichever version it is read in (the store keeps one copy per plural)
        if (event.resource.group, event.resource.plural) != (
            self.resource.group,
            self.resource.plural,
        ):
            return
        ns = (event.new.get("metadata") or {}).get("namespace", "")
        if self.namespace is not None and ns != self.namespace:
            return
        was = event.old is not None and self.matches(event.old)
        now = event.type != "DELETED" and self.matches(event.new)
        # An object that starts or stops matching the selector is ADDED / DELETED for this
        # watcher, as the API server's watch cache does it.
        if event.type == "DELETED":
            kind = "DELETED" if self.matches(event.new) else None
        elif was and now:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif was:
            kind = "DELETED"
        else:
            kind = None
        if kind is not None:
            self.queue.put_nowait({"type": kind, "object": copy.deepcopy(event.new)})

    def close(self) -> None:
        self.queue.put_nowait(None)


class Store:
    def __init__(self, history: int = 10_000) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.rv = 1
        self.history: deque[Event] = deque(maxlen=history)
        self.compacted_rv = 0  # watches from a resourceVersion below this get 410
        self.watchers: set[Watcher] = set()

    # ---- reads ---------------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((resource.plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(
        self, resource: Resource, namespace: str | None, matches: Predicate
    ) -> list[dict[str, Any]]:
        out = [
            copy.deepcopy(obj)
            for (plural, ns, _), obj in sorted(self.objects.items())
            if plural == resource.plural and (namespace is None or ns == namespace) and matches(obj)
        ]
        return out

    def events_since(self, rv: int) -> list[Event] | None:
        """Events after `rv`, or None when history no longer reaches back that far."""
        if rv < self.compacted_rv:
            return None
        return [e for e in self.history if e.rv > rv]

    # ---- writes --------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def _record(self, resource: Resource, kind: str, old: Any, new: dict[str, Any]) -> None:
        event = Event(self.rv, resource, kind, old, copy.deepcopy(new))
        if self.history.maxlen is not None and len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(event)
        for watcher in list(self.watchers):
            watcher.offer(event)

    def create(self, obj: dict[str, Any], resource: Resource | None = None) -> dict[str, Any]:
        resource = (
            resource
            or BY_API_VERSION.get((obj.get("apiVersion", ""), obj["kind"]))
            or BY_KIND[obj["kind"]]
        )
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = meta.get("namespace", "") if resource.namespaced else ""
        if resource.namespaced:
            meta["namespace"] = ns = ns or "default"
        key = (resource.plural, ns, meta["name"])
        if key in self.objects:
            raise KeyError(key)
        obj["kind"] = resource.kind
        obj["apiVersion"] = resource.api_version
        meta.setdefault("uid", str(uuidlib.uuid4()))
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = str(self._next_rv())
        self.objects[key] = obj
        self._record(resource, "ADDED", None, obj)
        return copy.deepcopy(obj)

    def replace(self, resource: Resource, new: dict[str, Any]) -> dict[str, Any]:
        """Store `new` over the existing object (same key); no event when nothing changed."""
        meta = new["metadata"]
        key = (resource.plural, meta.get("namespace", ""), meta["name"])
        old = self.objects[key]
        new = copy.deepcopy(new)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        self.objects[key] = new
        self._record(resource, "MODIFIED", old, new)
        return copy.deepcopy(new)

    def delete(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        old = self.objects.pop((resource.plural, namespace, name), None)
        if old is None:
            return None
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record(resource, "DELETED", old, gone)
        return gone

    def compact(self) -> None:
        """Forget all history: a watch resumed from before the current resourceVersion gets
        410 Expired, as after an etcd compaction."""
        self.history.clear()
        self.compacted_rv = self.rv
