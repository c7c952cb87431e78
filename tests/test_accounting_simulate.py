"""`--simulate timesliced`: over a window, the workloads' GPU-seconds add up to the held GPUs
times the window, the idle row to the rest, and the workloads' energy to the held GPUs' own
energy counters."""

from __future__ import annotations

import io
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.serving.renderer import Rendered
from gpuid_agent.state.snapshot import NodeSnapshot
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


async def rendered_from(agent: Agent, read_after: float) -> Rendered | None:
    """What /gpu/metrics serves, once it is of an NVML read taken after `read_after`."""
    rendered = await agent.renderer.rendered()
    if rendered.snapshot is None or read_time(rendered.snapshot) <= read_after:
        return None
    return rendered


def read_time(snapshot: NodeSnapshot) -> float:
    return snapshot.inventory.read_time.timestamp()


def all_held(agent: Agent) -> NodeSnapshot | None:
    """The latest snapshot, once its attribution has a holder on every GPU of HELD."""
    latest = agent.bus.latest
    if latest is None or latest.attribution.state != "current":
        return None
    gpus = latest.inventory.gpus
    held = {str(g.index) for g in gpus if latest.attribution.holders(g.uuid)}
    return latest if held == HELD else None


async def test_timesliced_window_adds_up() -> None:
    agent = Agent(
        settings(simulate="timesliced", collect_interval=0.25, pod_resources_interval=0.05),
        exporters=[StdoutExporter(io.BytesIO())],
    )
    async with running_agent(agent):
        # The window is the reads' own time: from a read after every holder was in place (the
        # split taken with all of them) to the first read WINDOW later, however late either
        # collection ran.
        settled = await eventually(lambda: all_held(agent))
        start = await eventually(lambda: rendered_from(agent, read_time(settled)))
        assert start.snapshot is not None
        t0 = read_time(start.snapshot)
        end = await eventually(lambda: rendered_from(agent, t0 + WINDOW))
        assert end.snapshot is not None and all_held(agent) is not None
        window = read_time(end.snapshot) - t0
    first, last = totals(start.text), totals(end.text)
    d = {k: last[k] - first[k] for k in last}
    assert d["held_s"] == pytest.approx(len(HELD) * window, rel=1e-6)
    assert d["idle_s"] == pytest.approx(2 * window, rel=1e-6)
    assert d["held_j"] == pytest.approx(d["gpus_j"], rel=1e-6)
    assert d["held_j"] > 0 and d["idle_j"] > 0
