"""One HTTP POST for the exporters that speak HTTP (gpuid's JSON receivers and OTLP/HTTP).

A session per endpoint (trusting an extra CA file when one is set), a POST with a timeout
that never follows a redirect (a redirected POST would silently become a GET), and every
failure turned into an `ExportError`: connection errors, timeouts and TLS errors are
retryable, and a non-2xx answer is classified by the sink's protocol (`Refusals`), with the
receiver's Retry-After. Redirects are retryable for every protocol: the endpoint is for an
operator to fix, the content is not at fault.

Text the agent did not write (a library's error, a receiver's body) is shown only with the
endpoint as `redact_url` shows it and with every secret scrubbed: the URL's user, password
and query values, the Basic credentials aiohttp derives from them, the sink's fixed header
values and a request's own (a bearer token) — receivers like to echo what they refused.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import yarl

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import excerpt
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.redact import has_userinfo, redact_url, scrub, url_secrets
from gpuid_agent.runtime.retry import parse_retry_after

USER_AGENT = f"gpuid-agent/{__version__}"


@dataclass(frozen=True, slots=True)
class Refusals:
    """How a sink's protocol reads a non-2xx answer: which statuses may heal by themselves.

    `retryable` lists them one by one; `server_errors` adds every 5xx. With `credentials`
    set, 401 and 403 are about the credentials, not the batch: the batch is held (retryable)
    and the error names the settings to check. Any other status sets the batch aside.
    """

    retryable: frozenset[int]
    server_errors: bool = False
    credentials: str = ""

    def error(self, status: int, text: str, retry_after: float | None) -> ExportError:
        """The failure a non-2xx answer means; `text` is the receiver's, already made safe."""
        message = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        if self.credentials and status in (401, 403):
            return ExportError(
                f"authentication refused by the receiver ({message}); {self.credentials}",
                error_type=f"http_{status}",
                retryable=True,
                retry_after=retry_after,
            )
        retryable = (
            status in self.retryable
            or (self.server_errors and status >= 500)
            or 300 <= status < 400
        )
        return ExportError(
            message, error_type=f"http_{status}", retryable=retryable, retry_after=retry_after
        )


@dataclass(frozen=True, slots=True)
class Reply:
    """A 2xx answer: its body and media type (OTLP tells a partial success in the body)."""

    body: bytes
    content_type: str


class HttpTransport:
    """POSTs bodies to one endpoint; `post` returns the 2xx `Reply` or raises `ExportError`."""

    def __init__(
        self,
        endpoint: str,
        *,
        refusals: Refusals,
        timeout: float,
        ca_file: str = "",
        ca_name: str = "CA file",
        secrets: Sequence[str] = (),
    ) -> None:
        self.endpoint = endpoint
        self.shown_endpoint = redact_url(endpoint)
        self.refusals = refusals
        self.timeout = timeout
        self.ca_file = ca_file
        self._ca_name = ca_name  # the setting an unusable CA file is named by
        self._secrets = [*url_secrets(endpoint), *secrets]
        if has_userinfo(endpoint):
            # aiohttp sends URL credentials as Basic auth: a receiver may echo that header
            with contextlib.suppress(ValueError):
                basic = aiohttp.BasicAuth.from_url(yarl.URL(endpoint))
                if basic is not None:
                    self._secrets.append(basic.encode().removeprefix("Basic "))
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self.ca_file:
                try:
                    ssl_context = ssl.create_default_context(cafile=self.ca_file)
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    raise ExportError(
                        f"{self._ca_name} {self.ca_file} unusable: {exc}", error_type="tls"
                    ) from exc
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context, limit=4),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    def foreign(self, text: str, secrets: Sequence[str] = ()) -> str:
        """Text the agent did not write made safe to show: the endpoint as shown, and no
        secret. The agent's own words never go through this, so a one-letter user name
        cannot blot them out."""
        shown = text.replace(self.endpoint, self.shown_endpoint)
        return scrub(shown, [*secrets, *self._secrets])

    async def post(
        self, body: bytes, headers: Mapping[str, str], *, secrets: Sequence[str] = ()
    ) -> Reply:
        """POST `body` with `headers`; `secrets` are this request's own (a bearer token)."""
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
                if 200 <= status < 300:
                    return Reply(answer, response.content_type)
                text = await response.text(errors="replace")
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
        except ExportError:
            raise
        except aiohttp.ClientSSLError as exc:
            raise ExportError(
                f"TLS error: {self.foreign(str(exc), secrets)}", error_type="tls"
            ) from None  # the cause's own text may hold a secret
        except TimeoutError as exc:
            raise ExportError(f"no answer within {self.timeout}s", error_type="timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ExportError(
                f"connection failed: {self.foreign(str(exc), secrets)}", error_type="connection"
            ) from None  # the cause's own text may hold a secret
        raise self.refusals.error(status, excerpt(self.foreign(text, secrets)), retry_after)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
