"""The agent's one Kubernetes API client: kubernetes_asyncio's configuration and auth
(in-cluster config, else a kubeconfig, else none: the agent then runs without the API) with a
thin request path of its own that reads every answer as JSON.

kubernetes_asyncio is imported only when a client is made (sources/kube/library.py: its
configuration, loaders and ApiClient, not its generated API and model classes). The kubeconfig
path is read from the environment when called (kubernetes_asyncio reads KUBECONFIG once at
import), and each client gets its own Configuration instead of the library's process-wide
default, so several agents in one process do not share credentials. Every request is reported
to an observer (verb, resource, code) so the load one agent puts on the API server is visible
in its metrics.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson
from prometheus_client import Counter

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import KubeApiError, KubeConfigError
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube import library

_log = log.get("kube")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
Observer = Callable[[str, str, str], None]  # (verb, resource, code)
Query = Sequence[tuple[str, Any]]
# A dict patch is merged the way kubectl's default patch merges it (lists by their merge key).
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"  # a whole object, as a create sends it


def describe_request(method: str, url: str, query: Any = None) -> tuple[str, str]:
    """(verb, resource) of a request URL the way the API server names them:
    GET /api/v1/nodes/n1 → (get, nodes); GET …/pods?watch=true → (watch, pods)."""
    parts = [p for p in urlsplit(url).path.split("/") if p]
    if parts[:1] == ["api"]:
        parts = parts[2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    else:
        return method.lower(), "other"
    if len(parts) >= 3 and parts[0] == "namespaces":
        parts = parts[2:]
    if not parts:
        return method.lower(), "other"
    resource = parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")
    named = len(parts) > 1
    if method == "GET":
        watching = any(k == "watch" and str(v).lower() in ("true", "1") for k, v in query or ())
        verb = "get" if named else ("watch" if watching else "list")
    else:
        verb = {"PATCH": "patch", "PUT": "update", "POST": "create", "DELETE": "delete"}.get(
            method, method.lower()
        )
    return verb, resource


# Far above any object the API server stores (etcd refuses requests over 1.5 MiB by default).
WATCH_LINE_LIMIT = 16 * 1024 * 1024


async def watch_lines(content: Any, limit: int = WATCH_LINE_LIMIT) -> AsyncIterator[bytes | None]:
    """The lines of a watch stream (`resp.content`); None stands for a line over `limit`
    bytes, which is dropped as it arrives rather than buffered. Reading chunks instead of
    `readline` keeps a large object (a pod with big annotations) from ending the watch."""
    buffer = bytearray()
    dropping = False  # within a line already over the limit
    async for chunk in content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = None if dropping or end > limit else bytes(buffer[:end])
            dropping = False
            del buffer[: end + 1]
            yield line
        if len(buffer) > limit:
            dropping = True
            buffer.clear()
    if dropping or buffer:
        yield None if dropping or len(buffer) > limit else bytes(buffer)


async def watch_events(
    resp: Any, what: str, malformed: Callable[[str], None]
) -> AsyncGenerator[Any, None]:
    """The decoded events of a watch response (use under `contextlib.aclosing`: closing
    releases the response). A non-2xx answer raises KubeApiError; a line over the size limit
    or not JSON is reported to `malformed` and skipped, so one bad line never ends a watch."""
    try:
        if not 200 <= resp.status < 300:
            raise KubeApiError(resp.status, status_message(await resp.read()))
        async for line in watch_lines(resp.content):
            if line is None:
                malformed(f"{what} watch line over the size limit")
                continue
            if not line.strip():
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                malformed(f"{what} watch line is not JSON")
                continue
            yield event
    finally:
        resp.release()


def _status(body: bytes) -> tuple[str, str]:
    """(reason, message) of a Status error body; ("", its first bytes) when it is none."""
    try:
        status = orjson.loads(body)
        return str(status.get("reason") or ""), str(status.get("message") or "")[:300]
    except (orjson.JSONDecodeError, AttributeError):
        return "", body[:200].decode("utf-8", "replace")


def status_message(body: bytes) -> str:
    """`reason: message` of a Status error body (or its first bytes when it is none)."""
    reason, message = _status(body)
    return f"{reason}: {message[:200]}" if reason or message else ""


def api_error(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> KubeApiError:
    """The error for a non-2xx answer: its code, Status message and Retry-After."""
    reason, message = _status(body)
    return KubeApiError(
        status,
        f"{reason}: {message[:200]}",
        detail=message or reason,
        retry_after=(headers or {}).get("Retry-After"),
    )


WARNINGS_REMEMBERED = 64  # distinct warning texts logged once each; past that, no more logged


def warning_texts(headers: Any) -> list[str]:
    """The texts of an answer's `Warning` headers (`299 - "text"`, RFC 7234), as the API
    server sends them for deprecated APIs and for admission policies in Warn mode."""
    found = headers.getall("Warning", []) if hasattr(headers, "getall") else []
    texts = []
    for value in map(str, found):
        code, _, rest = value.partition(" ")
        _agent, _, quoted = rest.partition(" ")
        text = quoted.strip().removeprefix('"').removesuffix('"') if code.isdigit() else value
        texts.append(text.replace('\\"', '"')[:500])
    return texts


def request_counter(counter: Counter) -> Observer:
    """An observer counting requests in `counter` (AgentMetrics.kube_api_requests)."""

    def observe(verb: str, resource: str, code: str) -> None:
        counter.labels(verb, resource, code).inc()

    return observe


@dataclass(slots=True)
class KubeClient:
    """An ApiClient (its configuration and auth), where that configuration came from
    ("in-cluster" or the file paths), and the agent's requests through it."""

    api: Any  # kubernetes_asyncio ApiClient
    source: str
    observer: Observer | None = None
    warned: set[str] = field(default_factory=set)

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    def observe(self, observer: Observer | None) -> None:
        self.observer = observer

    async def send(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = STRATEGIC_MERGE_PATCH,
        within: float,
    ) -> Any:
        """One request, answered with the unread response (any status; release it). A dict
        `body` is sent as `content_type`, a strategic-merge patch unless told otherwise."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        code = "error"
        try:
            resp = await self.api.call_api(
                path,
                method,
                query_params=list(query),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=within,
            )
            code = str(resp.status)
            self._log_warnings(method, path, query, resp.headers)
            return resp
        except TimeoutError:
            code = "timeout"
            raise
        except (aiohttp.ClientError, OSError):
            code = "connection"
            raise
        finally:
            if self.observer is not None:
                self.observer(*describe_request(method, path, query), code)

    def _log_warnings(self, method: str, path: str, query: Query, headers: Any) -> None:
        """Log each distinct warning the API server returns once: a Warn-mode admission policy
        answers every resync the same way, and one line says it."""
        for text in warning_texts(headers):
            if text in self.warned or len(self.warned) >= WARNINGS_REMEMBERED:
                continue
            self.warned.add(text)
            verb, resource = describe_request(method, path, query)
            _log.warning(
                "the API server warned about a request",
                extra={"verb": verb, "resource": resource, "warning": text},
            )

    async def request_json(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = STRATEGIC_MERGE_PATCH,
        within: float,
    ) -> Any:
        """One request answered as parsed JSON; a non-2xx answer raises KubeApiError (no model
        deserialization: the callers read a few fields and must survive odd objects)."""
        resp = await self.send(
            method, path, query=query, body=body, content_type=content_type, within=within
        )
        try:
            data = await resp.read()
        finally:
            resp.release()
        if not 200 <= resp.status < 300:
            raise api_error(resp.status, data, resp.headers)
        return orjson.loads(data)

    async def close(self) -> None:
        await self.api.close()


def _safe_reason(exc: BaseException) -> str:
    """Why a configuration failed, without echoing its content: kubernetes_asyncio's messages
    name whole kubeconfig entries (tokens included) and YAML errors quote the offending line."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        problem = str(getattr(exc, "problem", "") or "syntax error")[:100]
        return f"not valid YAML ({problem} at line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, library.load().ConfigException):
        return str(exc).split(" in ", 1)[0][:200]
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or ''}".rstrip(": ")
    return type(exc).__name__


