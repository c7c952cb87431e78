"""A hung NVML call, through the real pynvml and the C fake library told to block: the waiter
gets NvmlStalledError, `stalled()` names the call, later calls run on a fresh thread once the
driver answers again, and close() does not wait on the hung call."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import pynvml
import pytest

from gpuid_agent.runtime.errors import GpuLostError, NvmlStalledError
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.source import MAX_HUNG_THREADS, NvmlSource
from tests import fakenvml
from tests.fakenvml.fixtures import FakeNvml
from tests.waiting import eventually

BOUND = 0.3  # the call bound of these sources; short, as nothing waits for it to pass but hangs


def nvml_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nvml_")]


@pytest.fixture
async def hang(fake_nvml: FakeNvml) -> AsyncIterator[fakenvml.FakeNvmlConfig]:
    """An 8-GPU node whose GPU 1 power reads hang until the test (or teardown) lifts it."""
    config = fakenvml.h100x8()
    config.gpus[1].blocks["power"] = 3600
    fake_nvml.apply(config)
    before = set(nvml_threads())
    yield config
    config.gpus[1].blocks.clear()
    config.blocks.clear()
    fake_nvml.apply(config)
    # the hung threads return once the block is gone, before the library is shut down
    await eventually(lambda: not (set(nvml_threads()) - before), within=10)


def source(fake: FakeNvml, bound: float = BOUND) -> NvmlSource:
    return NvmlSource(PynvmlApi(str(fake.lib_path)), call_timeout=bound)


async def test_hung_call_is_stalled_then_recovers_on_a_fresh_thread(
    fake_nvml: FakeNvml, hang: fakenvml.FakeNvmlConfig
) -> None:
    nvml = source(fake_nvml)
    try:
        assert nvml.stalled() is None
        await nvml.init()
        first = nvml._thread
        with pytest.raises(NvmlStalledError, match="power_usage_mw"):
            await nvml.read()
        reason = nvml.stalled()
        assert reason is not None and "power_usage_mw" in reason.text and "(read)" in reason.text
        assert not nvml.initialised  # re-initialised on the next thread
        assert nvml._thread is not first and first.alive
        assert all(t.daemon for t in nvml_threads())

        hang.gpus[1].blocks.clear()
        fake_nvml.apply(hang)
        await eventually(lambda: nvml.stalled() is None, within=10)
        await nvml.init()
        reading = await nvml.read()
        assert [g.uuid for g in reading.gpus] == [g.uuid for g in hang.gpus]
        assert reading.samples[hang.gpus[1].uuid].values["power_watts"] == (
            hang.gpus[1].power_mw / 1000  # type: ignore[operator]
        )
        assert not first.alive
    finally:
        await nvml.close(1.0)


async def test_running_call_is_stalled_only_past_its_bound(
    fake_nvml: FakeNvml, hang: fakenvml.FakeNvmlConfig
) -> None:
    nvml = source(fake_nvml, bound=2.0)
    await nvml.init()
    read = asyncio.create_task(nvml.read())
    try:
        await eventually(lambda: "power_usage_mw" in str(nvml._thread.busy()), within=10)
        assert nvml.stalled() is None  # running, but not past the bound the source was given
        reason = await eventually(nvml.stalled, within=10)
        assert "power_usage_mw" in reason.text
        with pytest.raises(NvmlStalledError):
            await read
    finally:
        read.cancel()
        await nvml.close(0.1)


async def test_close_does_not_wait_for_a_hung_call(
    fake_nvml: FakeNvml, hang: fakenvml.FakeNvmlConfig
) -> None:
    nvml = source(fake_nvml, bound=60.0)
    await nvml.init()
    read = asyncio.create_task(nvml.read())
    await eventually(lambda: "power_usage_mw" in str(nvml._thread.busy()), within=10)
    # nvmlShutdown queues behind the hung call: close gives it its bound and leaves
    await asyncio.wait_for(nvml.close(0.2), timeout=30)
    assert not nvml.initialised
    read.cancel()
    with pytest.raises((asyncio.CancelledError, NvmlStalledError)):
        await read


async def test_hung_shutdown_is_left_behind(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.blocks["nvmlShutdown"] = 3600
    fake_nvml.apply(config)
    before = set(nvml_threads())
    nvml = source(fake_nvml)
    try:
        await nvml.init()
        assert len((await nvml.read()).gpus) == 8
        await asyncio.wait_for(nvml.close(0.2), timeout=30)
        assert nvml.stalled() is not None  # the shutdown call is still in the driver
    finally:
        config.blocks.clear()
        fake_nvml.apply(config)
        await eventually(lambda: not (set(nvml_threads()) - before), within=10)


async def test_hung_threads_are_bounded(fake_nvml: FakeNvml, hang: fakenvml.FakeNvmlConfig) -> None:
    nvml = source(fake_nvml)
    try:
        for _ in range(MAX_HUNG_THREADS):
            await nvml.init()
            with pytest.raises(NvmlStalledError):
                await nvml.read()
        # a driver that hangs every call costs a few threads, then calls fail at once
        with pytest.raises(NvmlStalledError, match="NVML call hung") as raised:
            await nvml.init()
        assert raised.value.figures["calls_given_up"] == MAX_HUNG_THREADS
        assert len(nvml_threads()) <= MAX_HUNG_THREADS + 1
    finally:
        await nvml.close(0.1)


async def test_health_read_is_bounded_too(
    fake_nvml: FakeNvml, hang: fakenvml.FakeNvmlConfig
) -> None:
    from gpuid_agent.sources.nvml.health import HealthReader

    hang.gpus[1].blocks.clear()
    hang.gpus[2].blocks["ecc"] = 3600
    fake_nvml.apply(hang)
    nvml = source(fake_nvml)
    try:
        await nvml.init()
        reader = HealthReader(nvml.reader.api)
        with pytest.raises(NvmlStalledError, match="ecc_errors"):
            await nvml.run(lambda: reader.read({i: g.uuid or "" for i, g in enumerate(hang.gpus)}))
    finally:
        hang.gpus[2].blocks.clear()
        await nvml.close(0.1)


# ---- the tolerant field helper ------------------------------------------------------------


def failing(code: int):  # type: ignore[no-untyped-def]
    def call() -> int:
        raise pynvml.NVMLError(code)

    return call


ABSENT_CODES = [
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_NO_DATA,
]


@pytest.mark.parametrize("code", ABSENT_CODES)
def test_absent_codes_are_not_errors(code: int) -> None:
    calls = FieldCalls(logging.getLogger("test"))
    absent: dict[str, str] = {}
    failed: dict[str, str] = {}
    assert calls.get(0, "power", failing(code), absent=absent, failed=failed) is None
    assert "power" in absent and not failed and calls.errors == 0


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED])
def test_lost_codes_raise_gpu_lost(code: int) -> None:
    calls = FieldCalls(logging.getLogger("test"))
    with pytest.raises(GpuLostError) as lost:
        calls.get(3, "power", failing(code))
    assert lost.value.index == 3 and lost.value.code == code


def test_malformed_values_are_logged_once_and_survived(caplog: pytest.LogCaptureFixture) -> None:
    calls = FieldCalls(logging.getLogger("test.fields"))

    def malformed() -> str:
        return b"\xff".decode()

    failed: dict[str, str] = {}
    for _ in range(3):
        assert calls.get(0, "serial", malformed, failed=failed) is None
    assert calls.errors == 3 and failed["serial"].startswith("malformed value")
    assert len([r for r in caplog.records if "malformed serial" in r.getMessage()]) == 1
    assert calls.get(0, "serial", lambda: "ok") == "ok"
    calls.get(0, "serial", malformed)  # read again after recovering: warned again
    assert len([r for r in caplog.records if "malformed serial" in r.getMessage()]) == 2
    assert calls.get(0, "x", failing(pynvml.NVML_ERROR_UNKNOWN), failed=failed) is None
    assert failed["x"].startswith("NVML error")
