"""Debian's Chromium, headless, to open the pages the project writes: the DOM after its scripts
ran (`--dump-dom`) and a screenshot. Installed with apt on first use when running as root, as
CI does (one file lock, shared with the other apt installs); elsewhere the tests say why not."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from tests.servers.prometheus import _LOCK

BINARY = "chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run")


def _binary() -> str | None:
    return shutil.which(BINARY) or (f"/usr/bin/{BINARY}" if Path(f"/usr/bin/{BINARY}").exists() else None)


def unavailable() -> str | None:
    """Install Debian's chromium if missing; why it cannot be had, or None."""
    if _binary():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium is not installed and installing it needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _binary():
            return None
        for argv in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY],
        ):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                return f"`{' '.join(argv)}` failed: {done.stderr.strip()[-300:]}"
    return None if _binary() else "the chromium package did not provide chromium"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    binary = _binary()
    assert binary is not None
    return subprocess.run(
        [binary, *FLAGS, *argv], capture_output=True, text=True, timeout=120, check=False
    )


def dom(page: Path) -> str:
    """The page's DOM once loaded and its scripts ran."""
    done = _run("--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(page: Path, into: Path, width: int = 1440, height: int = 1900) -> None:
    into.parent.mkdir(parents=True, exist_ok=True)
    done = _run(f"--window-size={width},{height}", f"--screenshot={into}", page.resolve().as_uri())
    assert done.returncode == 0 and into.exists(), done.stderr[-2000:]
