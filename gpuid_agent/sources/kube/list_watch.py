"""The one list+watch loop of the agent's node-scoped caches (pods, ResourceSlices).

LIST the node's objects (`fieldSelector=spec.nodeName=<node>`), then WATCH from the list's
resourceVersion, resuming from the last event's when the server ends the watch. 410 Gone lists
again at once; a resourceVersion the server refuses (400) or a resource it no longer serves
(404) lists again after the backoff; any other failure is retried after the backoff with the
cached objects kept. Each watch event is unwrapped here (ERROR events end the watch, odd ones
are reported and skipped, every resourceVersion is tracked), so the cache only ever sees an
ADDED, MODIFIED or DELETED object.

Malformed data (a watch line that is not JSON or too long, an event without an object or of no
known type, a list where events belong, an item naming no object) is counted by the cache and
logged at most once per reason a minute, the next line saying how many were suppressed. A
watch that brought nothing but malformed data, or ended at once, is retried after the same
backoff as a failure; a good event resets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, watch_events

ABSENT_RETRY_SECONDS = 600.0  # a resource not served (no resource.k8s.io): look again now and then
MALFORMED_LOG_EVERY = 60.0  # one log line per reason of malformed data in this many seconds
_FAILURES = (KubeApiError, aiohttp.ClientError, TimeoutError, ValueError)


NO_API = "no Kubernetes API configuration found"


def api_given(
    shared: object | None, board: StatusBoard, component: str, no_api: Callable[[str], None]
) -> bool:
    """A cache's start with the agent's API client (never closed by the cache): False, with
    `no_api` told why, without one."""
    if shared is None:
        no_api(NO_API)
        return False
    board.set(component, "starting")
    return True


class Followed(Protocol):
    """What a cache kept by a ListWatch does with what the API says."""

    async def relist(self, lister: ListWatch) -> str | None:
        """List everything through `lister.list` and take it as the whole state; the list's
        resourceVersion (`list_version`), or None when the resource is not served here (then
        looked for again after ABSENT_RETRY_SECONDS)."""
        ...

    async def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One ADDED, MODIFIED or DELETED object of the watch."""
        ...

    def synced(self) -> None:
        """A watch event was taken: the cache follows the API."""
        ...

    def failed(self, exc: Exception) -> None:
        """A list or watch failed; the loop retries after a backoff."""
        ...

    def malformed(self, what: str) -> None:
        """A watch line, event or listed item was skipped: count it (`ListWatch.skipped`,
        through which every skip is reported, calls this and does the logging)."""
        ...


