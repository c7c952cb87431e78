"""NVML's process lists and per-process samples through the real pynvml and the C fake
libnvidia-ml: compute and MPS processes, MIG instance ids, both utilization calls, and the
answers a driver gives where it has no such data."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.process_reader import ProcessReader
from gpuid_agent.sources.nvml.process_values import GpuProcesses, ProcessInfo
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.source import NvmlSource
from tests import fakenvml
from tests.fakenvml import FakeProcess, FakeProcessUtil
from tests.fakenvml.fixtures import FakeNvml

GIB = 1024**3
NOT_SUPPORTED, GPU_IS_LOST = 3, 15


async def read_twice(
    fake: FakeNvml, config: fakenvml.FakeNvmlConfig, lib: str | None = None
) -> tuple[list[GpuIdentity], dict[str, GpuProcesses], dict[str, GpuProcesses]]:
    fake.apply(config)
    source = NvmlSource(PynvmlApi(lib or str(fake.lib_path)))
    reader = ProcessReader(FieldCalls(logging.getLogger("test")))
    try:
        await source.init()
        gpus = list((await source.read()).gpus)
        first = await source.run(lambda: reader.read(source.reader.api, gpus))
        second = await source.run(lambda: reader.read(source.reader.api, gpus))
        return gpus, first, second
    finally:
        await source.close()


def node_with_processes() -> fakenvml.FakeNvmlConfig:
    config = fakenvml.h100x8()
    g0, g1, g2 = config.gpus[:3]
    g0.processes = [FakeProcess(4101, 20 * GIB), FakeProcess(4102, 5 * GIB)]
    g0.mps_processes = [FakeProcess(4103, GIB), FakeProcess(4101, 20 * GIB)]  # in both lists
    g0.process_util = [
        FakeProcessUtil(4101, 60),
        FakeProcessUtil(4101, 40),  # two samples in the window: averaged
        FakeProcessUtil(4102, 130),  # out of range: clamped
    ]
    g1.processes = [FakeProcess(5000, None)]  # the driver does not say (WDDM, some vGPUs)
    g2.processes = [FakeProcess(6000, GIB)]
    g2.errors = {"process_util": NOT_SUPPORTED, "nvmlDeviceGetMPSComputeRunningProcesses_v3": 3}
    config.gpus[3].errors = {"processes": GPU_IS_LOST}
    return config


async def test_compute_mps_and_samples_per_gpu(fake_nvml: FakeNvml) -> None:
    config = node_with_processes()
    gpus, first, _ = await read_twice(fake_nvml, config)
    u = [g.uuid for g in gpus]
    g0 = first[u[0]]
    assert {p.pid: (p.used_memory, p.mps) for p in g0.processes} == {
        4101: (20 * GIB, False),
        4102: (5 * GIB, False),
        4103: (GIB, True),
    }
    assert all(p.gpu_instance_id is None for p in g0.processes)
    assert g0.sm_util == {4101: 50.0, 4102: 100.0}
    assert first[u[1]].processes == (ProcessInfo(5000, None),)
    # NOT_SUPPORTED for samples and the MPS list: absent, the compute list still read
    assert first[u[2]].processes == (ProcessInfo(6000, GIB),)
    assert first[u[2]].sm_util is None
    assert first[u[3]].failed and not first[u[3]].processes  # lost: that GPU only
    assert first[u[4]] == GpuProcesses(u[4], (), {})  # idle GPU: read, empty


async def test_samples_are_read_once_past_the_last_seen_timestamp(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    stamp = time.time_ns() // 1000 - 5_000_000
    config.gpus[0].processes = [FakeProcess(7, GIB)]
    config.gpus[0].process_util = [FakeProcessUtil(7, 80, timestamp_us=stamp)]
    gpus, first, second = await read_twice(fake_nvml, config)
    assert first[gpus[0].uuid].sm_util == {7: 80.0}
    # nothing newer: NVML answers NOT_FOUND, read as "no process ran kernels"
    assert second[gpus[0].uuid].sm_util == {}


async def test_older_utilization_call_where_the_newer_is_missing(fake_nvml: FakeNvml) -> None:
    lib = fake_nvml.build(omit=["nvmlDeviceGetProcessesUtilizationInfo"])
    config = fakenvml.h100x8()
    config.gpus[0].processes = [FakeProcess(7, GIB)]
    config.gpus[0].process_util = [FakeProcessUtil(7, 33)]
    gpus, first, _ = await read_twice(fake_nvml, config, str(lib))
    assert first[gpus[0].uuid].sm_util == {7: 33.0}


async def test_driver_without_any_process_call(fake_nvml: FakeNvml) -> None:
    lib = fake_nvml.build(
        omit=[
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
            "nvmlDeviceGetProcessesUtilizationInfo",
            "nvmlDeviceGetProcessUtilization",
        ]
    )
    gpus, first, _ = await read_twice(fake_nvml, node_with_processes(), str(lib))
    assert all(r.processes == () and r.sm_util is None for r in first.values())
    assert not any(r.failed for r in first.values() if r.gpu_uuid != gpus[3].uuid)


async def test_mig_processes_carry_their_instance_ids(fake_nvml: FakeNvml) -> None:
    config = fakenvml.mig_h100()
    mig = config.gpus[0].mig
    config.gpus[0] = dataclasses.replace(
        config.gpus[0],
        processes=[
            FakeProcess(11, 3 * GIB, mig[0].gi_id, mig[0].ci_id),
            FakeProcess(12, GIB, mig[1].gi_id, mig[1].ci_id),
        ],
    )
    gpus, first, _ = await read_twice(fake_nvml, config)
    got = {p.pid: (p.gpu_instance_id, p.compute_instance_id) for p in first[gpus[0].uuid].processes}
    assert got == {11: (mig[0].gi_id, mig[0].ci_id), 12: (mig[1].gi_id, mig[1].ci_id)}


async def test_the_c_calls_follow_nvmls_two_call_protocol(fake_nvml: FakeNvml) -> None:
    """What pynvml relies on: a NULL array answers INSUFFICIENT_SIZE with the count, an
    unknown structure version is refused, an empty list is SUCCESS with 0."""
    import ctypes

    import pynvml

    config = fakenvml.h100x8()
    config.gpus[0].processes = [FakeProcess(1, 1), FakeProcess(2, 2), FakeProcess(3, 3)]
    config.gpus[0].process_util = [FakeProcessUtil(1, 10)]
    fake_nvml.apply(config)
    pynvml.nvmlInit()
    try:
        lib = fake_nvml.lib
        assert lib is not None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        count = ctypes.c_uint(0)
        fn = lib.nvmlDeviceGetComputeRunningProcesses_v3
        assert fn(handle, ctypes.byref(count), None) == 7 and count.value == 3
        count.value = 1  # too small an array
        array = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
        assert fn(handle, ctypes.byref(count), array) == 7 and count.value == 3
        idle = pynvml.nvmlDeviceGetHandleByIndex(1)
        count.value = 0
        assert fn(idle, ctypes.byref(count), None) == 0 and count.value == 0
        info = pynvml.c_nvmlProcessesUtilizationInfo_v1_t()
        info.version = 0x02000018
        assert lib.nvmlDeviceGetProcessesUtilizationInfo(handle, ctypes.byref(info)) == 25
        with pytest.raises(pynvml.NVMLError_NotFound):  # no samples: NOT_FOUND, as drivers say
            pynvml.nvmlDeviceGetProcessesUtilizationInfo(idle, 0)
        (sample,) = pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0)
        assert (sample.pid, sample.smUtil) == (1, 10)
    finally:
        pynvml.nvmlShutdown()
