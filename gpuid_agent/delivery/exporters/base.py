"""The exporter interface every sink implements, and helpers they share.

Exporters take typed records (`gpuid_agent.records.types.AnyRecord`) and turn them into bytes
only through the one serializer, `gpuid_agent.records.serialize`."""

from __future__ import annotations

import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from gpuid_agent.records.types import AnyRecord

if TYPE_CHECKING:
    from gpuid_agent.runtime.metrics import AgentMetrics

EXCERPT_CHARS = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
ExporterState = Literal["ok", "degraded", "unavailable"]


@dataclass(frozen=True, slots=True)
class BatchMeta:
    """Identity of one batch; it lives in the spool, so retries and restarts reuse it."""

    batch_id: str
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    @classmethod
    def new(cls) -> BatchMeta:
        return cls(uuid.uuid4().hex)


@dataclass(frozen=True, slots=True)
class ExporterHealth:
    """`ok` False with `losing` False: failing but holding its records (degraded);
    `losing` True: failing and dropping records (unavailable). `reason` stays the same words
    while the same things are wrong; `figures` holds the counts that move meanwhile."""

    ok: bool
    reason: str | None = None
    losing: bool = False
    figures: Mapping[str, int] = field(default_factory=dict)

    @property
    def state(self) -> ExporterState:
        if self.ok:
            return "ok"
        return "unavailable" if self.losing else "degraded"


@dataclass(frozen=True, slots=True)
class StoredForm:
    """An exporter's own spool format. Its disk spool keeps each batch as `encode(records)`
    (run off the event loop) in a file ending `.<suffix>`, and the sender hands consecutive
    such batches back joined — up to `max_records` records and `max_bytes` bytes — to one
    `export_stored` call, so a backlog drains in a few large deliveries whatever BATCH_SIZE was."""

    suffix: str
    encode: Callable[[list[AnyRecord]], bytes]
    max_records: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class JoinLimits:
    """How much of a backlog one `export` call may carry: consecutive stored batches kept as
    records (JSON-lines spool files, or batches held in memory) go out joined as one batch, up
    to `max_records` records and `max_bytes` bytes of stored batches. The request is the
    exporter's usual one, only larger."""

    max_records: int
    max_bytes: int


class Exporter(ABC):
    """Delivers batches to one sink.

    `export` raises `gpuid_agent.runtime.errors.ExportError` on failure; `retryable=False` means the
    sink rejected the batch's content and re-sending it cannot help. `meta` identifies the
    batch (idempotency keys, object names); exporters make one up when called without it.
    """

    name: str
    stored_form: StoredForm | None = None
    joins: JoinLimits | None = None  # None: every stored batch is its own delivery

    @abstractmethod
    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None: ...

    async def export_stored(self, payloads: Sequence[bytes], meta: BatchMeta) -> None:
        """Deliver batches kept in `stored_form`, as one delivery (exporters with a form)."""
        raise NotImplementedError(f"{self.name} has no stored form")

    async def health(self) -> ExporterHealth:
        return ExporterHealth(ok=True)

    def bind_metrics(self, metrics: AgentMetrics) -> None:
        """Called once by the worker that drives this exporter, for counts only the sink's
        answers tell (OTLP partial success, rows a foreign UNIQUE constraint discarded); most
        exporters have none."""
        return None

    async def close(self) -> None:
        return None


def excerpt(text: str, *secrets: str) -> str:
    """A short single-line piece of a response body, safe to log."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    text = _CONTROL.sub(" ", text).strip()
    return text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else "")
