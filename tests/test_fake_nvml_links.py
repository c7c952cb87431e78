"""The fake libnvidia-ml's PCIe link and NVLink calls, through the real pynvml."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import fakenvml
from tests.fakenvml.fixtures import FakeNvml


@pytest.fixture
def nvml(fake_nvml: FakeNvml) -> Iterator[FakeNvml]:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=4) for g in config.gpus[:2]]
    config.gpus[1].nvlink_links = None  # a PCIe card
    fake_nvml.apply(config)
    pynvml.nvmlInit()
    try:
        yield fake_nvml
    finally:
        pynvml.nvmlShutdown()


def _code(call, *args) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(pynvml.NVMLError) as info:
        call(*args)
    return int(info.value.value)


def test_pcie_values_change_mid_run_and_errors_match_the_group(nvml: FakeNvml) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(h) == 16
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h) == 5
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=4) for g in config.gpus[:2]]
    config.gpus[0].pcie_width, config.gpus[0].pcie_gen = 8, 3
    config.gpus[1].errors = {"pcie": pynvml.NVML_ERROR_UNKNOWN}
    nvml.apply(config)
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(h) == 8  # no re-init: the next call sees it
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h) == 3
    h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
    for call in (
        pynvml.nvmlDeviceGetCurrPcieLinkWidth,
        pynvml.nvmlDeviceGetMaxPcieLinkWidth,
        pynvml.nvmlDeviceGetCurrPcieLinkGeneration,
        pynvml.nvmlDeviceGetMaxPcieLinkGeneration,
        pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration,
    ):
        assert _code(call, h1) == pynvml.NVML_ERROR_UNKNOWN
    config.gpus[1].errors = {}
    config.gpus[1].pcie_gpu_max_gen = None
    nvml.apply(config)
    assert (
        _code(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, h1) == pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_nvlink_links_end_with_invalid_argument_and_pcie_cards_are_not_supported(
    nvml: FakeNvml,
) -> None:
    h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    assert [pynvml.nvmlDeviceGetNvLinkState(h0, link) for link in range(4)] == [1, 1, 1, 1]
    assert _code(pynvml.nvmlDeviceGetNvLinkState, h0, 4) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert _code(pynvml.nvmlDeviceGetNvLinkErrorCounter, h0, 0, 4) == (
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert _code(pynvml.nvmlDeviceGetNvLinkState, h1, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=4) for g in config.gpus[:2]]
    config.gpus[0].nvlink_down = 0b1010
    config.gpus[0].nvlink_recovery = "0,7"
    config.gpus[1].lost = True
    nvml.apply(config)
    assert [pynvml.nvmlDeviceGetNvLinkState(h0, link) for link in range(4)] == [1, 0, 1, 0]
    recovery = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
    counts = [pynvml.nvmlDeviceGetNvLinkErrorCounter(h0, link, recovery) for link in range(4)]
    assert counts == [0, 7, 0, 0]  # positions past the list read 0
    assert _code(pynvml.nvmlDeviceGetNvLinkState, h1, 0) == pynvml.NVML_ERROR_GPU_IS_LOST


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(alphabet="0123456789,x- \t", max_size=60), st.integers(0, 3))
def test_hostile_counter_lists_read_as_numbers(nvml: FakeNvml, listed: str, link: int) -> None:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=4) for g in config.gpus[:2]]
    config.gpus[0].nvlink_crc_data = listed.strip() or None
    nvml.apply(config)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    crc_data = pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA
    if listed.strip():
        assert 0 <= pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, crc_data) < 2**64
    else:
        assert _code(pynvml.nvmlDeviceGetNvLinkErrorCounter, h, link, crc_data) == (
            pynvml.NVML_ERROR_NOT_SUPPORTED
        )
