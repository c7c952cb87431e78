"""A fake ``libnvidia-ml.so.1`` for tests, driven by a text file.

The C source (``fake_nvml.c`` next to this file) implements the NVML calls that
pynvml makes for gpuid-agent.  Tests describe GPUs with :class:`FakeNvmlConfig`,
write it to a file, point ``FAKE_NVML_CONFIG`` at that file and load the built
library into pynvml with :func:`load_fake_into_pynvml`.

Config file format (one statement per line, ``#`` starts a comment line,
unknown keys are ignored, numbers are decimal or ``0x`` hex, a string value is
the rest of the line)::

    init_error <nvmlReturn>
    driver_version <str>
    cuda_driver_version <int>
    nvml_version <str>
    gpu <i> <key> <value...>
    gpu <i> error <field-key> <nvmlReturn>
    gpu <i> xid <code> <after_n_waits> [<gpu_instance_id> <compute_instance_id>]
    gpu <i> mig <j> <key> <value...>
    gpu <i> mig <j> error <field-key> <nvmlReturn>

GPU keys are the :class:`FakeGpu` field names; MIG keys are the
:class:`FakeMig` field names.  An unset key makes its getter return
``NVML_ERROR_NOT_SUPPORTED`` (``uuid``, ``name``, ``pci_bus_id`` and ``minor``
have defaults).  ``<field-key>`` in an ``error`` line is a key the call reads
(``power_mw``), a group name (``platform_info``, ``fabric_info``, ``memory``,
``utilization``, ``power``, ``energy``, ``pci_info``, ``clock``, ``ecc``,
``remapped_rows``, ``clocks_event_reasons``, ``events``, ``mig``, ``handle``,
``index``) or the C function name
(``nvmlDeviceGetPowerUsage``).  The GPU count is the highest ``<i>`` + 1.

The library re-reads the file at every ``nvmlInit*`` and whenever the file's
identity, mtime or size changes, so rewriting it with :meth:`FakeNvmlConfig.write`
changes the GPUs seen by a process that is already running.  See the comment
at the top of ``fake_nvml.c`` for the exact semantics of each key.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_ENV",
    "SOURCE",
    "FakeGpu",
    "FakeMig",
    "FakeNvmlBuildError",
    "FakeNvmlConfig",
    "FakeProcess",
    "FakeProcessUtil",
    "build_fake_nvml",
    "gb200x4",
    "h100x8",
    "load_fake_into_pynvml",
    "mig_h100",
]

CONFIG_ENV = "FAKE_NVML_CONFIG"
SOURCE = Path(__file__).with_name("fake_nvml.c")
LIB_NAME = "libnvidia-ml.so.1"

# nvmlReturn_t values used by the factories and tests.
NVML_ERROR_NOT_SUPPORTED = 3

_UUID_NAMESPACE = uuid.UUID("6f1d3c52-8f0e-4a53-9a57-3c1b4f0d2e11")


class FakeNvmlBuildError(RuntimeError):
    """The fake NVML library could not be compiled."""


def build_fake_nvml(out_dir: Path, omit: Sequence[str] = ()) -> Path:
    """Compile ``fake_nvml.c`` and return the path of the ``libnvidia-ml.so.1``.

    ``omit`` names exported functions to leave out (``-DOMIT_<name>``).  Builds
    are cached inside ``out_dir`` by (source hash, omitted names).
    """
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        msg = "gcc not found on PATH: it is needed to build the fake NVML library"
        raise FakeNvmlBuildError(msg)
    for name in omit:
        if not name.isidentifier():
            msg = f"not a C identifier: {name!r}"
            raise ValueError(msg)
    source = SOURCE.read_bytes()
    omitted = sorted(set(omit))
    digest = hashlib.sha256(source + b"\0" + ",".join(omitted).encode()).hexdigest()[:16]
    target_dir = Path(out_dir) / f"fakenvml-{digest}"
    lib = target_dir / LIB_NAME
    if lib.is_file():
        return lib.resolve()
    target_dir.mkdir(parents=True, exist_ok=True)
    tmp = target_dir / f".{LIB_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    cmd = [
        compiler,
        "-shared",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Werror",
        f"-Wl,-soname,{LIB_NAME}",
        *(f"-DOMIT_{name}" for name in omitted),
        "-o",
        str(tmp),
        str(SOURCE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        msg = f"building the fake NVML library failed ({' '.join(cmd)}):\n{proc.stderr}"
        raise FakeNvmlBuildError(msg)
    os.replace(tmp, lib)
    return lib.resolve()


def load_fake_into_pynvml(lib_path: Path | str) -> ctypes.CDLL:
    """Make pynvml use the library at ``lib_path`` from its next call on.

    Clears pynvml's function-pointer cache so that a second library loaded in
    the same process is honoured.  Call it while pynvml is not initialised.
    """
    import pynvml

    lib = ctypes.CDLL(str(Path(lib_path).resolve()))
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if isinstance(cache, dict):
            cache.clear()
    return lib


@dataclass
class FakeMig:
    """One MIG device of a :class:`FakeGpu`."""

    uuid: str | None = None
    name: str | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    mem_total: int | None = None
    mem_used: int | None = None
    mem_free: int | None = None
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeProcess:
    """A process on a GPU (compute or MPS list); `used` None reads as "not available"."""

    pid: int
    used: int | None = 0
    gi: int | None = None  # GPU / compute instance of a MIG device
    ci: int | None = None

    def statement(self) -> str:
        used = "-" if self.used is None else str(int(self.used))
        ids = f" {self.gi} {self.ci}" if self.gi is not None else ""
        return f"{int(self.pid)} {used}{ids}"


@dataclass
class FakeProcessUtil:
    """One per-process utilization sample (percent); timestamp 0 means "now"."""

    pid: int
    sm: int
    mem: int = 0
    enc: int = 0
    dec: int = 0
    timestamp_us: int = 0

    def statement(self) -> str:
        values = (self.pid, self.sm, self.mem, self.enc, self.dec, self.timestamp_us)
        return " ".join(str(int(v)) for v in values)


@dataclass
class FakeGpu:
    """One GPU.  ``None`` means "not set": the matching getter is NOT_SUPPORTED."""

    uuid: str | None = None
    serial: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    pci_device_id: int | None = None
    pci_subsystem_id: int | None = None
    minor: int | None = None
    module_id: int | None = None
    board_part_number: str | None = None
    # nvmlDeviceGetPlatformInfo
    chassis_serial: str | None = None
    slot: int | None = None
    tray: int | None = None
    host_id: int | None = None
    peer_type: int | None = None
    platform_module_id: int | None = None
    ib_guid: str | None = None  # hex, up to 32 digits
    rack_guid: str | None = None  # hex, v1 structure only
    # MIG
    mig_mode: int | None = None
    mig_mode_pending: int | None = None
    max_mig_devices: int | None = None
    persistence_mode: int | None = None
    # utilisation (percent)
    util_gpu: int | None = None
    util_mem: int | None = None
    util_enc: int | None = None
    util_dec: int | None = None
    # memory (bytes)
    mem_total: int | None = None
    mem_used: int | None = None
    mem_free: int | None = None
    mem_reserved: int | None = None
    temperature: int | None = None
    power_mw: int | None = None
    energy_mj: int | None = None
    # clocks (MHz)
    clock_sm: int | None = None
    clock_mem: int | None = None
    clock_graphics: int | None = None
    clock_video: int | None = None
    pcie_replay: int | None = None
    ecc_vol_corr: int | None = None
    ecc_vol_uncorr: int | None = None
    ecc_agg_corr: int | None = None
    ecc_agg_uncorr: int | None = None
    retired_pending: int | None = None
    remap_corr: int | None = None
    remap_unc: int | None = None
    remap_pending: int | None = None
    remap_failure: int | None = None
    clocks_event_reasons: int | None = None
    # nvmlDeviceGetGpuFabricInfo(V)
    fabric_state: int | None = None
    fabric_status: int | None = None
    fabric_health_mask: int | None = None
    fabric_health_summary: int | None = None
    fabric_clique_id: int | None = None
    fabric_cluster_uuid: str | None = None
    fabric_max_version: int | None = None  # 2: the V call rejects the v3 structure
    # ---- link health: PCIe link training and NVLink (the link block of fake_nvml.c) ----
    pcie_gen: int | None = None
    pcie_max_gen: int | None = None
    pcie_gpu_max_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    nvlink_links: int | None = None  # None: NVLink calls are NOT_SUPPORTED (a PCIe card)
    nvlink_down: int | None = None  # bit l set: link l inactive
    # per-link counters as comma lists ("0,0,0,5"), position l is link l
    nvlink_replay: str | None = None
    nvlink_recovery: str | None = None
    nvlink_crc_flit: str | None = None
    nvlink_crc_data: str | None = None
    supported_events: int | None = None
    # nvmlDeviceGetFieldValues: "<field id>" or "<field id>:<scope id>" -> value; per-entry
    # errors are error keys "field.<id>" / "field.<id>.<scope>"
    fields: dict[str, int] = field(default_factory=dict)
    # field 230, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (0 none, 1 reset, 2 reboot, 3 drain P2P,
    # 4 drain and reset): written as `field 230`, where `fields` does not set it
    recovery_action: int | None = None
    lost: bool = False
    errors: dict[str, int] = field(default_factory=dict)
    mig: list[FakeMig] = field(default_factory=list)
    # (xid code, after_n_waits) or (code, after, gpu_instance_id, compute_instance_id)
    xids: list[tuple[int, ...]] = field(default_factory=list)
    # field key (function name, key or group, as for errors) -> seconds its calls hang
    blocks: dict[str, float] = field(default_factory=dict)
    # running processes and their samples (nvmlDeviceGet*RunningProcesses_v3, *ProcessUtil*)
    processes: list[FakeProcess] = field(default_factory=list)
    mps_processes: list[FakeProcess] = field(default_factory=list)
    process_util: list[FakeProcessUtil] = field(default_factory=list)


_PROCESS_FIELDS = frozenset({"processes", "mps_processes", "process_util"})
_SPECIAL_GPU_FIELDS = (
    frozenset({"lost", "errors", "mig", "xids", "blocks", "fields", "recovery_action"})
    | _PROCESS_FIELDS
)
_SPECIAL_MIG_FIELDS = frozenset({"errors"})


def _format_value(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if "\n" in text or "\r" in text:
        msg = f"{name}: value must be a single line: {text!r}"
        raise ValueError(msg)
    return text


def _render_fields(obj: Any, prefix: str, skip: frozenset[str]) -> Iterator[str]:
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        yield f"{prefix} {f.name} {_format_value(f.name, value)}".rstrip()


@dataclass
class FakeNvmlConfig:
    """The whole fake system; ``gpus[i]`` is GPU index ``i``."""

    gpus: list[FakeGpu] = field(default_factory=list)
    driver_version: str = "570.86.15"
    cuda_driver_version: int = 12080
    init_error: int | None = None
    nvml_version: str | None = None
    # exported function name -> seconds every call of it hangs
    blocks: dict[str, float] = field(default_factory=dict)

    def render(self) -> str:
        lines = ["# fake NVML configuration"]
        if self.init_error is not None:
            lines.append(f"init_error {self.init_error}")
        lines.append(f"driver_version {_format_value('driver_version', self.driver_version)}")
        lines.append(f"cuda_driver_version {self.cuda_driver_version}")
        if self.nvml_version is not None:
            lines.append(f"nvml_version {_format_value('nvml_version', self.nvml_version)}")
        lines.extend(f"block {symbol} {float(secs)!r}" for symbol, secs in self.blocks.items())
        for i, gpu in enumerate(self.gpus):
            prefix = f"gpu {i}"
            # Always emit one line so that GPUs without any set field still count.
            lines.append(f"{prefix} lost {1 if gpu.lost else 0}")
            lines.extend(_render_fields(gpu, prefix, _SPECIAL_GPU_FIELDS))
            for key, rc in gpu.errors.items():
                lines.append(f"{prefix} error {key} {int(rc)}")
            for xid in gpu.xids:
                lines.append(f"{prefix} xid {' '.join(str(int(v)) for v in xid)}")
            fields = gpu.fields
            if gpu.recovery_action is not None:
                fields = {"230": gpu.recovery_action, **fields}
            lines.extend(f"{prefix} field {key} {int(v)}" for key, v in fields.items())
            for key, secs in gpu.blocks.items():
                lines.append(f"{prefix} block {key} {float(secs)!r}")
            lines.extend(f"{prefix} process {p.statement()}" for p in gpu.processes)
            lines.extend(f"{prefix} mps_process {p.statement()}" for p in gpu.mps_processes)
            lines.extend(f"{prefix} process_util {u.statement()}" for u in gpu.process_util)
            for j, mig in enumerate(gpu.mig):
                mprefix = f"{prefix} mig {j}"
                mig_lines = list(_render_fields(mig, mprefix, _SPECIAL_MIG_FIELDS))
                mig_lines.extend(f"{mprefix} error {k} {int(rc)}" for k, rc in mig.errors.items())
                # A MIG slot needs at least one line to exist.
                lines.extend(mig_lines or [f"{mprefix} defined 1"])
        return "\n".join(lines) + "\n"

    def write(self, path: Path | str) -> Path:
        """Atomically replace ``path`` with this config (temp file + rename).

        The new file always gets a different inode and an mtime strictly greater
        than the previous one, so the library notices the change even within
        one timestamp tick.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = self.render().encode()
        try:
            previous_ns = target.stat().st_mtime_ns
        except FileNotFoundError:
            previous_ns = 0
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            mtime_ns = _next_mtime_ns(previous_ns)
            os.utime(tmp_name, ns=(mtime_ns, mtime_ns))
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return target


