"""An aiohttp receiver of POSTed record batches that can answer 5xx/429/400 or stall.

`python -m tests.servers.receiver PORT` runs a counting receiver in its own process (the
benchmark's), answering GET /count with the records it accepted.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: str = "ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    hold: bool = False  # answer only once `Receiver.release` is set


@dataclass
class Received:
    at: float
    headers: dict[str, str]
    records: list[dict[str, Any]]
    status: int = 0
    size: int = 0  # bytes of the decoded body
    path_qs: str = ""  # the request's path and query, as a receiver that echoes it sees it

    @property
    def record_ids(self) -> list[str]:
        return [r.get("record_id", "") for r in self.records]


class Receiver:
    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requests: list[Received] = []
        self.plan: deque[Reply] = deque()
        self.default = Reply()
        self.decide: Callable[[Received], Reply | None] | None = None
        self.release = asyncio.Event()
        self._ssl = ssl_context
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()  # aiohttp already undoes Content-Encoding: gzip
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        entry = Received(
            time.monotonic(),
            dict(request.headers),
            json.loads(raw),
            size=len(raw),
            path_qs=request.path_qs,
        )
        self.requests.append(entry)
        reply = (self.decide(entry) if self.decide else None) or (
            self.plan.popleft() if self.plan else self.default
        )
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.hold:
            await self.release.wait()
        entry.status = reply.status
        return web.Response(status=reply.status, text=reply.body, headers=reply.headers)

    async def start(self) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/ingest", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        scheme = "https" if self._ssl else "http"
        self.url = f"{scheme}://127.0.0.1:{port}/ingest"
        return self.url

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def accepted_ids(self) -> set[str]:
        return {i for r in self.requests if 200 <= r.status < 300 for i in r.record_ids}


def main(port: int) -> None:
    accepted = 0

    async def ingest(request: web.Request) -> web.Response:
        nonlocal accepted
        raw = await request.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        accepted += len(json.loads(raw))
        return web.Response(text="ok")

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"records": accepted})

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/ingest", ingest)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
