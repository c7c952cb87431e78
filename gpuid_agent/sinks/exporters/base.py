"""The exporter interface every sink implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ExporterHealth:
    ok: bool
    reason: str | None = None


class Exporter(ABC):
    """Delivers batches to one sink.

    `export` raises `gpuid_agent.errors.ExportError` on failure; `retryable=False` means the
    sink rejected the batch's content and re-sending it cannot help.
    """

    name: str

    @abstractmethod
    async def export(self, batch: Sequence[Record]) -> None: ...

    async def health(self) -> ExporterHealth:
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        return None
