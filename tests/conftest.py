"""Fixtures shared by the suite."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.state.health.verdicts import NodeHealth

# The real servers the tests run against (PostgreSQL, moto S3, an HTTP receiver; etcd,
# kube-apiserver and the kubelet's pod-resources server built from Go modules).
pytest_plugins = ["tests.servers.fixtures", "tests.realkube.fixtures"]
# tests/image/ runs in `nox -s image`, against the image that session builds and names.
collect_ignore = [] if os.environ.get("GPUID_AGENT_IMAGE") else ["image"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build settings explicitly; the developer's environment must not leak in."""
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "server_address": "127.0.0.1",
        "server_port": 0,
        "node_name": "node-a",
        "cluster_name": "test",
        "collect_interval": 0.05,
        "flush_interval": 0.05,
        "labels": "off",
        "kube_api": "off",
        "dmi_product_uuid_path": "",
        "machine_id_path": "",
    }
    base.update(overrides)
    return load_settings(base)


@asynccontextmanager
async def running_agent(agent: Agent) -> AsyncIterator[Agent]:
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


async def serves(agent: Agent, *parts: bytes) -> bool:
    """/gpu/metrics (text) as a scrape would get it now has every one of `parts`."""
    text = (await agent.renderer.rendered()).text
    return all(part in text for part in parts)


def node_health(agent: Agent) -> NodeHealth:
    """GPU health as the agent last published it (what /gpu/metrics, Node conditions and
    health records read); empty before the first snapshot."""
    last = agent.bus.latest
    return NodeHealth() if last is None else last.health


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for agent subprocesses: this interpreter's, without our settings."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in Settings.model_fields}
    env["PYTHONUNBUFFERED"] = "1"
    return env


from tests.fakenvml.fixtures import fake_nvml, fake_nvml_build_dir, fake_nvml_lib  # noqa: E402

__all__ = ["fake_nvml", "fake_nvml_build_dir", "fake_nvml_lib"]
from tests.fakekubelet.fixtures import kubelet, kubelet_socket  # noqa: E402

__all__ += ["kubelet", "kubelet_socket"]
