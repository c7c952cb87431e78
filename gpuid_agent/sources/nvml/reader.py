"""Reading GPUs through NVML: tolerant per field (see `calls`), on the NVML thread.

A field NVML does not support (or a driver too old to have the call) is simply absent. A GPU
that is lost keeps its last known identity so a transient fault does not look like a GPU
being pulled from the node.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

import pynvml

from gpuid_agent.facts import GpuIdentity, GpuSample, MigDevice
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import GpuLostError
from gpuid_agent.sources.nvml.api import Handle, NvmlApi
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.signals import GpuHealthSignals

T = TypeVar("T")
_log = log.get("nvml")

# sample keys in the order of EccCounts and RemappedRows
_ECC_KEYS = ("ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate")
_REMAP_KEYS = (
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "row_remap_pending",
    "row_remap_failure",
)
_MIG_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")


@dataclass(slots=True)
class NvmlReading:
    """What one pass over NVML found."""

    driver_version: str | None
    cuda_driver_version: str | None
    gpus: list[GpuIdentity]
    samples: dict[str, GpuSample]
    lost: dict[int, str] = field(default_factory=dict)
    errors: int = 0


def format_cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


class NvmlReader:
    """Synchronous reads through an NvmlApi; call only from the NVML thread."""

    def __init__(self, api: NvmlApi) -> None:
        self.api = api
        self.calls = FieldCalls(_log)

    def _field(self, index: int, name: str, call: Callable[..., T], *args: Any) -> T | None:
        return self.calls.get(index, name, call, *args)

    def read_identity(self, index: int, handle: Handle) -> GpuIdentity:
        api = self.api
        uuid = self._field(index, "uuid", api.uuid, handle)
        mig_mode = self._field(index, "mig_mode", api.mig_mode, handle)
        return GpuIdentity(
            index=index,
            uuid=uuid or f"unknown-gpu-{index}",
            serial=self._clean(self._field(index, "serial", api.serial, handle)),
            name=self._clean(self._field(index, "name", api.name, handle)),
            pci_bus_id=self._field(index, "pci_bus_id", api.pci_bus_id, handle),
            minor_number=self._field(index, "minor_number", api.minor_number, handle),
            module_id=self._field(index, "module_id", api.module_id, handle),
            board_part_number=self._clean(
                self._field(index, "board_part_number", api.board_part_number, handle)
            ),
            platform=self._field(index, "platform_info", api.platform_info, handle),
            mig_enabled=None if mig_mode is None else mig_mode == 1,
            mig_devices=self._mig_devices(index, handle) if mig_mode == 1 else (),
        )

    @staticmethod
    def _clean(value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        return value if value and value.isprintable() else None

    def _mig_devices(self, index: int, handle: Handle) -> tuple[MigDevice, ...]:
        api = self.api
        count = self._field(index, "mig_count", api.max_mig_device_count, handle) or 0
        devices = []
        for mig_index in range(count):
            try:
                mig = api.mig_device_handle(handle, mig_index)
            except pynvml.NVMLError:
                continue  # slot without a configured instance
            uuid = self._field(index, "mig_uuid", api.uuid, mig)
            if not uuid:
                continue
            name = self._field(index, "mig_name", api.name, mig)
            match = _MIG_PROFILE.search(name or "")
            devices.append(
                MigDevice(
                    index=mig_index,
                    uuid=uuid,
                    gpu_instance_id=self._field(index, "gpu_instance_id", api.gpu_instance_id, mig),
                    compute_instance_id=self._field(
                        index, "compute_instance_id", api.compute_instance_id, mig
                    ),
                    profile=match.group(1) if match else None,
                )
            )
        return tuple(devices)

    def read_sample(self, index: int, uuid: str, handle: Handle) -> GpuSample:
        api = self.api
        values: dict[str, float] = {}
        util = self._field(index, "utilization", api.utilization, handle)
        if util is not None:
            values["gpu_util"], values["mem_copy_util"] = float(util[0]), float(util[1])
        mem = self._field(index, "memory", api.memory_info, handle)
        if mem is not None:
            total, used, free = mem
            values["memory_total_bytes"] = float(total)
            values["memory_used_bytes"] = float(used)
            values["memory_free_bytes"] = float(free)
        temp = self._field(index, "temperature", api.temperature, handle)
        if temp is not None:
            values["temperature_celsius"] = float(temp)
        power = self._field(index, "power", api.power_usage_mw, handle)
        if power is not None:
            values["power_watts"] = power / 1000.0
        self._read_telemetry(index, handle, values)
        return GpuSample(uuid=uuid, values=MappingProxyType(values))

    def _read_telemetry(self, index: int, handle: Handle, values: dict[str, float]) -> None:
        """The dcgm-exporter default fields beyond the basics; each absent where unsupported.
        ECC, remapped rows and clock-event reasons come from the health read instead
        (`with_health_fields`), so each NVML call is made once per collection."""
        api = self.api
        single: tuple[tuple[str, Callable[..., int], tuple[Any, ...]], ...] = (
            ("enc_util", api.encoder_utilization, ()),
            ("dec_util", api.decoder_utilization, ()),
            ("energy_mj", api.total_energy_mj, ()),
            ("sm_clock_mhz", api.clock_mhz, (pynvml.NVML_CLOCK_SM,)),
            ("mem_clock_mhz", api.clock_mhz, (pynvml.NVML_CLOCK_MEM,)),
            ("pcie_replay", api.pcie_replay_count, ()),
        )
        for key, call, args in single:
            value = self._field(index, key, call, handle, *args)
            if value is not None:
                values[key] = float(value)

    def read_mig_sample(self, index: int, mig: MigDevice, handle: Handle) -> GpuSample | None:
        """Memory of one MIG device (NVML has no per-instance utilization)."""
        mig_handle = self._field(index, "mig_handle", self.api.mig_device_handle, handle, mig.index)
        if mig_handle is None:
            return None
        values: dict[str, float] = {}
        mem = self._field(index, "mig_memory", self.api.memory_info, mig_handle)
        if mem is not None:
            total, used, free = mem
            values["memory_total_bytes"] = float(total)
            values["memory_used_bytes"] = float(used)
            values["memory_free_bytes"] = float(free)
        return GpuSample(uuid=mig.uuid, values=MappingProxyType(values))

    def read(self, previous: dict[int, GpuIdentity]) -> NvmlReading:
        api = self.api
        self.calls.reset()
        driver = self._field(-1, "driver_version", api.driver_version)
        cuda = self._field(-1, "cuda_driver_version", api.cuda_driver_version)
        count = api.device_count()
        reading = NvmlReading(
            driver_version=driver,
            cuda_driver_version=format_cuda_version(cuda) if cuda else None,
            gpus=[],
            samples={},
        )
        for index in range(count):
            try:
                handle = api.handle_by_index(index)
                gpu = self.read_identity(index, handle)
                reading.samples[gpu.uuid] = self.read_sample(index, gpu.uuid, handle)
                for mig in gpu.mig_devices:
                    if (mig_sample := self.read_mig_sample(index, mig, handle)) is not None:
                        reading.samples[mig.uuid] = mig_sample
            except (GpuLostError, pynvml.NVMLError) as exc:
                reading.lost[index] = str(exc)
                self.calls.warn_once(index, "lost", f"GPU {index} unreadable: {exc}")
                known = previous.get(index)
                if known is not None:
                    reading.gpus.append(known)
                continue
            self.calls.recovered(index, "lost")
            reading.gpus.append(gpu)
        reading.errors = self.calls.errors
        return reading


def with_health_fields(
    samples: Mapping[str, GpuSample], signals: Iterable[GpuHealthSignals]
) -> dict[str, GpuSample]:
    """Samples plus the telemetry the health read already has: ECC counts, remapped rows,
    clock-event reasons and the PCIe link (what NVML did not report stays absent)."""
    merged = dict(samples)
    for signal in signals:
        sample = merged.get(signal.uuid)
        if sample is None:
            continue
        extra: dict[str, float] = {}
        if signal.ecc is not None:
            ecc = zip(_ECC_KEYS, signal.ecc, strict=True)
            extra.update((key, float(count)) for key, count in ecc if count is not None)
        if signal.remapped_rows is not None:
            extra.update(zip(_REMAP_KEYS, map(float, signal.remapped_rows), strict=True))
        if signal.clocks_event_reasons is not None:
            extra["clock_event_reasons"] = float(signal.clocks_event_reasons)
        if signal.pcie is not None:
            link = signal.pcie
            extra["pcie_link_gen"], extra["pcie_link_max_gen"] = link.gen, link.max_gen
            extra["pcie_link_width"], extra["pcie_link_max_width"] = link.width, link.max_width
        if extra:
            merged[signal.uuid] = GpuSample(
                uuid=sample.uuid, values=MappingProxyType({**sample.values, **extra})
            )
    return merged
