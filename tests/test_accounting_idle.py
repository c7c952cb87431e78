"""Idle time billed: every GPU's unheld time and energy has usage records of its own, so a
node's usage records add up to its GPUs x time, across a SIGKILL of the agent (a real
subprocess on the simulated GB200 node, STATE_DIR and a real HTTP receiver)."""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.accounting_split import idle_holding
from gpuid_agent.state.attribution.holders import Attribution
from gpuid_agent.state.attribution.shares import PROCESSES_OFF
from tests.agent_subprocess import start_agent
from tests.servers.receiver import Receiver
from tests.test_accounting_sigkill import allocation_records, at, one_gpu_held
from tests.waiting import eventually

NODE = "sim-idle"
POLL = 0.1


async def test_usage_records_add_up_to_the_gpus_time_idle_included(
    receiver: Receiver, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    gpus, kubelet, env = await one_gpu_held(receiver, subprocess_env, tmp_path, NODE)
    log = tmp_path / "agent.log"

    def usage() -> list[dict[str, Any]]:
        return [r for r in allocation_records(receiver).values() if r["event"] == "usage"]

    def idle_rounds() -> int:
        return min(sum(1 for r in usage() if r["uuid"] == g and not r["pod"]) for g in gpus)

    proc = start_agent(env, log)
    try:
        await eventually(lambda: idle_rounds() >= 2, within=60, what="idle usage records")
        proc.send_signal(signal.SIGKILL)  # mid-period
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        proc = start_agent(env, log)
        before = idle_rounds()
        await eventually(lambda: idle_rounds() >= before + 2, within=60, what="after restart")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        await kubelet.stop()
    records = usage()
    by_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if not r["pod"]:
            assert (r["namespace"], r["container"], r["device_id"]) == ("", "", r["uuid"])
            by_gpu[r["uuid"]].append(r)
    assert set(by_gpu) == set(gpus)
    for gpu, idle in by_gpu.items():
        idle.sort(key=lambda r: r["usage_start"])
        for earlier, later in itertools.pairwise(idle):  # tiled, across the kill
            assert earlier["read_time"] == later["usage_start"], [
                (r["usage_start"], r["read_time"], r["gpu_seconds"]) for r in idle
            ]
        if gpu != gpus[0]:  # nobody holds it: all its time is idle
            span = at(idle[-1]["read_time"]) - at(idle[0]["usage_start"])
            total = sum(r["gpu_seconds"] for r in idle)
            assert total == pytest.approx(span, abs=2 * POLL)
            assert all(r["energy_joules"] > 0 for r in idle)
    # per flush where every GPU's record covers the same span: GPUs x that span, to one
    # collection (the amounts are the collections' own, the span the flush's clock)
    flushes: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        flushes[(r["usage_start"], r["read_time"])].append(r)
    whole = [(k, rs) for k, rs in flushes.items() if {r["uuid"] for r in rs} == set(gpus)]
    assert len(whole) >= 2
    for (start, end), rs in whole:
        span = at(end) - at(start)
        total = sum(r["gpu_seconds"] for r in rs)
        assert total == pytest.approx(len(gpus) * span, abs=len(gpus) * POLL)


def test_a_gpus_idle_holding_gets_its_unheld_time_and_energy() -> None:
    """Unit level: the accountant's idle row per GPU, against the GPUs' own counters."""
    inventory = [GpuIdentity(index=i, uuid=f"GPU-{i}") for i in range(2)]
    start = datetime(2026, 1, 1, tzinfo=UTC)
    accountant = Accountant(AccountingConfig(), "unit")
    attribution = Attribution("current", by_device=MappingProxyType({}))
    energy = {g.uuid: 1_000_000 for g in inventory}
    view = None
    for step in range(4):
        node = NodeInventory(
            node="unit", cluster="c", machine="m", machine_source="test", driver_version=None,
            cuda_driver_version=None, gpus=tuple(inventory),
            read_time=start + timedelta(seconds=10 * step),
        )  # fmt: skip
        samples = {
            g.uuid: GpuSample(uuid=g.uuid, values=MappingProxyType({"energy_mj": energy[g.uuid]}))
            for g in inventory
        }
        view = accountant.advance(node, samples, attribution, PROCESSES_OFF)
        for g in inventory:
            energy[g.uuid] += 50_000 * (g.index + 1)  # 50 J and 100 J per step
    assert view is not None
    for g in inventory:
        idle = view.holding(idle_holding(g.uuid))
        assert idle is not None
        assert idle.gpu_seconds == pytest.approx(30.0)
        assert idle.energy_joules == pytest.approx(3 * 50.0 * (g.index + 1))
