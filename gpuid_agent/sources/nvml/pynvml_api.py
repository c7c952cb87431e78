"""The NvmlApi over the real pynvml: the driver's libnvidia-ml (or the test library in its
place), optionally loaded from a given path.

Where a newer variant of a call exists, it is tried first and the older one used where the
driver lacks it. Fixed-size text and the platform-info struct are decoded from their raw bytes.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import uuid as uuidlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import pynvml

from gpuid_agent.facts import PlatformInfo
from gpuid_agent.runtime.errors import NvmlUnavailableError
from gpuid_agent.sources.nvml.api import EventSet, Handle
from gpuid_agent.sources.nvml.errors import OLDER_CALL, NvmlFault, fault
from gpuid_agent.sources.nvml.process_reader import instance_id, memory_value
from gpuid_agent.sources.nvml.process_values import ProcessInfo, ProcessSample
from gpuid_agent.sources.nvml.signals import FabricInfo, NvmlEvent, RemappedRows

T = TypeVar("T")

PLATFORM_INFO_V2 = (2 << 24) | 0x2C
_PLATFORM_V2 = struct.Struct("<I16s16s5B")


def _text(raw: bytes) -> str | None:
    """NUL-terminated ASCII from a fixed-size field; None when empty or not printable."""
    value = raw.split(b"\0", 1)[0]
    try:
        text = value.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if not text or not text.isprintable():
        return None
    return text


def parse_platform_info(raw: bytes) -> PlatformInfo:
    """Decode a c_nvmlPlatformInfo_v2_t from its bytes.

    Read from raw bytes rather than pynvml's attribute access, which decodes `c_char` fields
    as UTF-8 and fails on bytes ≥ 0x80 that the single-byte fields may legitimately hold.
    """
    if len(raw) < _PLATFORM_V2.size:
        raise ValueError(f"platform info is {len(raw)} bytes, expected {_PLATFORM_V2.size}")
    version, guid, chassis, slot, tray, host, peer, module = _PLATFORM_V2.unpack_from(raw)
    if version != PLATFORM_INFO_V2:
        raise ValueError(f"platform info version {version:#x}, expected {PLATFORM_INFO_V2:#x}")
    return PlatformInfo(
        chassis_serial=_text(chassis),
        slot_number=slot,
        tray_index=tray,
        host_id=host,
        peer_type=peer,
        module_id=module,
        ib_guid=guid.hex() if any(guid) else None,
    )


_load_lock = threading.Lock()


class PynvmlApi:
    """NvmlApi over the real pynvml, optionally loading libnvidia-ml from a given path."""

    def __init__(self, library_path: str = "") -> None:
        self._library_path = library_path

    def _load(self) -> None:
        # pynvml only loads "libnvidia-ml.so.1" from the default search path, but uses
        # `pynvml.nvmlLib` as-is when set: the way to honour a driver root such as
        # /run/nvidia/driver on GPU-operator nodes.
        if not self._library_path:
            return
        with _load_lock:
            current = getattr(pynvml.nvmlLib, "_name", None)
            if current == self._library_path:
                return
            try:
                lib = ctypes.CDLL(self._library_path)
            except OSError as exc:
                raise NvmlUnavailableError(
                    f"cannot load NVML library {self._library_path}: {exc}"
                ) from exc
            pynvml.nvmlLib = lib
            pynvml._nvmlGetFunctionPointer_cache.clear()

    def init(self) -> None:
        self._load()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailableError(f"nvmlInit failed: {exc}") from exc

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def driver_version(self) -> str:
        return str(pynvml.nvmlSystemGetDriverVersion())

    def cuda_driver_version(self) -> int:
        return int(
            _newer_or_older(
                pynvml.nvmlSystemGetCudaDriverVersion_v2,
                pynvml.nvmlSystemGetCudaDriverVersion,
                _NO_CALL,
            )
        )

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def handle_by_index(self, index: int) -> Handle:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetUUID(handle))

    def serial(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetSerial(handle))

    def name(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetName(handle))

    def pci_bus_id(self, handle: Handle) -> str:
        info = pynvml.nvmlDeviceGetPciInfo(handle)
        raw = ctypes.string_at(ctypes.addressof(info), ctypes.sizeof(info))
        offset = type(info).busId.offset
        size = type(info).busId.size
        text = _text(raw[offset : offset + size])
        if text is None:
            raise ValueError("PCI bus id is empty or not ASCII")
        return text

    def minor_number(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))

    def module_id(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetModuleId(handle, ctypes.c_uint()))

    def board_part_number(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetBoardPartNumber(handle))

    def platform_info(self, handle: Handle) -> PlatformInfo:
        info = pynvml.c_nvmlPlatformInfo_v2_t()
        pynvml.nvmlDeviceGetPlatformInfo(handle, ctypes.byref(info))
        return parse_platform_info(ctypes.string_at(ctypes.addressof(info), ctypes.sizeof(info)))

    def mig_mode(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMigMode(handle)[0])

    def max_mig_device_count(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))

    def mig_device_handle(self, handle: Handle, index: int) -> Handle:
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)

    def gpu_instance_id(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetGpuInstanceId(handle))

    def compute_instance_id(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetComputeInstanceId(handle))

    def utilization(self, handle: Handle) -> tuple[int, int]:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return int(rates.gpu), int(rates.memory)

    def memory_info(self, handle: Handle) -> tuple[int, int, int]:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(mem.total), int(mem.used), int(mem.free)

    def temperature(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))

    def power_usage_mw(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetPowerUsage(handle))

    def encoder_utilization(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetEncoderUtilization(handle)[0])

    def decoder_utilization(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetDecoderUtilization(handle)[0])

    def total_energy_mj(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))

    def clock_mhz(self, handle: Handle, clock: int) -> int:
        return int(pynvml.nvmlDeviceGetClockInfo(handle, clock))

    def pcie_replay_count(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetPcieReplayCounter(handle))

    # ---- health signals ----------------------------------------------------------------

    def ecc_errors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))

    def retired_pages_pending(self, handle: Handle) -> bool:
        return bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))

    def remapped_rows(self, handle: Handle) -> RemappedRows:
        corr, unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    def clocks_event_reasons(self, handle: Handle) -> int:
        # drivers before 535 only have the older name of the same call
        return int(
            _newer_or_older(
                lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
                lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle),
                _NO_CALL,
            )
        )

    def fabric_info(self, handle: Handle) -> FabricInfo:
        # v3 adds the health summary; drivers that predate it answer VERSION_MISMATCH.
        # Only the V call carries the health mask: a driver lacking it raises
        # FunctionNotFound, which the reader reports as "not supported".
        v3 = getattr(pynvml, "c_nvmlGpuFabricInfo_v3_t", None)
        if v3 is not None:
            info = v3()
            try:
                pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
            except pynvml.NVMLError as exc:
                if fault(exc) is not NvmlFault.VERSION_MISMATCH:
                    raise
            else:
                return _fabric(info, int(info.healthSummary))
        info = pynvml.c_nvmlGpuFabricInfo_v2_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        return _fabric(info, None)

    def persistence_mode(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetPersistenceMode(handle))

    # ---- processes -----------------------------------------------------------------------

    def compute_processes(self, handle: Handle) -> list[ProcessInfo]:
        return _processes(pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle), mps=False)

    def mps_processes(self, handle: Handle) -> list[ProcessInfo]:
        return _processes(pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle), mps=True)

    def process_utilization(self, handle: Handle, since_us: int) -> list[ProcessSample]:
        # The newer call where the driver has it (535+); the older one otherwise.
        try:
            raw = _newer_or_older(
                lambda: pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, since_us),
                lambda: pynvml.nvmlDeviceGetProcessUtilization(handle, since_us),
                OLDER_CALL,
            )
        except pynvml.NVMLError as exc:
            if fault(exc) is NvmlFault.NOT_FOUND:
                return []  # nothing ran since `since_us`
            raise
        return [
            ProcessSample(
                pid=int(s.pid),
                timestamp_us=int(s.timeStamp),
                sm_util=int(s.smUtil),
                mem_util=int(s.memUtil),
            )
            for s in raw
        ]

    # ---- link health ---------------------------------------------------------------------

    def pcie_link_gen(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))

    def pcie_link_max_gen(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))

    def pcie_link_gpu_max_gen(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(handle))

    def pcie_link_width(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))

    def pcie_link_max_width(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))

    def nvlink_state(self, handle: Handle, link: int) -> int:
        return int(pynvml.nvmlDeviceGetNvLinkState(handle, link))

    def nvlink_error_counter(self, handle: Handle, link: int, counter: int) -> int:
        return int(pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))

    def field_values(self, handle: Handle, fields: Sequence[tuple[int, int]]) -> list[int | None]:
        # The call succeeds and each entry carries its own return code (a driver that does
        # not know a field id answers that entry INVALID_ARGUMENT): such an entry is None.
        values = pynvml.nvmlDeviceGetFieldValues(handle, list(fields))
        return [_field_value(v) for v in values]

    # ---- XID events ----------------------------------------------------------------------

    def event_set_create(self) -> EventSet:
        return pynvml.nvmlEventSetCreate()

    def register_xid_events(self, handle: Handle, event_set: EventSet) -> None:
        pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> NvmlEvent:
        data = pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        return NvmlEvent(
            device=self.device_key(data.device),
            event_type=int(data.eventType),
            data=int(data.eventData),
            gpu_instance_id=int(data.gpuInstanceId),
            compute_instance_id=int(data.computeInstanceId),
        )

    def event_set_free(self, event_set: EventSet) -> None:
        pynvml.nvmlEventSetFree(event_set)

    def device_key(self, handle: Handle) -> Hashable:
        # Two ctypes pointers to the same device do not compare equal; their addresses do.
        # An XID 79 GPU may fail every call, so the key must not need one.
        return ctypes.cast(handle, ctypes.c_void_p).value


_NO_CALL = frozenset({NvmlFault.NO_CALL})


def _newer_or_older(
    newer: Callable[[], T], older: Callable[[], T], when: frozenset[NvmlFault]
) -> T:
    """`newer()`, or `older()` where the newer variant fails with one of the faults `when`."""
    try:
        return newer()
    except pynvml.NVMLError as exc:
        if fault(exc) not in when:
            raise
    return older()


def _processes(raw: Any, *, mps: bool) -> list[ProcessInfo]:
    return [
        ProcessInfo(
            pid=int(p.pid),
            used_memory=memory_value(p.usedGpuMemory),
            gpu_instance_id=instance_id(getattr(p, "gpuInstanceId", None)),
            compute_instance_id=instance_id(getattr(p, "computeInstanceId", None)),
            mps=mps,
        )
        for p in raw
    ]


def _fabric(info: Any, summary: int | None) -> FabricInfo:
    uuid = bytes(info.clusterUuid)
    return FabricInfo(
        state=int(info.state),
        status=int(info.status),
        health_mask=int(info.healthMask),
        clique_id=int(info.cliqueId),
        cluster_uuid=str(uuidlib.UUID(bytes=uuid)) if any(uuid) else None,
        health_summary=summary,
    )


# nvmlValue_t member per NVML_VALUE_TYPE_* (double, uint, ulong, ulonglong, slonglong, int, ushort)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _field_value(value: Any) -> int | None:
    """One entry's value by its declared type; None where the entry failed, its type is
    unknown or it is a double that is no number."""
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    kind = int(value.valueType)
    if not 0 <= kind < len(_VALUE_MEMBERS):
        return None
    try:
        return int(getattr(value.value, _VALUE_MEMBERS[kind]))
    except (ValueError, OverflowError):  # a double that is NaN or infinite
        return None