_mtime_lock = threading.Lock()
_last_mtime_ns = 0


def _next_mtime_ns(previous_ns: int) -> int:
    global _last_mtime_ns
    with _mtime_lock:
        # +1 µs keeps the value distinct on file systems with coarser timestamps.
        value = max(time.time_ns(), previous_ns + 1000, _last_mtime_ns + 1000)
        _last_mtime_ns = value
        return value


# --------------------------------------------------------------------------
# Realistic layouts


def _uuid_for(kind: str, label: str) -> str:
    return str(uuid.uuid5(_UUID_NAMESPACE, f"{kind}:{label}"))


H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEM_TOTAL = 81559 * 1024 * 1024
H100_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
GB200_NAME = "NVIDIA GB200"
GB200_MEM_TOTAL = 189471 * 1024 * 1024


def _h100(i: int, bus: int) -> FakeGpu:
    used = (i + 1) * 512 * 1024 * 1024
    return FakeGpu(
        uuid=f"GPU-{_uuid_for('h100', str(i))}",
        serial=f"165242301{i + 1:04d}",
        name=H100_NAME,
        pci_bus_id=f"00000000:{bus:02X}:00.0",
        pci_device_id=0x233010DE,
        pci_subsystem_id=0x16C110DE,
        minor=i,
        module_id=i + 1,
        board_part_number="692-2G520-0200-000",
        mig_mode=0,
        persistence_mode=1,
        util_gpu=10 * i,
        util_mem=5 * i,
        util_enc=0,
        util_dec=0,
        mem_total=H100_MEM_TOTAL,
        mem_used=used,
        mem_free=H100_MEM_TOTAL - used,
        temperature=30 + i,
        power_mw=70_000 + 1000 * i,
        energy_mj=1_000_000_000 + i,
        clock_sm=1980,
        clock_mem=2619,
        pcie_replay=0,
        ecc_vol_corr=0,
        ecc_vol_uncorr=0,
        ecc_agg_corr=i,
        ecc_agg_uncorr=0,
        retired_pending=0,
        remap_corr=0,
        remap_unc=0,
        remap_pending=0,
        remap_failure=0,
        clocks_event_reasons=0x1,
        errors={"platform_info": NVML_ERROR_NOT_SUPPORTED},
    )


