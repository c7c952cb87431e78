"""SIGKILL the agent (a real subprocess with STATE_DIR) in the middle of an allocation: the
allocation's usage records, delivered to a real HTTP receiver, neither lose the time before
the kill nor count any of it twice, and add up to its end's totals."""

from __future__ import annotations

import asyncio
import itertools
import signal
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.simulate.profiles import gb200x4
from tests.agent_subprocess import start_agent
from tests.fakekubelet import FakeKubelet, pod
from tests.servers.receiver import Receiver
from tests.waiting import eventually

NODE = "sim-accounting"
POLL = 0.1


def allocation_records(receiver: Receiver) -> dict[str, dict[str, Any]]:
    """By record id: what the receiver accepted (a re-send after the kill is the same id)."""
    return {
        r["record_id"]: r
        for req in receiver.requests
        if 200 <= req.status < 300
        for r in req.records
        if r.get("kind") == "allocation"
    }


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def one_gpu_held(
    receiver: Receiver, subprocess_env: dict[str, str], tmp_path: Path, node: str
) -> tuple[list[str], FakeKubelet, dict[str, str]]:
    """The simulated GB200 node's GPUs, a started kubelet where ml/train-0 holds the first,
    and the environment of an agent (STATE_DIR, SPOOL_DIR, 1 s accounting periods) sending
    to `receiver`."""
    gpus = [g.uuid for g in gb200x4(node)]
    socket_dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    kubelet = FakeKubelet(
        str(socket_dir / "kubelet.sock"), allocatable=(("nvidia.com/gpu", tuple(gpus)),)
    )
    await kubelet.start()
    kubelet.pods = [pod("ml", "train-0", "main", "nvidia.com/gpu", gpus[0])]
    env = {
        **subprocess_env,
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": receiver.url,
        "SPOOL_DIR": str(tmp_path / "spool"),
        "STATE_DIR": str(tmp_path / "state"),
        "POD_RESOURCES_SOCKET": kubelet.socket_path,
        "POD_RESOURCES_INTERVAL": str(POLL),
        "COLLECT_INTERVAL": str(POLL),
        "ACCOUNTING_INTERVAL": "1s",
        "KUBE_API": "off",
        "LABELS": "off",
        "NODE_NAME": node,
        "CLUSTER_NAME": "test",
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "FLUSH_INTERVAL": "0.2",
        "LOG_LEVEL": "warning",
    }
    return gpus, kubelet, env


async def test_usage_survives_sigkill_mid_allocation(
    receiver: Receiver, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    _, kubelet, env = await one_gpu_held(receiver, subprocess_env, tmp_path, NODE)
    log = tmp_path / "agent.log"

    def usage() -> list[dict[str, Any]]:
        records = allocation_records(receiver).values()
        return [r for r in records if r["event"] == "usage" and r["pod"]]  # not the idle GPUs

    proc = start_agent(env, log)
    try:
        await eventually(lambda: len(usage()) >= 1, within=60, what="a usage record")
        proc.send_signal(signal.SIGKILL)  # mid-allocation, mid-period
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        await asyncio.sleep(1.0)  # down for a while: the allocation goes on
        proc = start_agent(env, log)
        before = len(usage())
        await eventually(lambda: len(usage()) > before, within=60, what="usage after restart")
        kubelet.pods = []
        await eventually(
            lambda: any(r["event"] == "end" for r in allocation_records(receiver).values()),
            within=30,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        await kubelet.stop()
    records = allocation_records(receiver).values()
    [start_record] = [r for r in records if r["event"] == "start"]
    [end] = [r for r in records if r["event"] == "end"]
    periods = sorted(usage(), key=lambda r: r["usage_start"])
    # one GPU held alone: its GPU-seconds are the time it was held, the kill's gap included
    held = at(end["ended_at"]) - at(start_record["started_at"])
    assert end["gpu_seconds"] == pytest.approx(held, abs=1.0)
    # the usage records tile the allocation: no period lost, none counted twice
    assert sum(r["gpu_seconds"] for r in periods) == pytest.approx(end["gpu_seconds"], abs=0.01)
    assert sum(r["energy_joules"] for r in periods) == pytest.approx(end["energy_joules"], abs=0.01)
    for earlier, later in itertools.pairwise(periods):
        assert earlier["read_time"] == later["usage_start"]
    assert "Traceback" not in log.read_text()
