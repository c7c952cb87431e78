"""Fixtures: `kubelet_socket` (a short, private socket path) and `kubelet` (a started server)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.fakekubelet import FakeKubelet


@pytest.fixture
def kubelet_socket() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    try:
        yield str(Path(directory) / "kubelet.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def kubelet(kubelet_socket: str) -> AsyncIterator[FakeKubelet]:
    server = FakeKubelet(kubelet_socket)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
