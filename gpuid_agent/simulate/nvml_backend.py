"""NvmlApi implemented in Python over a simulated profile, with plausible moving telemetry."""

from __future__ import annotations

import math
import time
from typing import Any

import pynvml

from gpuid_agent.model import PlatformInfo
from gpuid_agent.simulate.profiles import PROFILES, SimGpu, SimMig


def _fail(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class SimulatedNvml:
    def __init__(self, profile: str, node: str) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
        self.gpus: list[SimGpu] = PROFILES[profile](node)
        self._init = False
        self._t0 = time.monotonic()

    def _gpu(self, handle: Any) -> SimGpu:
        if not self._init:
            raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        if isinstance(handle, SimGpu):
            if handle.lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            return handle
        raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def init(self) -> None:
        self._init = True

    def shutdown(self) -> None:
        self._init = False

    def driver_version(self) -> str:
        return "570.86.15"

    def cuda_driver_version(self) -> int:
        return 12080

    def device_count(self) -> int:
        if not self._init:
            raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def handle_by_index(self, index: int) -> Any:
        if not 0 <= index < self.device_count():
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def uuid(self, handle: Any) -> str:
        if isinstance(handle, SimMig):
            return handle.uuid
        return self._gpu(handle).uuid

    def serial(self, handle: Any) -> str:
        serial = self._gpu(handle).serial
        if serial is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return serial

    def name(self, handle: Any) -> str:
        if isinstance(handle, SimMig):
            return handle.name
        return self._gpu(handle).name

    def pci_bus_id(self, handle: Any) -> str:
        return self._gpu(handle).pci_bus_id

    def minor_number(self, handle: Any) -> int:
        return self._gpu(handle).minor_number

    def module_id(self, handle: Any) -> int:
        module = self._gpu(handle).module_id
        if module is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return module

    def board_part_number(self, handle: Any) -> str:
        return self._gpu(handle).board_part_number

    def platform_info(self, handle: Any) -> PlatformInfo:
        platform = self._gpu(handle).platform
        if platform is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return platform

    def mig_mode(self, handle: Any) -> int:
        return 1 if self._gpu(handle).mig else 0

    def max_mig_device_count(self, handle: Any) -> int:
        return 7 if self._gpu(handle).mig else 0

    def mig_device_handle(self, handle: Any, index: int) -> Any:
        migs = self._gpu(handle).mig
        if index >= len(migs):
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return migs[index]

    def gpu_instance_id(self, handle: Any) -> int:
        if not isinstance(handle, SimMig):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.gpu_instance_id

    def compute_instance_id(self, handle: Any) -> int:
        if not isinstance(handle, SimMig):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.compute_instance_id

    def _wave(self, gpu: SimGpu, period: float) -> float:
        phase = (gpu.minor_number + 1) * 0.7
        return 0.5 + 0.5 * math.sin((time.monotonic() - self._t0) / period + phase)

    def utilization(self, handle: Any) -> tuple[int, int]:
        gpu = self._gpu(handle)
        if gpu.mig:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        load = self._wave(gpu, 30.0)
        return round(100 * load), round(60 * load)

    def memory_info(self, handle: Any) -> tuple[int, int, int]:
        if isinstance(handle, SimMig):
            used = handle.memory_total // 4
            return handle.memory_total, used, handle.memory_total - used
        gpu = self._gpu(handle)
        used = int(gpu.memory_total * 0.8 * self._wave(gpu, 120.0))
        return gpu.memory_total, used, gpu.memory_total - used

    def temperature(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        return 35 + round(40 * self._wave(gpu, 60.0))

    def power_usage_mw(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        return 90_000 + round(600_000 * self._wave(gpu, 30.0))

    def _whole_gpu(self, handle: Any) -> SimGpu:
        """A GPU without MIG: per-engine counters are not reported on MIG-enabled GPUs."""
        gpu = self._gpu(handle)
        if gpu.mig:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def encoder_utilization(self, handle: Any) -> int:
        return round(20 * self._wave(self._whole_gpu(handle), 45.0))

    def decoder_utilization(self, handle: Any) -> int:
        return round(10 * self._wave(self._whole_gpu(handle), 50.0))

    def total_energy_mj(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        # ≈ the integral of power_usage_mw's average draw, growing from a per-GPU offset
        return 10**9 * (gpu.minor_number + 1) + round(390 * (time.monotonic() - self._t0) * 1000)

    def clock_mhz(self, handle: Any, clock: int) -> int:
        gpu = self._gpu(handle)
        if clock == pynvml.NVML_CLOCK_SM:
            return 345 + round(1635 * self._wave(gpu, 30.0))
        if clock == pynvml.NVML_CLOCK_MEM:
            return 2619
        raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def pcie_replay_count(self, handle: Any) -> int:
        self._gpu(handle)
        return 0

    def ecc_errors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        corrected = error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        aggregate = counter_type == pynvml.NVML_AGGREGATE_ECC
        return (gpu.minor_number % 3) * (4 if aggregate else 1) if corrected else 0

    def remapped_rows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        return gpu.minor_number % 2, 0, 0, 0

    def clock_event_reasons(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        idle, sw_power_cap = 0x1, 0x4
        return idle if self._wave(gpu, 30.0) < 0.2 else sw_power_cap
