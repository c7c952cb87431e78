"""An aiohttp fake of the Kubernetes API server for tests, on a loopback port.

It speaks the wire protocol the real client (kubernetes_asyncio) speaks: typed paths under
/api/v1 and /apis/<group>/<version>, JSON objects with metadata.resourceVersion and uid, LIST
with fieldSelector/labelSelector/limit/continue, WATCH as a stream of JSON lines with
resourceVersion resumption and 410 Expired, PATCH in the three patch formats with optimistic
concurrency, and `Status` error bodies (a ResourceSlice device name that is no DNS label gets
the real server's 422, to the word: tests/test_realkube_dra_names.py compares them). Faults
(any status, Retry-After, stalls, hangs, dropped connections, a watch answered with a list) are
injected for the next N matching requests, and every request is logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import re
import secrets
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.fakekube import patch as patching
from tests.fakekube.resources import (
    BY_KIND,
    BY_PATH,
    RESOURCE_VERSIONS,
    Resource,
    invalid,
    validate_metadata,
    validate_spec,
)
from tests.fakekube.selectors import SelectorError, field_selector, label_selector
from tests.fakekube.store import Store, Watcher

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def free_port() -> int:
    """A loopback port nothing listens on (for an API server that is started later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def status_body(
    code: int,
    message: str,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


class StatusError(Exception):
    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.body = status_body(code, message, reason, details)
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.code, headers=self.headers)


@dataclass(slots=True)
class Fault:
    """Answer the next `times` requests matching method/verb/path this way instead.

    status: an HTTP status answered with a real Status body (None: answer normally after
    the stall). retry_after: seconds in Retry-After (and details.retryAfterSeconds).
    delay: stall this long before answering. hang: never answer (until the server stops).
    drop: close the connection without an answer. path: exact path, or a compiled regex.
    body: answer 200 with these bytes as they are (a malformed reply).
    as_list: answer a watch with the list, as a server that ignores `watch=true` would.
    """

    status: int | None = None
    method: str | None = None
    verb: str | None = None
    path: str | re.Pattern[str] | None = None
    times: int = 1
    retry_after: float | None = None
    delay: float = 0.0
    hang: bool = False
    drop: bool = False
    reason: str | None = None
    message: str | None = None
    body: bytes | None = None
    as_list: bool = False
    hits: int = 0

    def matches(self, method: str, verb: str, path: str) -> bool:
        if self.times <= 0:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        if self.verb is not None and self.verb != verb:
            return False
        if isinstance(self.path, re.Pattern):
            return self.path.search(path) is not None
        return self.path is None or self.path == path


@dataclass(slots=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    verb: str
    content_type: str
    body: Any = None
    status: int = 0  # 0: no answer (hung, dropped, or not answered yet)
    authorization: bool = False
    at: float = 0.0  # time.monotonic() when it arrived


@dataclass(slots=True)
class _Target:
    resource: Resource
    namespace: str | None  # None: all namespaces (or a cluster-scoped resource list)
    name: str | None
    subresource: str | None


def _parse_path(path: str) -> _Target | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    resource = BY_PATH.get((group, version, rest[0]))
    if resource is None or (namespace is not None and not resource.namespaced):
        return None
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and sub != "status":
        return None
    return _Target(resource, namespace, name, sub)


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return (value or "") in ("1", "t", "T", "TRUE", "true", "True")


def _verb(method: str, target: _Target | None, query: dict[str, str]) -> str:
    if method == "GET":
        if target is not None and target.name is None:
            return "watch" if _flag(query.get("watch")) else "list"
        return "get"
    return {
        "PATCH": "patch",
        "PUT": "update",
        "POST": "create",
        "DELETE": "delete" if target is None or target.name else "deletecollection",
    }.get(method, method.lower())


def _check_spec(resource: Resource, obj: dict[str, Any]) -> None:
    """The API server's 422 for what it validates in a spec (ResourceSlice device names)."""
    causes = validate_spec(resource, obj)
    if causes:
        message, details = invalid(resource, str((obj.get("metadata") or {}).get("name")), causes)
        raise StatusError(422, message, details=details)


def _strip_item(obj: dict[str, Any]) -> dict[str, Any]:
    obj.pop("kind", None)
    obj.pop("apiVersion", None)
    return obj


class FakeKube:
    """The fake API server. `async with FakeKube() as kube:` starts it on 127.0.0.1."""

    def __init__(
        self,
        *,
        port: int = 0,
        token: str | None = None,
        history: int = 10_000,
        user: str = "system:serviceaccount:gpuid:gpuid-agent",
        resource_versions: tuple[str, ...] = RESOURCE_VERSIONS,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = "127.0.0.1"
        self.ssl_context = ssl_context  # HTTPS, as a real API server serves
        # the resource.k8s.io versions served (older clusters: v1beta1 only; () none at all)
        self.resource_versions = resource_versions
        self.port = port
        self.token = token
        self.user = user
        self.store = Store(history)
        self.faults: list[Fault] = []
        self.requests: list[RequestRecord] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self._streams: set[Watcher] = set()

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> FakeKube:
        """Start serving (again, on the same port after a stop: objects are kept)."""
        if self._runner is not None:
            return self
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(
            runner, self.host, self.port, reuse_address=True, ssl_context=self.ssl_context
        )
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1])
        self._runner = runner
        return self

    async def stop(self) -> None:
        """Stop serving: open watches end, hung requests are released, the port closes."""
        if self._runner is None:
            return
        self._stopping.set()
        self.close_watches()
        runner, self._runner = self._runner, None
        await runner.cleanup()

    async def __aenter__(self) -> FakeKube:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- objects (what a test sets up or inspects) ------------------------------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as another client would; StatusError for a spec the API server
        refuses, so test data cannot hold what no real cluster would."""
        _check_spec(BY_KIND[obj["kind"]], obj)
        return self.store.create(obj)

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        provider_id: str | None = None,
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {}
        if provider_id is not None:
            spec["providerID"] = provider_id
        return self.store.create(
            {
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": dict(labels or {}),
                    "annotations": dict(annotations or {}),
                },
                "spec": spec,
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
        )

    def get(self, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        resource = BY_KIND[kind]
        return self.store.get(resource, namespace if resource.namespaced else "", name)

    def node(self, name: str) -> dict[str, Any]:
        found = self.get("Node", name)
        if found is None:
            raise KeyError(name)
        return found

    def node_labels(self, name: str) -> dict[str, str]:
        return dict(self.node(name)["metadata"].get("labels") or {})

    def update(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a changed object as another client would (bumps resourceVersion, emits)."""
        _check_spec(BY_KIND[obj["kind"]], obj)
        return self.store.replace(BY_KIND[obj["kind"]], obj)

    def patch(
        self,
        kind: str,
        name: str,
        body: Any,
        *,
        namespace: str = "",
        content_type: str = patching.MERGE_PATCH,
    ) -> dict[str, Any]:
        """Patch an object as another client would (for drift in tests)."""
        resource = BY_KIND[kind]
        current = self.store.get(resource, namespace, name)
        if current is None:
            raise KeyError(name)
        patched = patching.apply(content_type, current, body)
        _check_spec(resource, patched)
        return self.store.replace(resource, patched)

    def delete(self, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        resource = BY_KIND[kind]
        return self.store.delete(resource, namespace if resource.namespaced else "", name)

    # ---- faults, watches, the request log ------------------------------------------------------

    def inject(
        self,
        status: int | None = None,
        *,
        method: str | None = None,
        verb: str | None = None,
        path: str | re.Pattern[str] | None = None,
        times: int = 1,
        retry_after: float | None = None,
        delay: float = 0.0,
        hang: bool = False,
        drop: bool = False,
        reason: str | None = None,
        message: str | None = None,
        body: bytes | None = None,
        as_list: bool = False,
    ) -> Fault:
        fault = Fault(
            status=status,
            method=method,
            verb=verb,
            path=path,
            times=times,
            retry_after=retry_after,
            delay=delay,
            hang=hang,
            drop=drop,
            reason=reason,
            message=message,
            body=body,
            as_list=as_list,
        )
        self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    def count(
        self,
        verb: str | None = None,
        *,
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
    ) -> int:
        return sum(
            1
            for r in self.requests
            if (verb is None or r.verb == verb)
            and (method is None or r.method == method.upper())
            and (path is None or r.path == path)
            and (status is None or r.status == status)
        )

    def close_watches(self) -> None:
        """End every open watch stream cleanly (as the API server's watch timeout does)."""
        for watcher in list(self._streams):
            watcher.close()

    def expire_watches(self, *, compact: bool = True) -> None:
        """Send 410 Expired to every open watch; with compact, resuming from any older
        resourceVersion is refused too (the client must re-list)."""
        if compact:
            self.store.compact()
        for watcher in list(self._streams):
            watcher.queue.put_nowait({"type": "ERROR", "object": self._expired(self.store.rv - 1)})
            watcher.close()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current resourceVersion to watches that allow them."""
        for watcher in list(self._streams):
            if watcher.bookmarks:
                watcher.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": watcher.resource.kind,
                            "apiVersion": watcher.resource.api_version,
                            "metadata": {"resourceVersion": str(self.store.rv)},
                        },
                    }
                )

    def send_raw(self, line: bytes, plural: str | None = None) -> int:
        """Write `line` (and a newline) as it is to open watches of `plural` (all: None),
        as a broken or hostile server would; returns how many watches got it."""
        sent = 0
        for watcher in list(self._streams):
            if plural is None or watcher.resource.plural == plural:
                watcher.queue.put_nowait(line)
                sent += 1
        return sent

    @property
    def open_watches(self) -> int:
        return len(self._streams)

    def _expired(self, rv: int) -> dict[str, Any]:
        return status_body(
            410, f"too old resource version: {rv} ({self.store.compacted_rv})", "Expired"
        )

    # ---- HTTP -------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        target = _parse_path(request.path)
        verb = _verb(request.method, target, query)
        record = RequestRecord(
            method=request.method,
            path=request.path,
            query=query,
            verb=verb,
            content_type=request.headers.get("Content-Type", ""),
            authorization="Authorization" in request.headers,
            at=time.monotonic(),
        )
        self.requests.append(record)
        try:
            if request.can_read_body:
                raw = await request.read()
                try:
                    record.body = json.loads(raw) if raw else None
                except ValueError:
                    raise StatusError(400, "the request body is not JSON") from None
            response = await self._answer(request, record, target)
        except StatusError as exc:
            response = exc.response()
        record.status = 0 if record.status < 0 else response.status
        return response

    async def _fault(self, record: RequestRecord, target: _Target | None) -> Fault | None:
        fault = next(
            (f for f in self.faults if f.matches(record.method, record.verb, record.path)), None
        )
        if fault is None:
            return None
        fault.times -= 1
        fault.hits += 1
        if fault.hang or fault.delay:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._stopping.wait(), timeout=None if fault.hang else fault.delay
                )
        return fault

    async def _answer(
        self, request: web.Request, record: RequestRecord, target: _Target | None
    ) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != (
            f"Bearer {self.token}"
        ):
            raise StatusError(401, "Unauthorized")
        fault = await self._fault(record, target)
        if fault is not None and (fault.drop or fault.hang or self._stopping.is_set()):
            if request.transport is not None:
                request.transport.abort()
            record.status = -1
            return web.Response(status=499)
        if fault is not None and fault.body is not None:
            return web.Response(body=fault.body, content_type="application/json")
        if fault is not None and fault.status is not None:
            if fault.status == 410 and record.verb == "watch":
                return await self._stream_error(request, self._expired(self.store.rv - 1))
            raise self._fault_error(fault, record, target)
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"})
        if target is None or (
            target.resource.group == "resource.k8s.io"
            and target.resource.version not in self.resource_versions
        ):
            raise StatusError(404, "the server could not find the requested resource")
        verb = "list" if fault is not None and fault.as_list else record.verb
        handler = {
            "get": self._get,
            "list": self._list,
            "watch": self._watch,
            "patch": self._patch,
            "update": self._update,
            "create": self._create,
            "delete": self._delete,
        }.get(verb)
        if handler is None:
            raise StatusError(
                405, "the server does not allow this method on the requested resource"
            )
        return await handler(request, record, target)

    def _fault_error(
        self, fault: Fault, record: RequestRecord, target: _Target | None
    ) -> StatusError:
        code = fault.status or 500
        what = f'{target.resource.plural} "{target.name}"' if target and target.name else "resource"
        default = {
            403: f'{what} is forbidden: User "{self.user}" cannot {record.verb} resource '
            f'"{target.resource.plural if target else ""}" in API group '
            f'"{target.resource.group if target else ""}" at the cluster scope',
            404: f"{what} not found",
            409: f"Operation cannot be fulfilled on {what}: the object has been modified; "
            "please apply your changes to the latest version and try again",
            422: f"{what} is invalid",
            429: "Too many requests, please try again later.",
            500: "Internal error occurred: injected",
            503: "the server is currently unable to handle the request",
        }.get(code, f"injected {code}")
        details: dict[str, Any] = {}
        if target is not None:
            details = {"kind": target.resource.plural}
            if target.name:
                details["name"] = target.name
        headers: dict[str, str] = {}
        if fault.retry_after is not None:
            seconds = max(1, round(fault.retry_after)) if fault.retry_after >= 1 else 0
            headers["Retry-After"] = str(seconds if seconds else fault.retry_after)
            details["retryAfterSeconds"] = seconds
        return StatusError(code, fault.message or default, fault.reason, details, headers)

    def _not_found(self, target: _Target) -> StatusError:
        return StatusError(
            404,
            f'{target.resource.plural} "{target.name}" not found',
            details={"name": target.name, "kind": target.resource.plural},
        )

    def _key_ns(self, target: _Target) -> str:
        return target.namespace or "" if target.resource.namespaced else ""

    @staticmethod
    def _selectors(query: dict[str, str]) -> Any:
        try:
            by_field = field_selector(query.get("fieldSelector"))
            by_label = label_selector(query.get("labelSelector"))
        except SelectorError as exc:
            raise StatusError(400, str(exc)) from None
        return lambda obj: by_field(obj) and by_label(obj)

    async def _get(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        assert target.name is not None
        obj = self.store.get(target.resource, self._key_ns(target), target.name)
        if obj is None:
            raise self._not_found(target)
        return web.json_response(obj)

    async def _list(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        matches = self._selectors(record.query)
        items = self.store.list(target.resource, target.namespace, matches)
        rv = self.store.rv
        start = 0
        token = record.query.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                rv, start = int(state["rv"]), int(state["start"])
            except (ValueError, KeyError, TypeError):
                raise StatusError(400, "continue key is not valid") from None
            if rv < self.store.compacted_rv:
                raise StatusError(
                    410,
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                    "Expired",
                )
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = int(record.query.get("limit") or 0)
        page = items[start:]
        if limit > 0 and len(page) > limit:
            page = page[:limit]
            state = {"rv": rv, "start": start + limit}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(state).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
        return web.json_response(
            {
                "kind": f"{target.resource.kind}List",
                "apiVersion": target.resource.api_version,
                "metadata": meta,
                "items": [_strip_item(o) for o in page],
            }
        )

    async def _stream_error(
        self, request: web.Request, status: dict[str, Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
        await response.write_eof()
        return response

    async def _watch(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        matches = self._selectors(record.query)
        watcher = Watcher(
            target.resource,
            target.namespace,
            matches,
            bookmarks=_flag(record.query.get("allowWatchBookmarks")),
        )
        rv_param = record.query.get("resourceVersion") or ""
        if rv_param in ("", "0"):
            for obj in self.store.list(target.resource, target.namespace, matches):
                watcher.queue.put_nowait({"type": "ADDED", "object": obj})
        else:
            try:
                since = int(rv_param)
            except ValueError:
                raise StatusError(400, f"invalid resource version: {rv_param}") from None
            events = self.store.events_since(since)
            if events is None:
                return await self._stream_error(request, self._expired(since))
            for event in events:
                watcher.offer(event)
        self.store.watchers.add(watcher)
        self._streams.add(watcher)
        timeout = float(record.query.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            record.status = 200
            while not self._stopping.is_set():
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), left)
                except TimeoutError:
                    break
                if item is None:
                    break
                raw = item if isinstance(item, bytes) else json.dumps(item).encode()
                await response.write(raw + b"\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.watchers.discard(watcher)
            self._streams.discard(watcher)
        return response

    def _body_object(self, record: RequestRecord) -> dict[str, Any]:
        if not isinstance(record.body, dict):
            raise StatusError(400, "the request body must be a JSON object")
        return record.body

    def _commit(
        self, target: _Target, current: dict[str, Any], result: dict[str, Any]
    ) -> web.StreamResponse:
        """Checks the API server makes before storing an update, then store it."""
        meta = result.get("metadata")
        if not isinstance(meta, dict):
            raise StatusError(422, f'{target.resource.kind} "{target.name}" is invalid: metadata')
        old_meta = current["metadata"]
        what = f'{target.resource.plural} "{target.name}"'
        for immutable in ("name", "namespace", "uid"):
            if meta.get(immutable, old_meta.get(immutable)) != old_meta.get(immutable):
                raise StatusError(
                    422,
                    f'{target.resource.kind} "{target.name}" is invalid: metadata.{immutable}: '
                    "Invalid value: field is immutable",
                )
        rv = meta.get("resourceVersion")
        if rv is not None and rv != "" and str(rv) != old_meta["resourceVersion"]:
            raise StatusError(
                409,
                f"Operation cannot be fulfilled on {what}: the object has been modified; please "
                "apply your changes to the latest version and try again",
                details={"name": target.name, "kind": target.resource.plural},
            )
        result["kind"] = current["kind"]
        result["apiVersion"] = current["apiVersion"]
        for managed in ("uid", "creationTimestamp", "name", "namespace"):
            if managed in old_meta:
                meta[managed] = old_meta[managed]
        if target.resource.has_status:
            if target.subresource == "status":
                kept = copy.deepcopy(current)
                kept["status"] = result.get("status")
                result = kept
            elif "status" in current:
                result["status"] = copy.deepcopy(current["status"])
            else:
                result.pop("status", None)
        causes = validate_metadata(result)
        if causes:
            first = causes[0]
            raise StatusError(
                422,
                f'{target.resource.kind} "{target.name}" is invalid: '
                + ", ".join(f"{c.field}: {c.message}" for c in causes),
                details={
                    "name": target.name,
                    "kind": target.resource.kind,
                    "causes": [
                        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
                    ],
                },
                reason="Invalid" if first else None,
            )
        _check_spec(target.resource, result)
        return web.json_response(self.store.replace(target.resource, result))

    async def _patch(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        if target.name is None:
            raise StatusError(405, "PATCH needs an object name")
        current = self.store.get(target.resource, self._key_ns(target), target.name)
        if current is None:
            raise self._not_found(target)
        try:
            result = patching.apply(record.content_type, current, record.body)
        except patching.PatchError as exc:
            raise StatusError(exc.status, exc.message) from None
        return self._commit(target, current, result)

    async def _update(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        if target.name is None:
            raise StatusError(405, "PUT needs an object name")
        current = self.store.get(target.resource, self._key_ns(target), target.name)
        if current is None:
            raise self._not_found(target)
        return self._commit(target, current, copy.deepcopy(self._body_object(record)))

    async def _create(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        obj = copy.deepcopy(self._body_object(record))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise StatusError(422, f"{target.resource.kind} is invalid: metadata.name: Required")
        if target.resource.namespaced:
            meta["namespace"] = target.namespace or meta.get("namespace") or "default"
        meta.pop("resourceVersion", None)
        causes = validate_metadata(obj)
        if causes:
            raise StatusError(422, f'{target.resource.kind} "{meta["name"]}" is invalid')
        _check_spec(target.resource, obj)
        try:
            created = self.store.create(obj, target.resource)
        except KeyError:
            raise StatusError(
                409,
                f'{target.resource.plural} "{meta["name"]}" already exists',
                "AlreadyExists",
                details={"name": meta["name"], "kind": target.resource.plural},
            ) from None
        return web.json_response(created, status=201)

    async def _delete(
        self, request: web.Request, record: RequestRecord, target: _Target
    ) -> web.StreamResponse:
        assert target.name is not None
        gone = self.store.delete(target.resource, self._key_ns(target), target.name)
        if gone is None:
            raise self._not_found(target)
        return web.json_response(gone)
