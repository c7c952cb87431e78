"""PCIe link and NVLink health through the real pynvml and the fake libnvidia-ml.so.1."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pynvml
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import node_health, running_agent, settings
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on
from tests.waiting import eventually


def _node(n: int = 4, *, nvlinks: int | None = 18) -> fakenvml.FakeNvmlConfig:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=nvlinks) for g in config.gpus[:n]]
    return config


def _samples(text: str, name: str) -> list[Any]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return list(families[name].samples) if name in families else []


def test_reader_reads_links_and_tells_no_nvlink_from_a_failed_read(fake_nvml: FakeNvml) -> None:
    config = _node(3)
    config.gpus[1] = fakenvml.with_links(fakenvml.h100x8().gpus[1], nvlinks=None)  # PCIe card
    config.gpus[0].nvlink_crc_flit = "0,0,0,9"
    config.gpus[0].nvlink_down = 1 << 2
    config.gpus[2].errors = {"nvmlDeviceGetNvLinkState": pynvml.NVML_ERROR_UNKNOWN}
    fake_nvml.apply(config)
    api = PynvmlApi()
    api.init()
    try:
        signals = HealthReader(api).read({i: g.uuid or "" for i, g in enumerate(config.gpus)})
    finally:
        api.shutdown()
    nv = signals[0].nvlinks
    assert nv is not None and len(nv) == 18
    assert [lk.link for lk in nv if not lk.active] == [2]
    assert nv[3].errors == (0, 0, 9, 0) and nv[4].errors == (0, 0, 0, 0)
    assert signals[0].pcie is not None and signals[0].pcie._asdict() == {
        "gen": 5,
        "max_gen": 5,
        "width": 16,
        "max_width": 16,
        "gpu_max_gen": 5,
    }
    assert signals[1].nvlinks is None and "no NVLink" in signals[1].absent["nvlink"]
    assert signals[2].nvlinks is None and "nvlink" in signals[2].failed


async def test_pcie_downtraining_is_one_transition_with_series_and_status(
    fake_nvml: FakeNvml,
) -> None:
    config = _node()
    for gpu in config.gpus:
        gpu.util_gpu = 0  # an idle node
        gpu.pcie_gen = 1  # idle links save power: no alarm
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert {run.check(i, "pcie").state for i in range(4)} == {"healthy"}
        config.gpus[1].pcie_width = 8
        fake_nvml.apply(config)
        pcie = await eventually(
            lambda: run.check(1, "pcie") if run.check(1, "pcie").state == "degraded" else None
        )
        assert pcie.reason == "PCIe link trained to x8 of x16"
        [record] = await run.settled_health(1, check="pcie")
        assert (record["index"], record["state"], record["previous_state"]) == (
            1,
            "degraded",
            "healthy",
        )
        assert record["action"] == "hardware_inspection" and "x8 of x16" in record["reason"]

        _, status = await run.get("/status")
        gpu1 = status["health"]["gpus"][1]
        assert gpu1["checks"]["pcie"]["state"] == "degraded"
        assert gpu1["pcie"] == {
            "gen": 1,
            "max_gen": 5,
            "width": 8,
            "max_width": 16,
            "gpu_max_gen": 5,
        }
        _, text = await run.get("/gpu/metrics")
        widths = {s.labels["gpu"]: s.value for s in _samples(text, "gpuid_gpu_pcie_link_width")}
        assert widths == {"0": 16.0, "1": 8.0, "2": 16.0, "3": 16.0}
        gens = {s.labels["gpu"]: s.value for s in _samples(text, "gpuid_gpu_pcie_link_generation")}
        assert gens["1"] == 1.0

        # GPU 2 gets busy on a link stuck at Gen3: degraded; busy at Gen5 again: healthy
        config.gpus[2].util_gpu, config.gpus[2].pcie_gen = 90, 3
        fake_nvml.apply(config)
        await eventually(lambda: run.check(2, "pcie").state == "degraded")
        assert run.check(2, "pcie").reason.startswith("PCIe link at Gen3 of Gen5 in ")
        config.gpus[2].pcie_gen = 5
        fake_nvml.apply(config)
        await eventually(lambda: run.check(2, "pcie").state == "healthy")
        assert [r["state"] for r in await run.settled_health(2, check="pcie", index=2)] == [
            "degraded",
            "healthy",
        ]
        assert run.check(0, "pcie").state == "healthy"  # idle at Gen1 all along


async def test_nvlink_down_and_errors_name_the_link_and_pcie_cards_are_not_applicable(
    fake_nvml: FakeNvml,
) -> None:
    config = _node()
    config.gpus[3] = fakenvml.with_links(fakenvml.h100x8().gpus[3], nvlinks=None)
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert run.check(3, "nvlink").state == "not_supported"
        config.gpus[0].nvlink_down = 1 << 3
        config.gpus[2].nvlink_crc_flit = ",".join(["0"] * 5 + ["12"])
        fake_nvml.apply(config)
        down = await eventually(
            lambda: run.check(0, "nvlink") if run.check(0, "nvlink").state == "unhealthy" else None
        )
        assert (down.reason, down.action) == ("NVLink 3 down", "reboot")
        errs = await eventually(
            lambda: run.check(2, "nvlink") if run.check(2, "nvlink").state == "degraded" else None
        )
        assert "link 5: 12 crc flit" in errs.reason
        [record] = await run.settled_health(1, check="nvlink", index=0)
        assert record["reason"] == "NVLink 3 down" and record["previous_state"] == "healthy"

        _, status = await run.get("/status")
        assert status["health"]["gpus"][0]["nvlink_down"] == [3]
        assert "nvlink_down" not in status["health"]["gpus"][3]
        _, text = await run.get("/gpu/metrics")
        up = {
            (s.labels["gpu"], s.labels["link"]): s.value
            for s in _samples(text, "gpuid_gpu_nvlink_up")
        }
        assert up[("0", "3")] == 0.0 and up[("0", "4")] == 1.0 and len(up) == 3 * 18
        assert not any(gpu == "3" for gpu, _ in up)  # no NVLink: no series
        crc = [
            s
            for s in _samples(text, "gpuid_gpu_nvlink_errors")
            if s.labels["counter"] == "crc_flit" and s.value
        ]
        assert [(s.labels["gpu"], s.value) for s in crc] == [("2", 12.0)]  # over all links
        assert not run.health(check="nvlink", index=3)


async def test_simulated_link_faults_show_as_health() -> None:
    out = io.BytesIO()
    faults = "pcie-down:gpu1,nvlink-down:gpu0:3@0.3s,nvlink-down:gpu3:7,nvlink-errors:gpu2:5"
    s = settings(simulate="h100x8", fault=faults, health_window=5.0)
    async with running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent:

        def check(index: int, name: str) -> Any:
            gpus = node_health(agent).gpus
            return next((g.checks.get(name) for g in gpus if g.index == index), None)

        await eventually(lambda: check(0, "nvlink") and check(0, "nvlink").state == "unhealthy")
        await eventually(lambda: check(2, "nvlink").state == "degraded")
        assert check(0, "nvlink").reason == "NVLink 3 down"
        assert check(1, "pcie").reason == "PCIe link trained to x8 of x16"
        # an H100 SXM has 18 links: one down from the start is unhealthy, not "degraded"
        late = check(3, "nvlink")
        assert (late.state, late.reason) == (
            "unhealthy",
            "NVLink 7 inactive since the agent started (17 of 18 up on a H100 SXM)",
        )
        assert "link 5:" in check(2, "nvlink").reason
        # the simulated links drop to Gen1 when idle: never an alarm
        assert {check(i, "pcie").state for i in (0, 2, 3, 4, 5, 6, 7)} == {"healthy"}
        await eventually(lambda: len(_health(out)) >= 4)
        health = {(r["check"], r["index"]): r for r in _health(out)}
        assert health[("pcie", 1)]["state"] == "degraded"
        # a fault there from the start still names who held the GPU: its transition waited
        # for the kubelet's first answer
        assert health[("pcie", 1)]["holders"] == [
            {"namespace": "ml", "pod": "train-0", "container": "trainer"}
        ]
        assert health[("nvlink", 0)]["reason"] == "NVLink 3 down"


def _health(out: io.BytesIO) -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
    return [r for r in rows if r["kind"] == "health"]