class MalformedLog:
    """Warns of malformed data at most once per reason (`what`) per MALFORMED_LOG_EVERY
    seconds: a server sending the same bad data in a loop must not flood the log. The next
    line of a reason says how many of it were suppressed; the cache's count has them all."""

    def __init__(
        self, logger: logging.Logger, what: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._what = what
        self._clock = clock
        self._logged: dict[str, float] = {}  # reason → when last logged
        self._suppressed: dict[str, int] = {}

    def __call__(self, reason: str) -> None:
        now = self._clock()
        last = self._logged.get(reason)
        if last is not None and now - last < MALFORMED_LOG_EVERY:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._logged[reason] = now
        extra: dict[str, Any] = {"what": reason}
        if suppressed := self._suppressed.pop(reason, 0):
            extra["suppressed"] = suppressed
        self._log.warning("malformed %s data skipped", self._what, extra=extra)


class ListWatch:
    """Keeps `target` in step with this node's objects of one kind (`what`: "pod", …)."""

    def __init__(
        self,
        what: str,
        node: str,
        target: Followed,
        *,
        logger: logging.Logger,
        timeout: float,
        watch_timeout: float,
        backoff_max: float,
    ) -> None:
        self.what = what
        self.selector = f"spec.nodeName={node}"
        self._target = target
        self._log = logger
        self._timeout = timeout
        self._watch_timeout = watch_timeout
        self._backoff = Backoff(base=1.0, cap=backoff_max)
        self._log_malformed = MalformedLog(logger, what)
        self._skipped = 0  # malformed data reported so far: a watch compares it before and after
        self._client: KubeClient | None = None
        self._path: str | None = None  # the collection last listed: the one watched
        self.resource_version: str | None = None  # None: list (again) before watching

    async def list(self, client: KubeClient, path: str) -> Any:
        """One LIST of the node's objects in the collection at `path` (`/api/v1/pods`), as
        parsed JSON; the watch that follows is on the same collection."""
        listed = await client.request_json(
            "GET", path, query=[("fieldSelector", self.selector)], within=self._timeout
        )
        self._client, self._path = client, path
        return listed

    def skipped(self, what: str) -> None:
        """Malformed data passed over (by this loop or by the cache): counted by the cache,
        logged at most once per reason a minute."""
        self._skipped += 1
        self._target.malformed(what)
        self._log_malformed(what)

    async def run(self) -> None:
        backoff = self._backoff
        while True:
            try:
                if self.resource_version is None:
                    listed_at = await self._target.relist(self)
                    if listed_at is None:
                        await asyncio.sleep(ABSENT_RETRY_SECONDS)
                        continue
                    self.resource_version = listed_at
                started, skipped = time.monotonic(), self._skipped
                good = await self._watch()
                at_once = time.monotonic() - started < 1.0
                if not good and (at_once or self._skipped > skipped):
                    # A server ignoring watch=true, or sending only garbage: no better on a
                    # prompt retry, so back off as after a failure.
                    await asyncio.sleep(backoff.next())
                    continue
                backoff.reset()
                if at_once:
                    await asyncio.sleep(1.0)  # a server ending every watch at once: no spin
            except _FAILURES as exc:
                status = exc.status if isinstance(exc, KubeApiError) else None
                if status == 410:
                    self._log.info("%s watch expired; listing again", self.what)
                    self.resource_version = None
                    continue
                if status in (400, 404):  # a refused resourceVersion; a resource gone
                    self.resource_version = None
                self._target.failed(exc)
                await asyncio.sleep(backoff.next())

    async def _watch(self) -> int:
        """Follow events until the server ends the watch; how many were good (a 410 raises
        KubeApiError(410))."""
        assert self._client is not None, "a list comes first"
        assert self._path is not None
        query: list[tuple[str, Any]] = [
            ("allowWatchBookmarks", True),
            ("fieldSelector", self.selector),
            ("timeoutSeconds", int(self._watch_timeout)),
            ("watch", True),
        ]
        if self.resource_version is not None:
            query.insert(2, ("resourceVersion", self.resource_version))
        resp = await self._client.send(
            "GET", self._path, query=query, within=self._watch_timeout + self._timeout
        )
        good = 0
        async with contextlib.aclosing(watch_events(resp, self.what, self.skipped)) as events:
            async for event in events:
                if await self._event(event):
                    good += 1
                    self._backoff.reset()
        return good

    async def _event(self, event: Any) -> bool:
        """Hand one event on; True when it was good (nothing in it malformed)."""
        skipped = self._skipped
        obj = event.get("object") if isinstance(event, Mapping) else None
        if not isinstance(obj, Mapping):
            if isinstance(event, Mapping) and "items" in event:
                self.skipped(f"{self.what} watch answered with a list (watch=true ignored)")
            else:
                self.skipped(f"{self.what} watch event without an object")
            return False
        kind = event.get("type")
        if kind == "ERROR":
            code = obj.get("code")
            status = code if isinstance(code, int) and not isinstance(code, bool) else 0
            raise KubeApiError(status, str(obj.get("message"))[:200])
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            await self._target.apply(kind, obj)
        elif kind != "BOOKMARK":
            self.skipped(f"{self.what} watch event of no known type")
        # A skipped event's resourceVersion still counts: resuming must not replay it.
        if version := object_version(obj):
            self.resource_version = version
        self._target.synced()
        return self._skipped == skipped


def failure_reason(exc: Exception, resource: str) -> str:
    """Why a list or watch of `resource` ("pods", …) failed, as /status says it."""
    status = getattr(exc, "status", 0)
    return {
        401: "unauthorized",
        403: f"forbidden (RBAC: list/watch {resource})",
        404: f"{resource} no longer served",
    }.get(status, f"{type(exc).__name__}: {exc}")


def object_version(obj: Any) -> str | None:
    """An object's (or a list's) metadata.resourceVersion; None unless a non-empty string."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return version if isinstance(version, str) and version else None


def list_version(listed: Any) -> str:
    """The resourceVersion to watch a list from ("": none given, watch from now)."""
    return object_version(listed) or ""
