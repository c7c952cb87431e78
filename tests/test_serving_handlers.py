"""Handlers only read: probes and scrapes are served while an exporter's health check hangs."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence

import aiohttp
import orjson

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.records.types import AnyRecord
from tests.conftest import running_agent, settings
from tests.waiting import eventually


class HangingHealth(Exporter):
    """Accepts every batch; its health check never returns on its own."""

    name = "hanging"

    def __init__(self) -> None:
        self.checks_started = 0
        self.checks_pending = 0

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        return None

    async def health(self) -> ExporterHealth:
        self.checks_started += 1
        self.checks_pending += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.checks_pending -= 1
        raise AssertionError("unreachable")


async def test_probes_and_scrapes_are_served_while_a_health_check_hangs() -> None:
    hanging = HangingHealth()
    s = settings(simulate="h100x8", collect_interval=30, health_probe_interval=0.1)
    timeout = aiohttp.ClientTimeout(total=10)  # a hang detector, not a latency bound
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(io.BytesIO()), hanging])) as agent,
        aiohttp.ClientSession(timeout=timeout) as http,
    ):
        base = f"http://127.0.0.1:{agent.bound_port}"
        await eventually(lambda: hanging.checks_pending > 0)
        for _ in range(5):
            for path in ("/healthz", "/readyz", "/status", "/metrics", "/gpu/metrics"):
                async with http.get(base + path) as resp:
                    assert resp.status in (200, 503), path
                    await resp.read()
        assert hanging.checks_pending > 0  # still hanging while all of that was served

        async def hanging_reported() -> bool:
            async with http.get(base + "/status") as resp:
                document = orjson.loads(await resp.read())
            return "health check timed out" in orjson.dumps(document).decode()

        # the worker times the check out on its own; /status shows what it concluded
        await eventually(hanging_reported, within=10)