def _kubeconfig_paths(environ: Mapping[str, str]) -> list[str]:
    listed = environ.get("KUBECONFIG", "")
    if listed:
        return [p for p in listed.split(os.pathsep) if p]
    home = environ.get("HOME") or str(Path.home())
    return [str(Path(home) / ".kube" / "config")]


def _in_cluster_available(environ: Mapping[str, str], sa_dir: str) -> bool:
    return bool(
        environ.get("KUBERNETES_SERVICE_HOST")
        and environ.get("KUBERNETES_SERVICE_PORT")
        and Path(sa_dir, "token").is_file()
    )


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if Path(p).is_file()]


async def create_kube_client(
    mode: str = "auto",
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    observer: Observer | None = None,
) -> KubeClient | None:
    """The client to use, or None when KUBE_API=off or no configuration exists at all.

    Raises KubeConfigError when configuration exists but is unusable, so the operator sees
    why instead of the agent silently running without the API.
    """
    if mode == "off":
        return None
    env = os.environ if environ is None else environ
    if _in_cluster_available(env, service_account_dir):
        kube = library.load()
        configuration = kube.Configuration()
        try:
            loader = kube.InClusterConfigLoader(
                token_filename=str(Path(service_account_dir, "token")),
                cert_filename=str(Path(service_account_dir, "ca.crt")),
                environ=dict(env),
            )
            loader.load_and_set(configuration)
            api = kube.ApiClient(configuration=configuration)
        except Exception as exc:  # config errors, unreadable files, a bad CA bundle
            raise KubeConfigError(
                f"in-cluster configuration unusable: {_safe_reason(exc)}"
            ) from exc
        return KubeClient(api, "in-cluster", observer)
    paths = _existing(_kubeconfig_paths(env))
    if not paths:
        return None
    kube = library.load()
    configuration = kube.Configuration()
    try:
        await kube.load_kube_config(
            config_file=os.pathsep.join(paths),
            client_configuration=configuration,
            persist_config=False,
        )
        api = kube.ApiClient(configuration=configuration)
    except Exception as exc:  # a malformed file surfaces as yaml, key, type or value errors
        raise KubeConfigError(
            f"kubeconfig {', '.join(paths)} unusable: {_safe_reason(exc)}"
        ) from exc
    _log.debug("kube client from kubeconfig", extra={"paths": paths})
    return KubeClient(api, ", ".join(paths), observer)


