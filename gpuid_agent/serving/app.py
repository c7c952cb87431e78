"""The HTTP surface: /metrics, /gpu/metrics, /healthz, /readyz, /status.

Handlers only read state the background tasks already prepared; none of them does NVML,
kubelet or API work, so a scrape storm cannot slow collection down or the other way round.
The one await is the /gpu/metrics body, made from the latest snapshot in a worker thread on
its first request in that format (or ahead of an expected scrape), and shared by the scrapes
that arrive meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuid_agent.serving.gpu_metrics import Format

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT = "text/plain; version=0.0.4; charset=utf-8"


class HealthView(Protocol):
    def liveness(self) -> tuple[bool, list[str]]: ...
    def readiness(self) -> tuple[bool, list[str]]: ...
    def status(self) -> dict[str, Any]: ...


class MetricsView(Protocol):
    """The /gpu/metrics bodies of the latest snapshot, each made on the first request in its
    format (off the loop) and awaited by the scrapes that want it; `scraper` is the client's
    address."""

    @property
    def openmetrics_offered(self) -> bool: ...
    async def body(self, fmt: Format, scraper: str | None) -> bytes: ...


def _wants_openmetrics(request: web.Request) -> bool:
    return "application/openmetrics-text" in request.headers.get("Accept", "")


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, default=str, option=orjson.OPT_INDENT_2),
        status=status,
        content_type="application/json",
    )


def build_app(
    page: HealthView,
    renderer: MetricsView,
    registry: CollectorRegistry,
    middlewares: Sequence[Middleware] = (),
) -> web.Application:
    async def gpu_metrics(request: web.Request) -> web.Response:
        if renderer.openmetrics_offered and _wants_openmetrics(request):
            body = await renderer.body("openmetrics", request.remote)
            return web.Response(body=body, headers={"Content-Type": OPENMETRICS})
        body = await renderer.body("text", request.remote)
        return web.Response(body=body, headers={"Content-Type": TEXT})

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    async def healthz(request: web.Request) -> web.Response:
        ok, problems = page.liveness()
        return _json({"ok": ok, "problems": problems}, 200 if ok else 503)

    async def readyz(request: web.Request) -> web.Response:
        ok, problems = page.readiness()
        return _json({"ok": ok, "problems": problems}, 200 if ok else 503)

    async def status(request: web.Request) -> web.Response:
        return _json(page.status())

    app = web.Application(middlewares=middlewares)
    app.router.add_get("/gpu/metrics", gpu_metrics)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    return app
