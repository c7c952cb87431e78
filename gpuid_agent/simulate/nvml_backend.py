"""NvmlApi implemented in Python over a simulated profile, with plausible moving telemetry."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import pynvml

from gpuid_agent.facts import PlatformInfo
from gpuid_agent.runtime.fault_spec import Fault, parse_fault
from gpuid_agent.simulate.profiles import PROFILES, SimGpu, SimMig
from gpuid_agent.sources.nvml.fields import RECOVERY_ACTION_FIELD
from gpuid_agent.sources.nvml.process_values import ProcessInfo, ProcessSample
from gpuid_agent.sources.nvml.signals import FabricInfo, NvmlEvent, RemappedRows

# A healthy GB200 fabric health mask: every 2-bit condition "false", configuration "none",
# partition assigned, fabric manager connected (NVML_GPU_FABRIC_HEALTH_MASK_* values).
_FABRIC_HEALTHY_MASK = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8 | 1 << 12 | 1 << 14
_FABRIC_DEGRADED_BW = (_FABRIC_HEALTHY_MASK & ~0x3) | 1
_NVLINKS = 18
_CLOCK_FAULTS = {"thermal": 0x8 | 0x20 | 0x40, "power-brake": 0x8 | 0x80, "hw-slowdown": 0x8}


class _SimEventSet:
    def __init__(self) -> None:
        self.gpus: set[int] = set()
        self.delivered: set[tuple[int, int, int]] = set()


class SimulatedNvml:
    def __init__(self, profile: str, node: str, faults: Sequence[str | Fault] = ()) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
        self.gpus: list[SimGpu] = PROFILES[profile](node)
        self._init = False
        self._t0 = time.monotonic()
        self.faults = [f if isinstance(f, Fault) else parse_fault(f) for f in faults]
        for fault in self.faults:
            if fault.gpu >= len(self.gpus):
                raise ValueError(f"fault {fault}: profile {profile} has {len(self.gpus)} GPUs")
        self._events = threading.Condition()
        self._injected: list[tuple[int, int, int]] = []  # (gpu, code, sequence)

    def _gpu(self, handle: Any) -> SimGpu:
        if not self._init:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if isinstance(handle, SimGpu):
            if handle.lost or self._fault(handle, "lost"):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return handle
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

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
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def handle_by_index(self, index: int) -> Any:
        if not 0 <= index < self.device_count():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def uuid(self, handle: Any) -> str:
        if isinstance(handle, SimMig):
            return handle.uuid
        gpu = self._gpu(handle)
        if self._fault(gpu, "gpu-replaced"):  # another board in the slot: a new UUID too
            return gpu.uuid[:-4] + "beef"
        return gpu.uuid

    def serial(self, handle: Any) -> str:
        gpu = self._gpu(handle)
        if gpu.serial is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self._fault(gpu, "gpu-replaced"):
            return gpu.serial[:-4] + "9999"
        return gpu.serial

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
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return module

    def board_part_number(self, handle: Any) -> str:
        return self._gpu(handle).board_part_number

    def platform_info(self, handle: Any) -> PlatformInfo:
        platform = self._gpu(handle).platform
        if platform is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return platform

    def mig_mode(self, handle: Any) -> int:
        return 1 if self._gpu(handle).mig else 0

    def max_mig_device_count(self, handle: Any) -> int:
        return 7 if self._gpu(handle).mig else 0

    def mig_device_handle(self, handle: Any, index: int) -> Any:
        migs = self._gpu(handle).mig
        if index >= len(migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return migs[index]

    def gpu_instance_id(self, handle: Any) -> int:
        if not isinstance(handle, SimMig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.gpu_instance_id

    def compute_instance_id(self, handle: Any) -> int:
        if not isinstance(handle, SimMig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.compute_instance_id

    def _wave(self, gpu: SimGpu, period: float) -> float:
        phase = (gpu.minor_number + 1) * 0.7
        return 0.5 + 0.5 * math.sin((time.monotonic() - self._t0) / period + phase)

    def utilization(self, handle: Any) -> tuple[int, int]:
        gpu = self._gpu(handle)
        if gpu.mig:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        load = self._load(gpu)
        return min(100, round(100 * load)), min(100, round(60 * load))

    def _load(self, gpu: SimGpu) -> float:  # 0-1: its processes' SM shares, or a slow wave
        if gpu.telemetry_from_processes:
            return sum(self._sm(gpu, p) for p in gpu.processes) / 100
        return self._wave(gpu, 30.0)

    def memory_info(self, handle: Any) -> tuple[int, int, int]:
        if isinstance(handle, SimMig):
            used = handle.memory_total // 4
            return handle.memory_total, used, handle.memory_total - used
        gpu = self._gpu(handle)
        if gpu.telemetry_from_processes:
            # what the processes hold plus the driver's own reservation
            used = sum(p.memory for p in gpu.processes) + 500 * 1024 * 1024
            return gpu.memory_total, used, gpu.memory_total - used
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
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def encoder_utilization(self, handle: Any) -> int:
        return round(20 * self._wave(self._whole_gpu(handle), 45.0))

    def decoder_utilization(self, handle: Any) -> int:
        return round(10 * self._wave(self._whole_gpu(handle), 50.0))

    def total_energy_mj(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        # ≈ power_usage_mw's average draw integrated since boot: a restarted agent reads on
        return 10**9 * (gpu.minor_number + 1) + round(390 * time.monotonic() * 1000)

    def clock_mhz(self, handle: Any, clock: int) -> int:
        gpu = self._gpu(handle)
        if clock == pynvml.NVML_CLOCK_SM:
            return 345 + round(1635 * self._wave(gpu, 30.0))
        if clock == pynvml.NVML_CLOCK_MEM:
            return 2619
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def pcie_replay_count(self, handle: Any) -> int:
        fault = self._fault(self._gpu(handle), "pcie-replay")
        return 0 if fault is None else 1 + int(20 * self._since(fault))

    # ---- faults and health signals -------------------------------------------------------

    def _fault(self, gpu: SimGpu, kind: str) -> Fault | None:
        if not self.faults:
            return None  # as cheap as the driver's answer: no search on every call
        index = self.gpus.index(gpu)
        elapsed = time.monotonic() - self._t0
        for fault in self.faults:
            if fault.gpu == index and fault.kind == kind and elapsed >= fault.delay:
                return fault
        return None

    def _since(self, fault: Fault) -> float:
        return max(0.0, time.monotonic() - self._t0 - fault.delay)

    def ecc_errors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        if error_type == 0:  # corrected: grows two a second under ecc-growth
            growth = self._fault(gpu, "ecc-growth")
            return int(2 * self._since(growth)) + 1 if growth else 0
        return 1 if self._fault(gpu, "ecc-uncorrected") else 0

    def retired_pages_pending(self, handle: Any) -> bool:
        return self._fault(self._gpu(handle), "retired-pending") is not None

    def remapped_rows(self, handle: Any) -> RemappedRows:
        gpu = self._gpu(handle)
        pending = self._fault(gpu, "remap-pending") is not None
        failure = self._fault(gpu, "remap-failure") is not None
        return RemappedRows(0, int(pending or failure), pending, failure)

    def clocks_event_reasons(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        mask = 0
        for kind, bits in _CLOCK_FAULTS.items():
            if self._fault(gpu, kind):
                mask |= bits
        return mask

    def fabric_info(self, handle: Any) -> FabricInfo:
        gpu = self._gpu(handle)
        if gpu.platform is None:  # HGX boards: not part of a multi-node NVLink fabric
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        degraded = self._fault(gpu, "fabric-degraded") is not None
        return FabricInfo(
            state=3,
            status=0,
            health_mask=_FABRIC_DEGRADED_BW if degraded else _FABRIC_HEALTHY_MASK,
            clique_id=32766,
            cluster_uuid=None,
            health_summary=3 if degraded else 1,
        )

    def persistence_mode(self, handle: Any) -> int:
        return 0 if self._fault(self._gpu(handle), "persistence-off") else 1

    # ---- processes ------------------------------------------------------------------------

    def compute_processes(self, handle: Any) -> list[ProcessInfo]:
        gpu = self._gpu(handle)
        return [ProcessInfo(p.pid, p.memory) for p in gpu.processes if not p.mps]

    def mps_processes(self, handle: Any) -> list[ProcessInfo]:
        gpu = self._gpu(handle)
        return [ProcessInfo(p.pid, p.memory, mps=True) for p in gpu.processes if p.mps]

    def _sm(self, gpu: SimGpu, process: Any) -> float:
        """A process's SM share, moving between 60 % and 100 % of its nominal share."""
        return float(process.sm_util * (0.6 + 0.4 * self._wave(gpu, 20.0 + process.pid % 7)))

    def process_utilization(self, handle: Any, since_us: int) -> list[ProcessSample]:
        gpu = self._gpu(handle)
        now = time.time_ns() // 1000
        if now <= since_us:
            return []
        return [ProcessSample(p.pid, now, round(self._sm(gpu, p))) for p in gpu.processes]

    # ---- link health: Gen5 x16 PCIe, 18 NVLinks per GPU ----------------------------------

    def pcie_link_gen(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        if self._load(gpu) < 0.05:  # idle (well under the 10 % the health check calls busy)
            return 1  # an idle link drops its generation to save power, as real ones do
        return 3 if self._fault(gpu, "pcie-gen") else 5

    def pcie_link_max_gen(self, handle: Any) -> int:
        self._gpu(handle)
        return 5

    pcie_link_gpu_max_gen = pcie_link_max_gen  # the GPU's own maximum is the slot's

    def pcie_link_width(self, handle: Any) -> int:
        return 8 if self._fault(self._gpu(handle), "pcie-down") else 16

    def pcie_link_max_width(self, handle: Any) -> int:
        self._gpu(handle)
        return 16

    def _link_fault(self, gpu: SimGpu, kind: str, link: int) -> Fault | None:
        if not 0 <= link < _NVLINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self.faults:
            return None
        index = self.gpus.index(gpu)
        elapsed = time.monotonic() - self._t0
        for fault in self.faults:
            hit = (fault.gpu, fault.kind, fault.link) == (index, kind, link)
            if hit and elapsed >= fault.delay:
                return fault
        return None

    def nvlink_state(self, handle: Any, link: int) -> int:
        return 0 if self._link_fault(self._gpu(handle), "nvlink-down", link) else 1

    def nvlink_error_counter(self, handle: Any, link: int, counter: int) -> int:
        fault = self._link_fault(self._gpu(handle), "nvlink-errors", link)
        if fault is None or counter != pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT:
            return 0
        return 1 + int(5 * self._since(fault))  # CRC flit errors, five a second

    def field_values(self, handle: Any, fields: Sequence[tuple[int, int]]) -> list[int | None]:
        self._gpu(handle)
        # the recovery action only, and it asks for nothing: a simulated GPU recovers alone
        return [0 if field == RECOVERY_ACTION_FIELD else None for field, _ in fields]

    # ---- XID events ----------------------------------------------------------------------

    def inject_xid(self, index: int, code: int) -> None:
        """Deliver an XID on GPU `index` to every event set watching it."""
        with self._events:
            self._injected.append((index, code, len(self._injected)))
            self._events.notify_all()

    def event_set_create(self) -> Any:
        if not self._init:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return _SimEventSet()

    def register_xid_events(self, handle: Any, event_set: Any) -> None:
        gpu = self._gpu(handle)
        with self._events:
            event_set.gpus.add(self.gpus.index(gpu))

    def _due(self, event_set: _SimEventSet) -> tuple[int, int, int] | None:
        elapsed = time.monotonic() - self._t0
        candidates = [
            (f.gpu, f.code or 0, -1 - n)
            for n, f in enumerate(self.faults)
            if f.kind == "xid" and elapsed >= f.delay
        ]
        for item in [*candidates, *self._injected]:
            if item[0] in event_set.gpus and item not in event_set.delivered:
                return item
        return None

    def _next_fault_in(self, event_set: _SimEventSet) -> float:
        """Seconds until the next delayed XID fault on this set's GPUs falls due."""
        elapsed = time.monotonic() - self._t0
        waits = [
            f.delay - elapsed
            for f in self.faults
            if f.kind == "xid" and f.gpu in event_set.gpus and f.delay > elapsed
        ]
        return max(0.001, min(waits, default=math.inf))

    def event_set_wait(self, event_set: Any, timeout_ms: int) -> NvmlEvent:
        if not self._init:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        deadline = time.monotonic() + timeout_ms / 1000
        with self._events:
            while (due := self._due(event_set)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
                # Block as the driver does: an injection wakes the wait at once, a delayed
                # fault when it falls due, nothing else before the timeout.
                self._events.wait(min(left, self._next_fault_in(event_set)))
            event_set.delivered.add(due)
        gpu, code, _ = due
        return NvmlEvent(
            device=id(self.gpus[gpu]),
            event_type=pynvml.nvmlEventTypeXidCriticalError,
            data=code,
            gpu_instance_id=0xFFFFFFFF,
            compute_instance_id=0xFFFFFFFF,
        )

    def event_set_free(self, event_set: Any) -> None:
        return None

    def device_key(self, handle: Any) -> Hashable:
        return id(handle)
