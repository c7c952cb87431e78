"""The NVML source through the real pynvml and a fake libnvidia-ml.so.1 built from C."""

from __future__ import annotations

import dataclasses
import io
import threading

import aiohttp
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.runtime.errors import NvmlUnavailableError
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.source import NvmlSource
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakenvml.fixtures import FakeNvml
from tests.waiting import eventually


async def _read(fake: FakeNvml, config: fakenvml.FakeNvmlConfig, lib: str | None = None):  # type: ignore[no-untyped-def]
    fake.apply(config)
    source = NvmlSource(PynvmlApi(lib or str(fake.lib_path)))
    try:
        await source.init()
        return await source.read()
    finally:
        await source.close()


async def test_h100_layout(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    reading = await _read(fake_nvml, config)
    assert reading.driver_version == config.driver_version
    assert len(reading.gpus) == 8
    for gpu, want in zip(reading.gpus, config.gpus, strict=True):
        assert gpu.uuid == want.uuid
        assert gpu.serial == want.serial
        assert gpu.name == want.name
        assert gpu.pci_bus_id == want.pci_bus_id
        assert gpu.module_id == want.module_id
        assert gpu.minor_number == want.minor
        assert gpu.board_part_number == want.board_part_number
        assert gpu.platform is None  # H100: platform info NOT_SUPPORTED → no chassis
    assert len({g.serial for g in reading.gpus}) == 8
    assert (
        reading.samples[config.gpus[0].uuid].values["temperature_celsius"]
        == config.gpus[0].temperature
    )  # type: ignore[index]


async def test_gb200_layout_with_platform_info_v2(fake_nvml: FakeNvml) -> None:
    config = fakenvml.gb200x4()
    reading = await _read(fake_nvml, config)
    assert len(reading.gpus) == 4
    assert len({g.serial for g in reading.gpus}) == 2
    assert reading.gpus[0].serial == reading.gpus[1].serial != reading.gpus[2].serial
    for gpu, want in zip(reading.gpus, config.gpus, strict=True):
        assert gpu.platform is not None
        assert gpu.platform.chassis_serial == want.chassis_serial
        assert (gpu.platform.slot_number, gpu.platform.tray_index, gpu.platform.host_id) == (
            want.slot,
            want.tray,
            want.host_id,
        )
        assert gpu.platform.module_id == want.platform_module_id
        assert gpu.module_id == want.module_id
        assert gpu.platform.ib_guid == want.ib_guid
    assert reading.cuda_driver_version == "12.8"


FIELDS = [
    "serial",
    "name",
    "pci_bus_id",
    "minor",
    "module_id",
    "board_part_number",
    "platform_info",
    "mig_mode",
    "utilization",
    "memory",
    "temperature",
    "power_mw",
]


@pytest.mark.parametrize("field", FIELDS)
async def test_a_not_supported_field_is_absent_never_fatal(fake_nvml: FakeNvml, field: str) -> None:
    config = fakenvml.gb200x4()
    config.gpus[1].errors[field] = fakenvml.NVML_ERROR_NOT_SUPPORTED
    reading = await _read(fake_nvml, config)
    assert len(reading.gpus) == 4
    assert reading.errors == 0
    healthy, broken = reading.gpus[0], reading.gpus[1]
    identity_attr = {
        "minor": "minor_number",
        "platform_info": "platform",
        "mig_mode": "mig_enabled",
    }
    attr = identity_attr.get(field, field)
    if hasattr(broken, attr):
        assert getattr(broken, attr) is None
        assert getattr(healthy, attr) is not None
    else:
        sample_keys = {
            "utilization": "gpu_util",
            "memory": "memory_used_bytes",
            "temperature": "temperature_celsius",
            "power_mw": "power_watts",
        }[field]
        assert sample_keys not in reading.samples[broken.uuid].values
        assert sample_keys in reading.samples[healthy.uuid].values


async def test_other_nvml_errors_are_counted_not_fatal(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus[3].errors["serial"] = 999  # NVML_ERROR_UNKNOWN
    reading = await _read(fake_nvml, config)
    assert reading.gpus[3].serial is None
    assert reading.errors == 1
    assert len(reading.gpus) == 8


async def test_driver_without_platform_call(fake_nvml: FakeNvml) -> None:
    lib = fake_nvml.build(omit=["nvmlDeviceGetPlatformInfo"])
    fake_nvml.load(lib)
    reading = await _read(fake_nvml, fakenvml.gb200x4(), lib=str(lib))
    assert [g.platform for g in reading.gpus] == [None] * 4
    assert len({g.serial for g in reading.gpus}) == 2


async def test_mig_devices(fake_nvml: FakeNvml) -> None:
    config = fakenvml.mig_h100()
    reading = await _read(fake_nvml, config)
    gpu = reading.gpus[0]
    assert gpu.mig_enabled is True
    assert [m.uuid for m in gpu.mig_devices] == [m.uuid for m in config.gpus[0].mig]
    assert [m.profile for m in gpu.mig_devices] == ["3g.40gb", "1g.10gb"]
    assert [m.gpu_instance_id for m in gpu.mig_devices] == [m.gi_id for m in config.gpus[0].mig]
    assert all(m.uuid.startswith("MIG-") for m in gpu.mig_devices)


async def test_init_failure_is_reported(fake_nvml: FakeNvml) -> None:
    config = dataclasses.replace(fakenvml.h100x8(), init_error=9)  # DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded"):
        await _read(fake_nvml, config)


async def test_agent_keeps_serving_without_driver_and_recovers(fake_nvml: FakeNvml) -> None:
    fake_nvml.apply(dataclasses.replace(fakenvml.gb200x4(), init_error=9))
    s = settings(nvml_library_path=str(fake_nvml.lib_path))
    out = io.BytesIO()
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent,
        aiohttp.ClientSession() as http,
    ):
        url = f"http://127.0.0.1:{agent.bound_port}"
        await eventually(lambda: agent.board.get("nvml").state == "unavailable")  # type: ignore[union-attr]
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 503
            assert "Driver Not Loaded" in str(await resp.json())
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200
        fake_nvml.apply(fakenvml.gb200x4())  # the driver comes up: init is retried
        await eventually(lambda: agent.board.get("nvml").state == "ok")  # type: ignore[union-attr]
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 200
        await eventually(lambda: out.getvalue().count(b"\n") == 4)


async def test_gpu_lost_mid_run_keeps_identity_and_recovers(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    source = NvmlSource(PynvmlApi(str(fake_nvml.lib_path)))
    await source.init()
    try:
        first = await source.read()
        config.gpus[5].lost = True
        fake_nvml.apply(config)
        second = await source.read()
        assert 5 in second.lost
        assert [g.uuid for g in second.gpus] == [g.uuid for g in first.gpus]
        config.gpus[5].lost = False
        fake_nvml.apply(config)
        third = await source.read()
        assert third.lost == {}
    finally:
        await source.close()


async def test_nvml_calls_never_run_on_the_event_loop_thread() -> None:
    seen: set[str] = set()

    class Recording(SimulatedNvml):
        def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
            value = super().__getattribute__(name)
            if name.startswith("_") or not callable(value):
                return value

            def called(*args, **kwargs):  # type: ignore[no-untyped-def]
                seen.add(threading.current_thread().name)
                return value(*args, **kwargs)

            return called

    source = NvmlSource(Recording("h100x8", "n"))
    await source.init()
    await source.read()
    await source.close()
    assert seen
    assert all(name.startswith("nvml") for name in seen), seen
