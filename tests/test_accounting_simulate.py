"""`--simulate timesliced`: over a window, the workloads' GPU-seconds add up to the held GPUs
times the window, the idle row to the rest, and the workloads' energy to the held GPUs' own
energy counters."""

from __future__ import annotations

import asyncio
import io
import time
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from tests.conftest import running_agent, settings
from tests.waiting import eventually

WINDOW = 5.0
HELD = {"0", "1", "2", "3", "4", "5"}  # 6 and 7: nobody holds them (simulate/process_tree.py)


def totals(text: bytes) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == "gpuid_workload_gpu_seconds_total":
                out["idle_s" if s.labels["namespace"] == "" else "held_s"] += s.value
            elif s.name == "gpuid_workload_gpu_energy_joules_total":
                out["idle_j" if s.labels["namespace"] == "" else "held_j"] += s.value
            elif s.name == "gpuid_gpu_energy_joules_total" and s.labels["gpu"] in HELD:
                out["gpus_j"] += s.value
            elif s.name == "gpuid_workload_device_seconds_total":
                out["device_s"] += s.value
    return out


async def test_timesliced_window_adds_up() -> None:
    agent = Agent(
        settings(simulate="timesliced", collect_interval=0.25, pod_resources_interval=0.05),
        exporters=[StdoutExporter(io.BytesIO())],
    )
    async with running_agent(agent):
        await eventually(
            lambda: (
                b'gpuid_workload_gpu_seconds_total{claim="",namespace="inference"'
                in agent.renderer.current().text
            )
        )
        await asyncio.sleep(1.0)  # a few collections with every holder in place
        first, t0 = totals(agent.renderer.current().text), time.monotonic()
        await asyncio.sleep(WINDOW)
        last, t1 = totals(agent.renderer.current().text), time.monotonic()
    d = {k: last[k] - first[k] for k in last}
    window = t1 - t0
    assert d["held_s"] == pytest.approx(len(HELD) * window, rel=0.15)
    assert d["idle_s"] == pytest.approx(2 * window, rel=0.15)
    # the GPUs' own time, exactly split: held + idle = GPUs x the time the snapshots covered
    assert d["held_s"] / (d["held_s"] + d["idle_s"]) == pytest.approx(len(HELD) / 8, rel=0.01)
    assert d["held_j"] == pytest.approx(d["gpus_j"], rel=0.05)
    assert d["held_j"] > 0 and d["idle_j"] > 0
