"""POST each batch as a JSON array (gpuid's body shape plus our fields) with aiohttp.

Connection errors, timeouts, 408, 429 and 5xx are retryable (the worker backs off, honouring
Retry-After). 401 and 403 say nothing about the batch, only about the credentials, which an
operator (or a rotated Secret) fixes: the batch is held and retried like in an outage. Any other
non-2xx status means the receiver refused the content, so the batch is set aside instead of
being sent again and again. Every request of a batch carries the same Idempotency-Key, so a
receiver can drop a batch it already stored.

The endpoint's user, password and query values, and the token, never appear in an error: a
receiver's body is scrubbed of them before it is quoted (receivers echo what they refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
import yarl

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import (
    BatchMeta,
    Exporter,
    ExporterHealth,
    excerpt,
)
from gpuid_agent.records.serialize import gpuid_shape, json_bytes, to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.redact import has_userinfo, redact_url, scrub, url_secrets
from gpuid_agent.runtime.retry import parse_retry_after

if TYPE_CHECKING:
    from gpuid_agent.runtime.config import Settings

USER_AGENT = f"gpuid-agent/{__version__}"
_GZIP_IN_THREAD = 256 * 1024  # compress bigger bodies off the event loop


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
        self.endpoint = endpoint
        self.shown_endpoint = redact_url(endpoint)
        self._url_secrets = url_secrets(endpoint)
        if has_userinfo(endpoint):
            # aiohttp sends URL credentials as Basic auth: a receiver may echo that header
            with contextlib.suppress(ValueError):
                basic = aiohttp.BasicAuth.from_url(yarl.URL(endpoint))
                if basic is not None:
                    self._url_secrets.append(basic.encode().removeprefix("Basic "))
        self.timeout = timeout
        self.gzip_body = gzip_body
        self.ca_bundle = ca_bundle
        self._tokens = TokenSource(token, token_file)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpExporter:
        return cls(
            settings.http_endpoint,
            timeout=settings.http_timeout,
            token=settings.http_auth_token.get_secret_value(),
            token_file=settings.http_auth_token_file,
            gzip_body=settings.http_gzip,
            ca_bundle=settings.http_ca_bundle,
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self.ca_bundle:
                try:
                    ssl_context = ssl.create_default_context(cafile=self.ca_bundle)
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    raise ExportError(
                        f"HTTP_CA_BUNDLE {self.ca_bundle} unusable: {exc}", error_type="tls"
                    ) from exc
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context, limit=4),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    async def _body(self, batch: Sequence[AnyRecord]) -> bytes:
        body = json_bytes([gpuid_shape(to_wire(r)) for r in batch])
        if not self.gzip_body:
            return body
        if len(body) > _GZIP_IN_THREAD:
            return await asyncio.to_thread(gzip.compress, body, 6)
        return gzip.compress(body, 6)

    def _foreign(self, text: str, token: str) -> str:
        """Text the agent did not write (a library's error, a receiver's body) made safe to
        show: the endpoint as shown, and no token or URL secret. The agent's own words never
        go through this, so a one-letter user name cannot blot them out."""
        return scrub(text.replace(self.endpoint, self.shown_endpoint), [token, *self._url_secrets])

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
        try:
            async with self._client().post(
                self.endpoint,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                allow_redirects=False,  # a redirected POST would silently become a GET
            ) as response:
                status = response.status
                if 200 <= status < 300:
                    await response.read()
                    return
                text = excerpt(self._foreign(await response.text(errors="replace"), token))
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
        except ExportError:
            raise
        except aiohttp.ClientSSLError as exc:
            raise ExportError(
                f"TLS error: {self._foreign(str(exc), token)}", error_type="tls"
            ) from None  # the cause's own text may hold the secret
        except TimeoutError as exc:
            raise ExportError(f"no answer within {self.timeout}s", error_type="timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ExportError(
                f"connection failed: {self._foreign(str(exc), token)}", error_type="connection"
            ) from None  # the cause's own text may hold the secret
        message = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        if status in (401, 403):
            # The credentials, not the batch: hold it until they work again.
            raise ExportError(
                f"authentication refused by the receiver ({message}); check HTTP_AUTH_TOKEN, "
                "HTTP_AUTH_TOKEN_FILE or the credentials in HTTP_ENDPOINT",
                error_type=f"http_{status}",
                retryable=True,
                retry_after=retry_after,
            )
        retryable = status in (408, 425, 429) or status >= 500 or 300 <= status < 400
        raise ExportError(
            message, error_type=f"http_{status}", retryable=retryable, retry_after=retry_after
        )

    async def health(self) -> ExporterHealth:
        # No probe request: an ingest endpoint need not answer GET or HEAD. The worker's
        # delivery results are this exporter's health; here only the token is checked.
        try:
            self._tokens.get()
        except ExportError as exc:
            return ExporterHealth(ok=False, reason=str(exc))
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