def node_path(node: str) -> str:
    """The API path of a Node (its name quoted as one path segment)."""
    return f"/api/v1/nodes/{quote(node, safe='')}"


async def read_provider_id(kube: KubeClient, node: str, *, within: float) -> str | None:
    """The Node's spec.providerID ("" when it has none); None when the Node cannot be read
    now (the reason is logged at debug: the labeller reports API trouble)."""
    try:
        found = await asyncio.wait_for(
            kube.request_json("GET", node_path(node), within=within), within
        )
    except (KubeApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        _log.debug("node not readable for its providerID", extra={"error": str(exc)[:200]})
        return None
    spec = found.get("spec") if isinstance(found, Mapping) else None
    provider_id = spec.get("providerID") if isinstance(spec, Mapping) else None
    return provider_id if isinstance(provider_id, str) else ""


async def open_shared_client(
    mode: str, *, observer: Observer, board: StatusBoard
) -> KubeClient | None:
    """The agent's one API client, shared by the labeller, the pod cache and the Node
    conditions writer, every request counted by `observer`; None without a usable API (an
    unusable configuration is shown on the status board as `kube_api`)."""
    try:
        kube = await create_kube_client(mode, observer=observer)
    except KubeConfigError as exc:
        board.set("kube_api", "unavailable", str(exc))
        return None
    if kube is not None:
        board.set("kube_api", "ok", kube.source)
    return kube
