"""Pods on this node as the Kubernetes API describes them: UID, labels, owning workload."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PodMeta:
    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    workload_kind: str = ""
    workload_name: str = ""


class PodDirectory(Protocol):
    """Pod metadata kept up to date in the background; lookups never call the API."""

    changed: asyncio.Event

    def lookup(self, namespace: str, name: str) -> PodMeta | None: ...

    @property
    def ready(self) -> bool:
        """True once the first list is in (or the API is known to be out of reach)."""
        ...
