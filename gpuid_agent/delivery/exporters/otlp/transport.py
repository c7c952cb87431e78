"""One OTLP/HTTP endpoint: POST a protobuf body, read the answer, map failures to ExportError.

Per the OTLP/HTTP specification 429, 502, 503 and 504 are retryable (with Retry-After), as
are connection errors, timeouts and redirects (an endpoint to fix, not content to drop); any
other 4xx or 5xx means the receiver will never take this request.
"""

from __future__ import annotations

import gzip
import ssl
from collections.abc import Mapping

import aiohttp

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import excerpt
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.retry import parse_retry_after

PROTOBUF = "application/x-protobuf"
USER_AGENT = f"gpuid-agent/{__version__}"
RETRYABLE = frozenset({429, 502, 503, 504})  # the OTLP/HTTP specification's list


class OtlpHttp:
    def __init__(
        self,
        endpoint: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        compression: str = "gzip",
        ca_file: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.gzip_body = compression == "gzip"
        self.ca_file = ca_file
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self.ca_file:
                ssl_context = ssl.create_default_context(cafile=self.ca_file)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context, limit=4),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    def compress(self, raw: bytes) -> bytes:
        return gzip.compress(raw, 6) if self.gzip_body else raw

    async def post(self, body: bytes, extra_headers: Mapping[str, str] | None = None) -> bytes:
        """POST an already compressed body; the answer's body when it is protobuf (where a
        partial success is told), else b"". ExportError on failure."""
        headers = {**self.headers, **(extra_headers or {}), "Content-Type": PROTOBUF}
        if self.gzip_body:
            headers["Content-Encoding"] = "gzip"
        try:
            async with self._client().post(
                self.endpoint,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                allow_redirects=False,  # a redirected POST would silently become a GET
            ) as response:
                status = response.status
                answer = await response.read()
                protobuf = response.content_type == PROTOBUF
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
        except aiohttp.ClientSSLError as exc:
            raise ExportError(f"TLS error: {exc}", error_type="tls") from exc
        except TimeoutError as exc:
            raise ExportError(f"no answer within {self.timeout}s", error_type="timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ExportError(f"connection failed: {exc}", error_type="connection") from exc
        if 200 <= status < 300:
            return answer if protobuf else b""
        # The answer is a google.rpc.Status; its message is readable text inside the bytes.
        text = excerpt(answer.decode("utf-8", "replace"), *self.headers.values())
        message = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        retryable = status in RETRYABLE or 300 <= status < 400
        raise ExportError(
            message, error_type=f"http_{status}", retryable=retryable, retry_after=retry_after
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