def with_links(gpu: FakeGpu, *, gen: int = 5, width: int = 16, nvlinks: int | None = 18) -> FakeGpu:
    """`gpu` with a healthy PCIe link (gen/width at their maximum) and, unless `nvlinks` is
    None, that many active NVLinks with zero error counters."""
    gpu.pcie_gen = gpu.pcie_max_gen = gpu.pcie_gpu_max_gen = gen
    gpu.pcie_width = gpu.pcie_max_width = width
    if nvlinks is not None:
        zeros = ",".join("0" * nvlinks)
        gpu.nvlink_links, gpu.nvlink_down = nvlinks, 0
        gpu.nvlink_replay = gpu.nvlink_recovery = zeros
        gpu.nvlink_crc_flit = gpu.nvlink_crc_data = zeros
    return gpu


def h100x8() -> FakeNvmlConfig:
    """An HGX H100 node: 8 x "NVIDIA H100 80GB HBM3", no platform info."""
    return FakeNvmlConfig(gpus=[_h100(i, bus) for i, bus in enumerate(H100_PCI_BUSES)])


def gb200x4() -> FakeNvmlConfig:
    """One GB200 compute tray: 4 GPUs, die pairs (0,1) and (2,3) share a board serial."""
    chassis = "1821324190123"
    cluster = _uuid_for("gb200-cluster", "0")
    domains = (0x8, 0x9, 0x18, 0x19)
    serials = ("1655124010101", "1655124010101", "1655124010202", "1655124010202")
    gpus = []
    for i, (domain, serial) in enumerate(zip(domains, serials, strict=True)):
        used = 1024 * 1024 * 1024 * (i + 1)
        gpus.append(
            FakeGpu(
                uuid=f"GPU-{_uuid_for('gb200', str(i))}",
                serial=serial,
                name=GB200_NAME,
                pci_bus_id=f"{domain:08X}:01:00.0",
                pci_device_id=0x294110DE,
                pci_subsystem_id=0x20CA10DE,
                minor=i,
                module_id=i + 1,
                board_part_number="699-2G548-1201-000",
                chassis_serial=chassis,
                slot=7,
                tray=3,
                host_id=1,
                peer_type=0,
                platform_module_id=i + 1,
                ib_guid=f"a088c2030041{i:02x}f0" + "0" * 16,
                mig_mode=0,
                persistence_mode=1,
                util_gpu=20 + i,
                util_mem=3 + i,
                util_enc=0,
                util_dec=0,
                mem_total=GB200_MEM_TOTAL,
                mem_used=used,
                mem_free=GB200_MEM_TOTAL - used,
                temperature=40 + i,
                power_mw=180_000 + 1000 * i,
                energy_mj=5_000_000_000 + i,
                clock_sm=1965,
                clock_mem=3996,
                pcie_replay=0,
                ecc_vol_corr=0,
                ecc_vol_uncorr=0,
                ecc_agg_corr=0,
                ecc_agg_uncorr=0,
                retired_pending=0,
                remap_corr=0,
                remap_unc=0,
                remap_pending=0,
                remap_failure=0,
                clocks_event_reasons=0,
                fabric_state=3,  # NVML_GPU_FABRIC_STATE_COMPLETED
                fabric_status=0,
                fabric_health_mask=0,
                fabric_health_summary=1,  # HEALTHY
                fabric_clique_id=32766,
                fabric_cluster_uuid=cluster,
            )
        )
    return FakeNvmlConfig(gpus=gpus, driver_version="570.124.06", cuda_driver_version=12080)


def mig_h100() -> FakeNvmlConfig:
    """One H100 in MIG mode with a 3g.40gb and a 1g.10gb instance."""
    gpu = _h100(0, H100_PCI_BUSES[0])
    gpu.mig_mode = 1
    gpu.mig = [
        FakeMig(
            uuid=f"MIG-{_uuid_for('mig', '0')}",
            name=f"{H100_NAME} MIG 3g.40gb",
            gi_id=2,
            ci_id=0,
            mem_total=40192 * 1024 * 1024,
            mem_used=13 * 1024 * 1024,
        ),
        FakeMig(
            uuid=f"MIG-{_uuid_for('mig', '1')}",
            name=f"{H100_NAME} MIG 1g.10gb",
            gi_id=9,
            ci_id=0,
            mem_total=9856 * 1024 * 1024,
            mem_used=6 * 1024 * 1024,
        ),
    ]
    return FakeNvmlConfig(gpus=[gpu])
