"""NVLinks held to the GPU model's count and speed, and the PCIe AER counters, through the
real pynvml, the fake libnvidia-ml.so.1's field values and a running agent."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.facts import PcieAer
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.state.health.nvlink_models import MODELS, expected_nvlinks, parse_models
from tests import fakenvml
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on
from tests.waiting import eventually

SPEED = "164"  # NVML_FI_DEV_NVLINK_GET_SPEED
CORRECTABLE, NON_FATAL, FATAL = "173", "179", "180"


def _node(n: int = 4) -> fakenvml.FakeNvmlConfig:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=18) for g in config.gpus[:n]]
    for gpu in config.gpus:
        gpu.fields = {SPEED: 26562, CORRECTABLE: 0, NON_FATAL: 0, FATAL: 0}
    return config


def _read(config: fakenvml.FakeNvmlConfig) -> dict[int, Any]:
    api = PynvmlApi()
    api.init()
    try:
        return HealthReader(api).read({i: g.uuid or "" for i, g in enumerate(config.gpus)})
    finally:
        api.shutdown()


def test_one_field_values_call_reads_aer_counters_and_link_speeds(fake_nvml: FakeNvml) -> None:
    config = _node(2)
    config.gpus[0].fields |= {f"{SPEED}:3": 13281, CORRECTABLE: 7, FATAL: 1}
    config.gpus[1].fields = {}  # a driver that reports none of them
    fake_nvml.apply(config)
    signals = _read(config)
    links = signals[0].nvlinks
    assert signals[0].pcie_aer == PcieAer(correctable=7, non_fatal=0, fatal=1)
    assert [lk.speed_mbps for lk in links[:5]] == [26562, 26562, 26562, 13281, 26562]
    assert signals[1].pcie_aer is None and "pcie_aer" in signals[1].absent
    assert {lk.speed_mbps for lk in signals[1].nvlinks} == {None}


def test_a_driver_without_field_values_reads_everything_else(fake_nvml: FakeNvml) -> None:
    config = _node(1)
    fake_nvml.apply(config)
    fake_nvml.load(fake_nvml.build(omit=["nvmlDeviceGetFieldValues"]))
    signals = _read(config)
    assert signals[0].pcie_aer is None and "pcie_aer" in signals[0].absent
    assert signals[0].nvlinks is not None and len(signals[0].nvlinks) == 18
    assert not signals[0].failed


def test_the_model_table_names_only_modules_with_fixed_links() -> None:
    assert expected_nvlinks("NVIDIA H100 80GB HBM3").links == 18
    assert expected_nvlinks("NVIDIA A100-SXM4-80GB").links == 12
    assert expected_nvlinks("NVIDIA GB200").speed_mbps == 53125
    for card in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA L40S", None):
        assert expected_nvlinks(card) is None
    assert len(MODELS) >= 5
    with pytest.raises(ValueError, match=r"links 1\.\.18"):
        parse_models({"models": [{"model": "X", "name": "X", "links": 40, "speed_mbps": 1}]})


async def test_links_down_from_the_start_are_unhealthy_and_slow_links_degraded(
    fake_nvml: FakeNvml,
) -> None:
    config = _node(5)
    config.gpus[0].nvlink_down = 1 << 5  # down before the agent started
    config.gpus[1] = fakenvml.with_links(config.gpus[1], nvlinks=12)  # 6 links missing
    config.gpus[2].fields |= {f"{SPEED}:4": 13281}  # trained to half speed
    config.gpus[3].nvlink_down = (1 << 18) - 1  # no link ever up
    config.gpus[4].name = "NVIDIA H100 PCIe"  # a bridge card: no expectation
    config.gpus[4].nvlink_down = 1 << 2
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        down = run.check(0, "nvlink")
        assert (down.state, down.action) == ("unhealthy", "reboot")
        assert (
            down.reason == "NVLink 5 inactive since the agent started (17 of 18 up on a H100 SXM)"
        )
        short = run.check(1, "nvlink")
        assert short.state == "unhealthy"
        assert short.reason == "12 of the 18 NVLinks a H100 SXM has are reported"
        slow = run.check(2, "nvlink")
        assert (slow.state, slow.action) == ("degraded", "hardware_inspection")
        assert slow.reason == "NVLink slower than the GPU's other links (26562 MB/s): 4 at 13281"
        assert run.check(3, "nvlink").state == "unhealthy"  # all down from the start is news
        assert "0, 1, 2" in run.check(3, "nvlink").reason
        bridge = run.check(4, "nvlink")
        assert (bridge.state, bridge.reason) == (
            "degraded",
            "NVLink 2 inactive while 17 other links are up",
        )
        # a start with the link down is news once: one record, unhealthy from the first look
        [record] = await run.settled_health(1, check="nvlink", index=0)
        assert record["state"] == "unhealthy" and record["previous_state"] is None
        # the link comes up: healthy
        config.gpus[0].nvlink_down = 0
        fake_nvml.apply(config)
        await eventually(lambda: run.check(0, "nvlink").state == "healthy")


async def test_aer_counters_are_series_and_their_growth_degrades_the_link(
    fake_nvml: FakeNvml,
) -> None:
    config = _node(2)
    config.gpus[0].fields |= {CORRECTABLE: 3}
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert run.check(0, "pcie").state == "healthy"
        config.gpus[0].fields |= {NON_FATAL: 2}
        config.gpus[1].fields |= {CORRECTABLE: 150}
        fake_nvml.apply(config)
        uncorrectable = await eventually(
            lambda: run.check(0, "pcie") if run.check(0, "pcie").state == "degraded" else None
        )
        assert uncorrectable.action == "hardware_inspection"
        assert uncorrectable.reason.startswith(
            "2 uncorrectable PCIe AER errors (0 fatal) in the last"
        )
        correctable = await eventually(
            lambda: run.check(1, "pcie") if run.check(1, "pcie").state == "degraded" else None
        )
        assert correctable.reason.startswith("150 correctable PCIe AER errors in the last")
        _, text = await run.get("/gpu/metrics")
        series = {
            (s.labels["gpu"], s.labels["counter"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "gpuid_gpu_pcie_aer_errors"
            for s in f.samples
        }
        assert series[("0", "correctable")] == 3.0 and series[("0", "non_fatal")] == 2.0
        assert series[("1", "correctable")] == 150.0 and series[("0", "fatal")] == 0.0
        # the window passes without growth: healthy again (HEALTH_WINDOW is 0.4s here)
        await eventually(lambda: run.check(0, "pcie").state == "healthy")
