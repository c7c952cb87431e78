"""One OTLP/HTTP endpoint: protobuf bodies, gzipped when asked, POSTed with the configured
headers through the exporters' one HTTP transport.

Per the OTLP/HTTP specification 429, 502, 503 and 504 are retryable (with Retry-After), as
are connection errors, timeouts and redirects (an endpoint to fix, not content to drop); any
other 4xx or 5xx means the receiver will never take this request. The configured header
values are credentials as a rule: the transport scrubs them from every error.
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping

from gpuid_agent.delivery.exporters.transport import HttpTransport, Refusals

PROTOBUF = "application/x-protobuf"
REFUSALS = Refusals(frozenset({429, 502, 503, 504}))  # the OTLP/HTTP specification's list


class OtlpEndpoint:
    def __init__(
        self,
        endpoint: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        compression: str = "gzip",
        ca_file: str = "",
    ) -> None:
        self.headers = dict(headers or {})
        self.gzip_body = compression == "gzip"
        self.transport = HttpTransport(
            endpoint,
            refusals=REFUSALS,
            timeout=timeout,
            ca_file=ca_file,
            secrets=list(self.headers.values()),
        )

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    @property
    def timeout(self) -> float:
        return self.transport.timeout

    @property
    def ca_file(self) -> str:
        return self.transport.ca_file

    def compress(self, raw: bytes) -> bytes:
        return gzip.compress(raw, 6) if self.gzip_body else raw

    async def post(self, body: bytes, extra_headers: Mapping[str, str] | None = None) -> bytes:
        """POST an already compressed body; the answer's body when it is protobuf (where a
        partial success is told), else b"". ExportError on failure."""
        headers = {**self.headers, **(extra_headers or {}), "Content-Type": PROTOBUF}
        if self.gzip_body:
            headers["Content-Encoding"] = "gzip"
        reply = await self.transport.post(body, headers)
        return reply.body if reply.content_type == PROTOBUF else b""

    async def close(self) -> None:
        await self.transport.close()
