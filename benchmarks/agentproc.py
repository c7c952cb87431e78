"""Start the agent (or a baseline server) as a subprocess and wait for it, for benchmarks."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_agent(
    port: int, *args: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """The agent of the package found first from `cwd` (`python -m` puts the working directory
    ahead of PYTHONPATH: another checkout's agent must be started from that checkout)."""
    base = {k: v for k, v in os.environ.items() if not k.isupper() or k in ("PATH", "HOME")}
    base |= {
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": str(port),
        "LABELS": "off",
        "KUBE_API": "off",
        "LOG_LEVEL": "warning",
    }
    base |= env or {}
    return subprocess.Popen(
        [sys.executable, "-m", "gpuid_agent", "run", *args],
        env=base,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wait_http(url: str, within: float = 30.0) -> float:
    """Seconds until `url` answers 200."""
    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - started < within:
            try:
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.01)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


STATIC_SERVER = """
import sys
from aiohttp import web
body = open(sys.argv[2], "rb").read()
async def h(request):
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
app = web.Application()
app.router.add_get("/gpu/metrics", h)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def start_static(port: int, body_path: Path) -> subprocess.Popen[bytes]:
    """An aiohttp handler returning fixed bytes: the floor a cached-bytes scrape can reach."""
    return subprocess.Popen(
        [sys.executable, "-c", STATIC_SERVER, str(port), str(body_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def load(
    url: str, clients: int = 32, requests: int = 3000, headers: dict[str, str] | None = None
) -> list[float]:
    """Latencies (seconds) of `requests` GETs issued by `clients` concurrent clients."""
    latencies: list[float] = []
    remaining = requests
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                async with http.get(url, headers=headers) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies
