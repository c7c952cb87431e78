"""The fake NVML library, exercised through the real pynvml."""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import (
    FakeGpu,
    FakeMig,
    FakeNvmlConfig,
    build_fake_nvml,
    gb200x4,
    h100x8,
    mig_h100,
)
from .fixtures import FakeNvml, fake_nvml, fake_nvml_build_dir, fake_nvml_lib

__all__ = ["fake_nvml", "fake_nvml_build_dir", "fake_nvml_lib"]

XID_EVENT = pynvml.nvmlEventTypeXidCriticalError


def addr(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def raw_bytes(struct: ctypes.Structure, name: str, size: int) -> bytes:
    """Raw bytes of a char-array field (pynvml's c_char arrays stop at NUL)."""
    offset = getattr(type(struct), name).offset
    return ctypes.string_at(ctypes.addressof(struct) + offset, size)


def platform_info(handle: object, version: int = pynvml.nvmlPlatformInfo_v2) -> ctypes.Structure:
    info: ctypes.Structure
    if version == pynvml.nvmlPlatformInfo_v1:
        info = pynvml.c_nvmlPlatformInfo_v1_t()
    else:
        info = pynvml.c_nvmlPlatformInfo_v2_t()
    pynvml.nvmlDeviceGetPlatformInfo(handle, ctypes.byref(info))
    return info


def byte_field(value: str) -> int:
    """Decode a one-byte platform-info field as read through pynvml.

    pynvml declares these fields as ``c_char`` and its ``_PrintableStructure``
    UTF-8-decodes every ``bytes`` attribute, so they read back as 1-char ``str``.
    """
    assert isinstance(value, str)
    assert len(value) == 1
    return ord(value)


def guid_bytes(text: str) -> bytes:
    digits = text.removeprefix("0x").replace(":", "").replace("-", "")
    return bytes.fromhex(digits).ljust(16, b"\0")


class Initialised:
    """nvmlInit on enter, nvmlShutdown on exit."""

    def __enter__(self) -> Initialised:
        pynvml.nvmlInit()
        return self

    def __exit__(self, *exc: object) -> None:
        pynvml.nvmlShutdown()


def assert_gpu_reads_back(handle: object, index: int, gpu: FakeGpu) -> None:
    assert pynvml.nvmlDeviceGetIndex(handle) == index
    assert pynvml.nvmlDeviceGetUUID(handle) == gpu.uuid
    assert pynvml.nvmlDeviceGetSerial(handle) == gpu.serial
    assert pynvml.nvmlDeviceGetName(handle) == gpu.name
    assert pynvml.nvmlDeviceGetBoardPartNumber(handle) == gpu.board_part_number
    assert pynvml.nvmlDeviceGetMinorNumber(handle) == gpu.minor
    assert pynvml.nvmlDeviceGetModuleId(handle) == gpu.module_id

    assert gpu.pci_bus_id is not None
    pci = pynvml.nvmlDeviceGetPciInfo(handle)
    assert pci.busId == gpu.pci_bus_id
    domain, bus, rest = gpu.pci_bus_id.split(":")
    device = rest.split(".")[0]
    assert (pci.domain, pci.bus, pci.device) == (int(domain, 16), int(bus, 16), int(device, 16))
    assert pci.busIdLegacy == f"{int(domain, 16):04X}:{bus}:{device}.0"
    assert pci.pciDeviceId == gpu.pci_device_id
    assert pci.pciSubSystemId == gpu.pci_subsystem_id

    assert pynvml.nvmlDeviceGetMigMode(handle) == [gpu.mig_mode, gpu.mig_mode]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 7
    assert pynvml.nvmlDeviceIsMigDeviceHandle(handle).value == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetComputeInstanceId(handle)
    assert pynvml.nvmlDeviceGetPersistenceMode(handle) == gpu.persistence_mode

    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    assert (util.gpu, util.memory) == (gpu.util_gpu, gpu.util_mem)
    assert pynvml.nvmlDeviceGetEncoderUtilization(handle)[0] == gpu.util_enc
    assert pynvml.nvmlDeviceGetDecoderUtilization(handle)[0] == gpu.util_dec

    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert (mem.total, mem.used, mem.free) == (gpu.mem_total, gpu.mem_used, gpu.mem_free)
    mem2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert (mem2.total, mem2.used, mem2.free, mem2.reserved) == (
        gpu.mem_total,
        gpu.mem_used,
        gpu.mem_free,
        0,
    )

    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == gpu.temperature
    assert pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU) == gpu.temperature
    assert pynvml.nvmlDeviceGetPowerUsage(handle) == gpu.power_mw
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == gpu.energy_mj
    assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) == gpu.clock_sm
    assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM) == gpu.clock_mem
    assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_GRAPHICS) == gpu.clock_sm
    assert pynvml.nvmlDeviceGetPcieReplayCounter(handle) == gpu.pcie_replay

    corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    vol, agg = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle, corrected, vol) == gpu.ecc_vol_corr
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle, uncorrected, vol) == gpu.ecc_vol_uncorr
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle, corrected, agg) == gpu.ecc_agg_corr
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle, uncorrected, agg) == gpu.ecc_agg_uncorr
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == gpu.retired_pending
    assert pynvml.nvmlDeviceGetRemappedRows(handle) == (
        gpu.remap_corr,
        gpu.remap_unc,
        gpu.remap_pending,
        gpu.remap_failure,
    )
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == gpu.clocks_event_reasons
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle) == gpu.clocks_event_reasons
    assert pynvml.nvmlDeviceGetSupportedEventTypes(handle) & XID_EVENT

    assert addr(pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)) == addr(handle)
    assert addr(pynvml.nvmlDeviceGetHandleByPciBusId(gpu.pci_bus_id)) == addr(handle)


def test_uninitialised_library_refuses_calls(fake_nvml: FakeNvml) -> None:
    fake_nvml.apply(h100x8())
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 8
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 8  # still one reference
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


def test_no_config_means_no_gpus(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKE_NVML_CONFIG")
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 0
        assert pynvml.nvmlSystemGetDriverVersion() == "570.86.15"
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByIndex(0)


def test_system_versions(fake_nvml: FakeNvml) -> None:
    config = gb200x4()
    config.cuda_driver_version = 12090
    fake_nvml.apply(config)
    with Initialised():
        assert pynvml.nvmlSystemGetDriverVersion() == "570.124.06"
        assert pynvml.nvmlSystemGetCudaDriverVersion() == 12090
        assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12090
        assert pynvml.nvmlSystemGetNVMLVersion() == "12.570.124.06"
        assert str(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "GPU is lost"
        assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_NO_DATA) == "No data"


def test_h100x8_reads_back(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 8
        for i, gpu in enumerate(config.gpus):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            assert_gpu_reads_back(handle, i, gpu)
            assert gpu.serial is not None
            assert len(gpu.serial) == 13
            assert gpu.serial.isdigit()
            assert gpu.chassis_serial is None
            with pytest.raises(pynvml.NVMLError_NotSupported):
                platform_info(handle)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetGpuFabricInfoV(
                    handle, ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t())
                )
        assert len({g.serial for g in config.gpus}) == 8
        assert len({g.uuid for g in config.gpus}) == 8
        assert [g.module_id for g in config.gpus] == list(range(1, 9))
        assert config.gpus[0].pci_bus_id == "00000000:18:00.0"


def test_gb200x4_reads_back(fake_nvml: FakeNvml) -> None:
    config = gb200x4()
    fake_nvml.apply(config)
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 4
        serials = []
        for i, gpu in enumerate(config.gpus):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            assert_gpu_reads_back(handle, i, gpu)
            serials.append(pynvml.nvmlDeviceGetSerial(handle))

            info = platform_info(handle)
            assert info.version == pynvml.nvmlPlatformInfo_v2
            assert info.chassisSerialNumber == gpu.chassis_serial == "1821324190123"
            assert byte_field(info.slotNumber) == gpu.slot
            assert byte_field(info.trayIndex) == gpu.tray
            assert byte_field(info.hostId) == gpu.host_id
            assert byte_field(info.peerType) == gpu.peer_type
            assert byte_field(info.moduleId) == gpu.platform_module_id == i + 1
            assert gpu.ib_guid is not None
            assert raw_bytes(info, "ibGuid", 16) == guid_bytes(gpu.ib_guid)

            cluster = uuid.UUID(str(gpu.fabric_cluster_uuid)).bytes
            fabric = pynvml.c_nvmlGpuFabricInfoV_t()
            assert fabric.version == pynvml.nvmlGpuFabricInfo_v2
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(fabric))
            assert bytes(fabric.clusterUuid) == cluster
            assert fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
            assert fabric.status == pynvml.NVML_SUCCESS
            assert fabric.cliqueId == gpu.fabric_clique_id
            assert fabric.healthMask == gpu.fabric_health_mask

            fabric3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(fabric3))
            assert fabric3.healthSummary == pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
            assert fabric3.cliqueId == gpu.fabric_clique_id

            legacy = pynvml.c_nvmlGpuFabricInfo_t()
            pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(legacy))
            assert (bytes(legacy.clusterUuid), legacy.cliqueId, legacy.state) == (
                cluster,
                gpu.fabric_clique_id,
                gpu.fabric_state,
            )
        assert serials[0] == serials[1] != serials[2] == serials[3]
        assert len({g.uuid for g in config.gpus}) == 4


def test_platform_info_v1_and_bad_version(fake_nvml: FakeNvml) -> None:
    config = gb200x4()
    config.gpus[0].rack_guid = "00112233445566778899aabbccddeeff"
    fake_nvml.apply(config)
    with Initialised():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = platform_info(handle, pynvml.nvmlPlatformInfo_v1)
        assert raw_bytes(info, "rackGuid", 16) == bytes.fromhex("00112233445566778899aabbccddeeff")
        assert byte_field(info.chassisPhysicalSlotNumber) == 7
        assert byte_field(info.computeSlotIndex) == 3
        assert byte_field(info.nodeIndex) == 1
        assert byte_field(info.moduleId) == 1
        bad = pynvml.c_nvmlPlatformInfo_v2_t()
        bad.version = 0x300002C
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetPlatformInfo(handle, ctypes.byref(bad))


def test_platform_info_high_bytes_need_raw_decoding(fake_nvml: FakeNvml) -> None:
    config = gb200x4()
    config.gpus[0].slot = 200
    config.gpus[0].ib_guid = "a088c20300" + "ff" * 11
    fake_nvml.apply(config)
    with Initialised():
        info = platform_info(pynvml.nvmlDeviceGetHandleByIndex(0))
        # attribute access UTF-8-decodes the c_char fields and fails on bytes >= 0x80
        with pytest.raises(UnicodeDecodeError):
            _ = info.slotNumber
        with pytest.raises(UnicodeDecodeError):
            _ = info.ibGuid
        raw = bytes(info)
        assert len(raw) == 44
        assert raw[4:20] == bytes.fromhex("a088c20300" + "ff" * 11)
        assert raw[20:36] == b"1821324190123\0\0\0"
        assert tuple(raw[36:41]) == (200, 3, 1, 0, 1)


def test_platform_module_id_falls_back_to_module_id(fake_nvml: FakeNvml) -> None:
    config = gb200x4()
    config.gpus[2].platform_module_id = None
    config.gpus[2].module_id = 9
    fake_nvml.apply(config)
    with Initialised():
        info = platform_info(pynvml.nvmlDeviceGetHandleByIndex(2))
        assert byte_field(info.moduleId) == 9


def test_per_field_errors(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[1].errors.update(
        {
            "power_mw": pynvml.NVML_ERROR_NOT_SUPPORTED,
            "temperature": pynvml.NVML_ERROR_INVALID_ARGUMENT,
            "nvmlDeviceGetSerial": pynvml.NVML_ERROR_NO_PERMISSION,
            "memory": pynvml.NVML_ERROR_UNKNOWN,
            "ecc_agg_uncorr": pynvml.NVML_ERROR_NOT_SUPPORTED,
            "module_id": pynvml.NVML_ERROR_NOT_SUPPORTED,
        }
    )
    config.gpus[1].util_enc = None
    fake_nvml.apply(config)
    with Initialised():
        bad = pynvml.nvmlDeviceGetHandleByIndex(1)
        good = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetPowerUsage(bad)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetTemperature(bad, pynvml.NVML_TEMPERATURE_GPU)
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetSerial(bad)
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetMemoryInfo(bad)
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetMemoryInfo(bad, version=pynvml.nvmlMemory_v2)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetTotalEccErrors(
                bad, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC
            )
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetModuleId(bad)
        with pytest.raises(pynvml.NVMLError_NotSupported):  # unset field
            pynvml.nvmlDeviceGetEncoderUtilization(bad)
        # other counters and other GPUs are unaffected
        assert (
            pynvml.nvmlDeviceGetTotalEccErrors(
                bad, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC
            )
            == config.gpus[1].ecc_agg_corr
        )
        assert pynvml.nvmlDeviceGetPowerUsage(good) == config.gpus[0].power_mw
        assert pynvml.nvmlDeviceGetSerial(good) == config.gpus[0].serial
        assert pynvml.nvmlDeviceGetUUID(bad) == config.gpus[1].uuid


def test_error_on_handle_lookup(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[3].errors["handle"] = pynvml.NVML_ERROR_NO_PERMISSION
    fake_nvml.apply(config)
    with Initialised():
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetHandleByIndex(3)
        pynvml.nvmlDeviceGetHandleByIndex(4)


def test_init_error(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    fake_nvml.apply(config)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    config.init_error = None
    fake_nvml.apply(config)
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 8


def test_mig_enumeration(fake_nvml: FakeNvml) -> None:
    config = mig_h100()
    fake_nvml.apply(config)
    with Initialised():
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
        assert count == 7
        found = []
        for j in range(count):
            try:
                found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j))
            except pynvml.NVMLError_NotFound:
                continue
        assert len(found) == 2
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, count)
        for mig_handle, mig in zip(found, config.gpus[0].mig, strict=True):
            assert pynvml.nvmlDeviceIsMigDeviceHandle(mig_handle).value == 1
            assert pynvml.nvmlDeviceGetUUID(mig_handle) == mig.uuid
            assert pynvml.nvmlDeviceGetName(mig_handle) == mig.name
            assert pynvml.nvmlDeviceGetGpuInstanceId(mig_handle) == mig.gi_id
            assert pynvml.nvmlDeviceGetComputeInstanceId(mig_handle) == mig.ci_id
            mem = pynvml.nvmlDeviceGetMemoryInfo(mig_handle)
            assert mig.mem_total is not None
            assert mig.mem_used is not None
            assert (mem.total, mem.used, mem.free) == (
                mig.mem_total,
                mig.mem_used,
                mig.mem_total - mig.mem_used,
            )
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_handle)
            assert addr(parent) == addr(gpu)
            assert mig.uuid is not None
            assert addr(pynvml.nvmlDeviceGetHandleByUUID(mig.uuid)) == addr(mig_handle)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetPowerUsage(mig_handle)
        assert pynvml.nvmlDeviceGetName(found[1]) == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(gpu)


def test_mig_disabled_has_no_mig_devices(fake_nvml: FakeNvml) -> None:
    config = mig_h100()
    config.gpus[0].mig_mode = 0
    config.gpus[0].mig_mode_pending = 1
    fake_nvml.apply(config)
    with Initialised():
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMigMode(gpu) == [0, 1]
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)


def test_gpu_lost(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[2].lost = True
    fake_nvml.apply(config)
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 8
        lost = pynvml.nvmlDeviceGetHandleByIndex(2)
        for call in (
            pynvml.nvmlDeviceGetUUID,
            pynvml.nvmlDeviceGetName,
            pynvml.nvmlDeviceGetPowerUsage,
            pynvml.nvmlDeviceGetMemoryInfo,
            pynvml.nvmlDeviceGetPciInfo,
            pynvml.nvmlDeviceGetIndex,
        ):
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                call(lost)
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(3)) == config.gpus[3].uuid
        # the GPU comes back without re-init
        config.gpus[2].lost = False
        fake_nvml.apply(config)
        assert pynvml.nvmlDeviceGetUUID(lost) == config.gpus[2].uuid


def test_lost_gpu_takes_its_mig_devices(fake_nvml: FakeNvml) -> None:
    config = mig_h100()
    fake_nvml.apply(config)
    with Initialised():
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        config.gpus[0].lost = True
        fake_nvml.apply(config)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(mig)


def test_handle_of_removed_gpu_reports_lost(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    with Initialised():
        last = pynvml.nvmlDeviceGetHandleByIndex(7)
        fake_nvml.apply(dataclasses.replace(config, gpus=config.gpus[:4]))
        assert pynvml.nvmlDeviceGetCount() == 4
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(last)


def test_xid_event_after_n_waits(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[5].xids.append((79, 2))
    fake_nvml.apply(config)
    with Initialised():
        event_set = pynvml.nvmlEventSetCreate()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
            for handle in handles:
                pynvml.nvmlDeviceRegisterEvents(handle, XID_EVENT, event_set)
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(pynvml.NVMLError_Timeout):
                    pynvml.nvmlEventSetWait_v2(event_set, 50)
                assert time.monotonic() - started >= 0.04
            data = pynvml.nvmlEventSetWait_v2(event_set, 50)
            assert addr(data.device) == addr(handles[5])
            assert pynvml.nvmlDeviceGetIndex(data.device) == 5
            assert data.eventType == XID_EVENT
            assert data.eventData == 79
            assert data.gpuInstanceId == 0xFFFFFFFF
            assert data.computeInstanceId == 0xFFFFFFFF
            with pytest.raises(pynvml.NVMLError_Timeout):  # delivered once
                pynvml.nvmlEventSetWait_v2(event_set, 10)
        finally:
            pynvml.nvmlEventSetFree(event_set)


def test_xid_needs_registration(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[0].xids.append((48, 0))
    fake_nvml.apply(config)
    with Initialised():
        event_set = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(
                pynvml.nvmlDeviceGetHandleByIndex(1), XID_EVENT, event_set
            )
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlEventSetWait_v2(event_set, 10)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceRegisterEvents(
                    pynvml.nvmlDeviceGetHandleByIndex(0), 1 << 40, event_set
                )
        finally:
            pynvml.nvmlEventSetFree(event_set)


def test_blocked_wait_does_not_block_readers_and_sees_new_xid(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    results: list[object] = []
    with Initialised():
        event_set = pynvml.nvmlEventSetCreate()
        try:
            for i in range(8):
                pynvml.nvmlDeviceRegisterEvents(
                    pynvml.nvmlDeviceGetHandleByIndex(i), XID_EVENT, event_set
                )

            def waiter() -> None:
                try:
                    results.append(pynvml.nvmlEventSetWait_v2(event_set, 20_000))
                except pynvml.NVMLError as exc:  # pragma: no cover - reported below
                    results.append(exc)

            thread = threading.Thread(target=waiter)
            started = time.monotonic()
            thread.start()
            time.sleep(0.1)  # a hold: with no event pending, the wait must not return
            assert thread.is_alive()
            for _ in range(50):
                for i in range(8):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    assert pynvml.nvmlDeviceGetPowerUsage(handle) == config.gpus[i].power_mw
            assert time.monotonic() - started < 5
            config.gpus[3].xids.append((94, 0))
            fake_nvml.apply(config)
            thread.join(timeout=10)
            assert not thread.is_alive()
            assert time.monotonic() - started < 10
        finally:
            pynvml.nvmlEventSetFree(event_set)
    assert len(results) == 1
    data = results[0]
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventData == 94


class CallInThread:
    """One NVML call on a thread of its own; `result` is its value or its NVMLError."""

    def __init__(self, call: Any, *args: Any) -> None:
        self.result: object = None
        self.thread = threading.Thread(target=self._run, args=(call, *args), daemon=True)
        self.thread.start()

    def _run(self, call: Any, *args: Any) -> None:
        try:
            self.result = call(*args)
        except pynvml.NVMLError as exc:
            self.result = exc


def test_block_hangs_one_call_until_the_statement_goes(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    config.gpus[2].blocks["power"] = 3600
    fake_nvml.apply(config)
    with Initialised():
        hung = CallInThread(pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetHandleByIndex(2))
        # everything else goes on meanwhile: the hung call does not hold the library
        for i in range(8):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            assert pynvml.nvmlDeviceGetTemperature(handle, 0) == config.gpus[i].temperature
            if i != 2:
                assert pynvml.nvmlDeviceGetPowerUsage(handle) == config.gpus[i].power_mw
        assert hung.thread.is_alive()
        config.gpus[2].blocks.clear()
        fake_nvml.apply(config)
        hung.thread.join(timeout=10)
        assert not hung.thread.is_alive()
        assert hung.result == config.gpus[2].power_mw


def test_block_by_symbol_and_by_seconds(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    with Initialised():
        config.blocks["nvmlSystemGetDriverVersion"] = 3600
        config.gpus[0].blocks["nvmlDeviceGetUUID"] = 0.05  # a short hang, then the value
        fake_nvml.apply(config)
        hung = CallInThread(pynvml.nvmlSystemGetDriverVersion)
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)) == config.gpus[0].uuid
        assert pynvml.nvmlDeviceGetCount() == 8
        assert hung.thread.is_alive()
        # a shutdown while the call hangs: it wakes to an uninitialised library
        pynvml.nvmlShutdown()
        config.blocks.clear()
        fake_nvml.apply(config)
        hung.thread.join(timeout=10)
        assert isinstance(hung.result, pynvml.NVMLError_Uninitialized)
        pynvml.nvmlInit()


def test_malformed_block_lines_are_ignored(fake_nvml: FakeNvml) -> None:
    fake_nvml.write_text(
        "gpu 0 power_mw 100\n"
        "gpu 0 block power\n"
        "gpu 0 block power -1\n"
        "gpu 0 block power nan\n"
        "gpu 0 block power 5s\n"
        "block nvmlDeviceGetCount\n"
    )
    with Initialised():
        assert pynvml.nvmlDeviceGetCount() == 1
        assert pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(0)) == 100


def test_concurrent_readers_and_rewrites(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    errors: list[BaseException] = []
    stop = threading.Event()
    allowed = {70_000} | set(range(1, 41))

    def reader() -> None:
        try:
            while not stop.is_set():
                for i in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    if i == 0:
                        assert pynvml.nvmlDeviceGetPowerUsage(handle) in allowed
                    pynvml.nvmlDeviceGetUUID(handle)
                    pynvml.nvmlDeviceGetMemoryInfo(handle)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with Initialised():
        threads = [threading.Thread(target=reader) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            for watts in range(1, 41):
                config.gpus[0].power_mw = watts
                fake_nvml.apply(config)
            time.sleep(0.05)  # the readers go on reading the last state for a moment
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == 40
    assert not errors, errors


def test_omitted_symbol_raises_function_not_found(fake_nvml: FakeNvml) -> None:
    lib = fake_nvml.build(omit=("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetPlatformInfo"))
    assert lib != fake_nvml.lib_path
    fake_nvml.load(lib)
    fake_nvml.apply(gb200x4())
    with Initialised():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            platform_info(handle)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetGpuFabricInfoV(
                handle, ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t())
            )
        assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA GB200"
    # switching back to the full library is honoured in the same process
    fake_nvml.load()
    with Initialised():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert byte_field(platform_info(handle).moduleId) == 1


def test_build_is_cached(fake_nvml_build_dir: Path, fake_nvml_lib: Path) -> None:
    assert build_fake_nvml(fake_nvml_build_dir) == fake_nvml_lib
    assert fake_nvml_lib.name == "libnvidia-ml.so.1"
    with pytest.raises(ValueError, match="identifier"):
        build_fake_nvml(fake_nvml_build_dir, omit=("bad name",))


def test_rewritten_config_seen_without_reinit(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    with Initialised():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == 70_000
        # several rewrites within one timestamp tick are all noticed
        for watts in range(1, 6):
            config.gpus[0].power_mw = watts
            fake_nvml.apply(config)
            assert pynvml.nvmlDeviceGetPowerUsage(handle) == watts
        config.gpus.append(dataclasses.replace(config.gpus[0], uuid="GPU-new"))
        fake_nvml.apply(config)
        assert pynvml.nvmlDeviceGetCount() == 9


SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import pynvml
    pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
    pynvml.nvmlInit()
    def report():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetPowerUsage(handle), flush=True)
    report()
    sys.stdin.readline()
    report()
    pynvml.nvmlShutdown()
    """
)


def test_running_process_sees_rewritten_config(fake_nvml: FakeNvml) -> None:
    config = h100x8()
    fake_nvml.apply(config)
    with subprocess.Popen(
        [sys.executable, "-c", SUBPROCESS_SCRIPT, str(fake_nvml.lib_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["8", "70000"]
        config.gpus = config.gpus[:2]
        config.gpus[0].power_mw = 123_456
        fake_nvml.apply(config)
        out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == ["2", "123456"]


def test_hand_written_file_is_parsed_leniently(fake_nvml: FakeNvml) -> None:
    fake_nvml.write_text(
        textwrap.dedent(
            """\
            # comment
               # indented comment
            unknown_top_level 1 2 3
            driver_version   575.51.03\t \t
            gpu 1 name NVIDIA Test  GPU
            gpu 1 power_mw 0x10
            gpu 1 power_mw 250000
            gpu 1 unknown_key whatever
            gpu 1 temperature not-a-number
            gpu 1 error
            gpu notanumber name x
            gpu 9999 name too far
            """
        )
    )
    with Initialised():
        assert pynvml.nvmlSystemGetDriverVersion() == "575.51.03"
        assert pynvml.nvmlDeviceGetCount() == 2
        gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetUUID(gpu0).startswith("GPU-")
        assert pynvml.nvmlDeviceGetMinorNumber(gpu0) == 0
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetSerial(gpu0)
        gpu1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetName(gpu1) == "NVIDIA Test  GPU"
        assert pynvml.nvmlDeviceGetPowerUsage(gpu1) == 250_000
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetTemperature(gpu1, pynvml.NVML_TEMPERATURE_GPU)
        assert pynvml.nvmlDeviceGetPciInfo(gpu1).busId == "00000000:11:00.0"


def test_small_buffer_gives_insufficient_size(fake_nvml: FakeNvml) -> None:
    fake_nvml.apply(h100x8())
    with Initialised():
        assert fake_nvml.lib is not None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        buf = ctypes.create_string_buffer(8)
        rc = fake_nvml.lib.nvmlDeviceGetName(handle, buf, ctypes.c_uint(8))
        assert rc == pynvml.NVML_ERROR_INSUFFICIENT_SIZE


def test_render_format() -> None:
    config = FakeNvmlConfig(
        gpus=[
            FakeGpu(
                uuid="GPU-1",
                name="NVIDIA X",
                power_mw=5,
                errors={"platform_info": 3},
                xids=[(79, 4)],
                mig=[FakeMig(uuid="MIG-1", gi_id=1), FakeMig()],
            )
        ],
        init_error=9,
    )
    assert config.render().splitlines() == [
        "# fake NVML configuration",
        "init_error 9",
        "driver_version 570.86.15",
        "cuda_driver_version 12080",
        "gpu 0 lost 0",
        "gpu 0 uuid GPU-1",
        "gpu 0 name NVIDIA X",
        "gpu 0 power_mw 5",
        "gpu 0 error platform_info 3",
        "gpu 0 xid 79 4",
        "gpu 0 mig 0 uuid MIG-1",
        "gpu 0 mig 0 gi_id 1",
        "gpu 0 mig 1 defined 1",
    ]
    with pytest.raises(ValueError, match="single line"):
        FakeNvmlConfig(gpus=[FakeGpu(name="a\nb")]).render()


U32 = st.integers(min_value=0, max_value=2**32 - 1)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    power=U32,
    energy=st.integers(min_value=0, max_value=2**64 - 1),
    reasons=st.integers(min_value=0, max_value=2**64 - 1),
    temperature=st.integers(min_value=0, max_value=120),
    mem_total=st.integers(min_value=0, max_value=2**64 - 1),
    serial=st.text(alphabet="0123456789ABCDEFabcdef-_ .", min_size=1, max_size=29).filter(
        lambda s: s.strip() == s
    ),
)
def test_values_round_trip(
    fake_nvml: FakeNvml,
    power: int,
    energy: int,
    reasons: int,
    temperature: int,
    mem_total: int,
    serial: str,
) -> None:
    gpu = FakeGpu(
        power_mw=power,
        energy_mj=energy,
        clocks_event_reasons=reasons,
        temperature=temperature,
        mem_total=mem_total,
        mem_used=0,
        serial=serial,
    )
    fake_nvml.apply(FakeNvmlConfig(gpus=[gpu]))
    with Initialised():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == power
        assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == energy
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == reasons
        assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == temperature
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        assert (mem.total, mem.free, mem.used) == (mem_total, mem_total, 0)
        assert pynvml.nvmlDeviceGetSerial(handle) == serial
