"""The fleet's OTLP sink: every simulated node's real OtlpExporter into one OTLP/HTTP receiver
(the tests' decoding receiver) in its own process on 127.0.0.1.

The receiver counts what it accepted (by record id), the connections open to it (its own
server's count: the receiver side), and the lag from each record's time to its acceptance.
An outage closes its listening socket and every connection (SIGUSR1) while the process keeps
what it took; SIGUSR2 listens again on the same port.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from datetime import datetime
from typing import Any

import aiohttp

from benchmarks.fleet import Expected, Schedule
from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.exporters.otlp.endpoint import REFUSALS
from gpuid_agent.delivery.exporters.transport import USER_AGENT, HttpTransport
from tests.servers.postgres import free_port

KEEPALIVE = 15.0  # aiohttp's keep-alive of an idle client connection (seconds)


class _CompressedKeepAlive(HttpTransport):
    """The exporter's transport with aiohttp's keep-alive divided by the fleet's compression,
    as every other schedule is: uncompressed, a node delivering every few fleet-minutes would
    hold its connection for a few wall seconds only; compressed without this, for ever."""

    def __init__(self, endpoint: str, keepalive: float) -> None:
        super().__init__(endpoint, refusals=REFUSALS, timeout=30.0)
        self.keepalive = keepalive

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4, keepalive_timeout=self.keepalive),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session


class OtlpSink:
    name = "otlp"

    def __init__(self) -> None:
        self.port = free_port()
        self._proc: asyncio.subprocess.Process | None = None
        self._ids: set[str] = set()
        self._seen = 0  # ids fetched so far (the receiver's arrival order)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as answer:
            return json.loads(answer.read())

    async def _wait_up(self) -> None:
        for _ in range(400):
            try:
                await asyncio.to_thread(self._get, "/count")
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise RuntimeError("OTLP receiver did not start")

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.servers.otlp",
            str(self.port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await self._wait_up()

    def exporter(self, node: str, schedule: Schedule, compress: float) -> Exporter:
        from gpuid_agent.delivery.exporters.otlp import OtlpExporter

        exporter = OtlpExporter(f"{self.base}/v1/logs", timeout=30.0)
        exporter.http.transport = _CompressedKeepAlive(exporter.endpoint, KEEPALIVE / compress)
        return exporter

    async def connections(self) -> int | None:
        try:
            # less the connection this question arrives on
            return int((await asyncio.to_thread(self._get, "/count"))["connections"]) - 1
        except OSError:  # not listening (an outage): no sample
            return None

    async def stored(self, expected: Expected) -> Expected:
        new: list[str] = await asyncio.to_thread(self._get, f"/ids?after={self._seen}")
        self._seen += len(new)
        self._ids.update(new)
        return Expected(
            expected.readings & self._ids,
            expected.allocations_started & self._ids,
            expected.allocations_ended & self._ids,
        )

    def _signal(self, which: signal.Signals) -> None:
        assert self._proc is not None
        self._proc.send_signal(which)

    async def stop_server(self) -> None:
        self._signal(signal.SIGUSR1)
        for _ in range(400):  # until the port refuses
            if await self.connections() is None:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError("OTLP receiver did not stop listening")

    async def start_server(self) -> None:
        self._signal(signal.SIGUSR2)
        await self._wait_up()

    async def latency_p99(self, since: datetime) -> float | None:
        """A record's time (a reading's read_time) to the receiver's acceptance of it."""
        ns = int(since.timestamp() * 1e9)
        value = (await asyncio.to_thread(self._get, f"/p99?since={ns}"))["p99"]
        return None if value is None else float(value)

    async def max_connections(self) -> int | None:
        return None  # an aiohttp server sets no connection limit

    async def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            await asyncio.wait_for(self._proc.wait(), 10)
            self._proc = None
