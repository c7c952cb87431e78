"""`--simulate timesliced`: a simulated node whose pods run processes shows per-process
shares, explicit unattributed use and every allocation state on /gpu/metrics."""

from __future__ import annotations

import io
import os
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from tests.conftest import running_agent, serves, settings
from tests.waiting import eventually


def by_name(text: str) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_timesliced_profile_shows_shares_and_unattributed() -> None:
    agent = Agent(
        settings(simulate="timesliced", pod_resources_interval=0.05),
        exporters=[StdoutExporter(io.BytesIO())],
    )
    async with running_agent(agent):
        proc = agent.environment.host_proc
        assert await_exists(proc)
        # processes can be attributed (through the pods' UIDs) before the kubelet's first List
        # says who holds what: wait for both
        await eventually(
            lambda: serves(
                agent, b'pod="stray-job"', b'allocated="true"', b"gpuid_gpu_allocation_info{"
            )
        )
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/gpu/metrics") as resp,
        ):
            m = by_name(await resp.text())
    assert not os.path.exists(proc)  # the simulated /proc goes with the agent
    holders = {
        (s.labels["gpu"], s.labels["pod"], s.labels["allocated"])
        for s in m["gpuid_gpu_holder_memory_used_bytes"]
    }
    assert {("0", f"llm-serve-{r}", "true") for r in range(3)} <= holders
    assert {("1", "train-0", "true"), ("4", "train-0", "true")} <= holders
    assert ("6", "stray-job", "false") in holders  # busy on a GPU nobody holds
    reasons = {
        (s.labels["gpu"], s.labels["reason"])
        for s in m["gpuid_gpu_unattributed_processes"]
        if s.value > 0
    }
    assert {("0", "host_process"), ("0", "pid_gone")} <= reasons
    state = {s.labels["gpu"]: s.labels["state"] for s in m["gpuid_gpu_allocation_state"] if s.value}
    assert state == {
        "0": "held_busy",
        **{str(i): "held_busy" for i in range(1, 5)},
        "5": "held_idle",  # the notebook holds it and runs nothing
        "6": "unowned_busy",
        "7": "free",
    }
    used = {s.labels["gpu"]: s.value for s in m["gpuid_gpu_memory_used_bytes"]}
    parts: dict[str, float] = {}
    for name in ("gpuid_gpu_holder_memory_used_bytes", "gpuid_gpu_unattributed_memory_used_bytes"):
        for s in m[name]:
            parts[s.labels["gpu"]] = parts.get(s.labels["gpu"], 0) + s.value
    for gpu, value in used.items():
        assert parts[gpu] == pytest.approx(value), gpu


def await_exists(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))
