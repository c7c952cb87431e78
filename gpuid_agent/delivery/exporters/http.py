"""POST each batch as a JSON array (gpuid's body shape plus our fields) with aiohttp.

Connection errors, timeouts, redirects, 408, 425, 429 and 5xx are retryable (the worker backs
off, honouring Retry-After). 401 and 403 say nothing about the batch, only about the
credentials, which an operator (or a rotated Secret) fixes: the batch is held and retried like
in an outage. Any other non-2xx status means the receiver refused the content, so the batch is
set aside instead of being sent again and again. Every request of a batch carries the same
Idempotency-Key, so a receiver can drop a batch it already stored.

The endpoint's user, password and query values, and the token, never appear in an error: the
shared `transport` scrubs a receiver's body of them before it is quoted (receivers echo what
they refused).
"""

from __future__ import annotations

import asyncio
import gzip
import os
from collections.abc import Sequence

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth, JoinLimits
from gpuid_agent.delivery.exporters.transport import HttpTransport, Refusals
from gpuid_agent.records.serialize import gpuid_shape, json_bytes, to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError

_GZIP_IN_THREAD = 256 * 1024  # compress bigger bodies off the event loop
# gpuid's receivers: a request timeout, too early, throttling and any server error may heal.
REFUSALS = Refusals(
    frozenset({408, 425, 429}),
    server_errors=True,
    credentials="check HTTP_AUTH_TOKEN, HTTP_AUTH_TOKEN_FILE or the credentials in HTTP_ENDPOINT",
)


class TokenSource:
    """The bearer token: fixed, or read from a file and re-read whenever the file changes
    (a rotated Kubernetes Secret is swapped in by a symlink, which changes what stat sees)."""

    def __init__(self, token: str = "", path: str = "") -> None:
        self._fixed = token.strip()
        self._path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""

    def get(self) -> str:
        if not self._path:
            return self._fixed
        try:
            st = os.stat(self._path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._seen:
                with open(self._path, encoding="utf-8", errors="replace") as fh:
                    self._token = fh.read().strip()
                self._seen = key
        except OSError as exc:
            raise ExportError(
                f"token file {self._path} unreadable: {exc.strerror}", error_type="auth"
            ) from exc
        return self._token


class HttpExporter(Exporter):
    name = "http"
    # A backlog goes out up to 1,000 records a request; 768 KiB of spooled JSON lines make a
    # body under 1 MiB, the smallest limit common receivers set (aiohttp's default).
    joins = JoinLimits(1_000, 768 * 1024)

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 30.0,
        token: str = "",
        token_file: str = "",
        gzip_body: bool = False,
        ca_bundle: str = "",
    ) -> None:
        self.transport = HttpTransport(
            endpoint,
            refusals=REFUSALS,
            timeout=timeout,
            ca_file=ca_bundle,
            ca_name="HTTP_CA_BUNDLE",
        )
        self.gzip_body = gzip_body
        self._tokens = TokenSource(token, token_file)

    async def _body(self, batch: Sequence[AnyRecord]) -> bytes:
        body = json_bytes([gpuid_shape(to_wire(r)) for r in batch])
        if not self.gzip_body:
            return body
        if len(body) > _GZIP_IN_THREAD:
            return await asyncio.to_thread(gzip.compress, body, 6)
        return gzip.compress(body, 6)

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        meta = meta or BatchMeta.new()
        await self._post(batch, meta, self._tokens.get())

    async def _post(self, batch: Sequence[AnyRecord], meta: BatchMeta, token: str) -> None:
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": meta.batch_id,
            "X-Records-Count": str(len(batch)),
            "X-Batch-Created": meta.created.isoformat(),
        }
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if self.gzip_body:
            headers["Content-Encoding"] = "gzip"
        body = await self._body(batch)
        await self.transport.post(body, headers, secrets=[token])

    async def health(self) -> ExporterHealth:
        # No probe request: an ingest endpoint need not answer GET or HEAD. The worker's
        # delivery results are this exporter's health; here only the token is checked.
        try:
            self._tokens.get()
        except ExportError as exc:
            return ExporterHealth(ok=False, reason=str(exc))
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        await self.transport.close()
