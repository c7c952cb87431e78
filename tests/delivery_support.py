"""A real small tmpfs for the delivery fault tests: mounted, remounted read-only, unmounted."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class Tmpfs:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _mount(self, *args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True, timeout=10)

    def read_only(self) -> None:
        self._mount("-o", "remount,ro", str(self.path))

    def writable(self) -> None:
        self._mount("-o", "remount,rw", str(self.path))


def mount_tmpfs(path: Path, size: str) -> Iterator[Tmpfs]:
    """Mount a tmpfs of `size` at `path` for one test; skip when mounting is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the fault tests remount it read-only)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {done.stderr.strip()}")
    try:
        yield Tmpfs(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """A 1 MiB tmpfs."""
    yield from mount_tmpfs(tmp_path / "tmpfs", "1m")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """A 64 KiB tmpfs, full after a few batches."""
    yield from mount_tmpfs(tmp_path / "tiny", "64k")


def tmp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]
