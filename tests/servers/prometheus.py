"""Debian's Prometheus server and promtool, installed on first use, and a throwaway server.

CI starts on a bare machine as root: the first test that needs promtool or the server runs
`apt-get update` once and installs the `prometheus` package (one file lock, so parallel
workers install it once). Elsewhere, without root or apt, the tests skip and say why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.servers.postgres import free_port
from tests.waiting import eventually_blocking

PROMTOOL = os.environ.get("GPUID_TEST_PROMTOOL", "/usr/bin/promtool")
PROMETHEUS = os.environ.get("GPUID_TEST_PROMETHEUS", "/usr/bin/prometheus")
_LOCK = Path(tempfile.gettempdir()) / "gpuid-test-apt.lock"
_INSTALL_TIMEOUT = 600


def _present() -> bool:
    return Path(PROMTOOL).exists() and Path(PROMETHEUS).exists()


def unavailable() -> str | None:
    """Install Debian's prometheus package if missing; why it cannot be had, or None."""
    if _present():
        return None
    if os.geteuid() != 0:
        return f"{PROMTOOL} missing and installing Debian's prometheus package needs root"
    if not shutil.which("apt-get"):
        return f"{PROMTOOL} missing and no apt-get to install Debian's prometheus package"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _present():  # another worker installed it meanwhile
            return None
        steps = (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
        )
        with _no_service_start():
            for argv in steps:
                done = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT
                )
                if done.returncode != 0:
                    return f"`{' '.join(argv)}` failed: {done.stderr.strip()[-300:]}"
    return None if _present() else "the prometheus package did not provide promtool"


@contextlib.contextmanager
def _no_service_start() -> Iterator[None]:
    """The package's own service must not start (it would listen on every address): a
    policy-rc.d that refuses, as container images use, unless one is already there."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def promtool(
    *argv: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *argv],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class PrometheusServer:
    """A Prometheus on 127.0.0.1 with its own temp dir, scraping what `scrape_configs` say."""

    def __init__(self, scrape_configs: list[dict[str, Any]], interval: str = "1s") -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="gpuid-prom-"))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": scrape_configs,
        }
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = log = (self.root / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.root / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc = self._proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log()[-2000:]}")
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200

        try:
            eventually_blocking(ready, within=30, ignoring=(OSError,))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()[-2000:]}") from exc

    def log(self) -> str:
        path = self.root / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def running(
    scrape_configs: list[dict[str, Any]], interval: str = "1s"
) -> Iterator[PrometheusServer]:
    server = PrometheusServer(scrape_configs, interval)
    try:
        server.start()
        yield server
    finally:
        server.stop()
