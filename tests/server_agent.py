"""The agent as a real subprocess on a simulated node, for the HTTP server's connection tests:
its port, its descriptors (/proc/PID/fd), its JSON log, and raw connections to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuid_agent.runtime.config import Settings
from tests.waiting import eventually

HOST = "127.0.0.1"


def agent_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in Settings.model_fields}
    return (
        env
        | {
            "PYTHONUNBUFFERED": "1",
            "SIMULATE": "h100x8",
            "NODE_NAME": "server-node",
            "SERVER_ADDRESS": HOST,
            "SERVER_PORT": "0",
            "LABELS": "off",
            "KUBE_API": "off",
            "LOG_LEVEL": "info",
            "SHUTDOWN_GRACE": "2",
        }
        | settings
    )


class AgentProcess:
    def __init__(self, log: Path, env: dict[str, str], nofile: int | None = None) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuid_agent", "run"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        if nofile is not None:  # `ulimit -n`, in place before the agent opens its server
            self.set_nofile(nofile)
        self.port = 0

    async def started(self) -> AgentProcess:
        def port() -> int | None:
            assert self.proc.poll() is None, self.log.read_text()
            for line in self.lines():
                if line.get("msg") == "agent started":
                    return int(line["port"])
            return None

        self.port = await eventually(port, within=30)
        return self

    def set_nofile(self, limit: int) -> None:
        """The agent's soft descriptor limit (the hard one stays, so it can be raised again)."""
        _, hard = resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, (limit, hard))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def lowest_free_fd(self) -> int:
        """With RLIMIT_NOFILE set to this, the agent cannot open one more descriptor."""
        used = {int(fd) for fd in os.listdir(f"/proc/{self.proc.pid}/fd")}
        return min(set(range(len(used) + 1)) - used)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def connect(self) -> Conn:
        reader, writer = await asyncio.open_connection(HOST, self.port)
        return Conn(reader, writer)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET `path` on a fresh connection: the status code and body."""
        conn = await self.connect()
        try:
            return await conn.request(path, close=True)
        finally:
            conn.close()

    async def metric(self, series: str) -> float:
        _, body = await self.get("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{series} not on /metrics")


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def request(self, path: str, close: bool = False) -> tuple[int, bytes]:
        connection = "close" if close else "keep-alive"
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: {connection}\r\n\r\n".encode()
        )
        return await self.response()

    async def response(self) -> tuple[int, bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split()[1])
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return status, await asyncio.wait_for(self.reader.readexactly(length), 10)

    async def closed_by_server(self) -> bool:
        """True once the server has closed this connection (EOF or reset)."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), 0.05)
        except TimeoutError:
            return False
        except OSError:
            return True
        return data == b""

    def close(self) -> None:
        self.writer.close()
