"""Simulated node layouts, deterministic per node name so each simulated node is distinct."""

from __future__ import annotations

import hashlib
import uuid as uuidlib
from dataclasses import dataclass, field

from gpuid_agent.facts import PlatformInfo


@dataclass(slots=True)
class SimMig:
    uuid: str
    name: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int


@dataclass(slots=True)
class SimProcess:
    """A process the simulated driver lists on a GPU (host PID), and its share of the GPU."""

    pid: int
    memory: int  # bytes
    sm_util: int  # percent
    mps: bool = False


@dataclass(slots=True)
class SimGpu:
    uuid: str
    serial: str | None
    name: str
    pci_bus_id: str
    minor_number: int
    module_id: int | None
    board_part_number: str
    memory_total: int
    platform: PlatformInfo | None = None
    mig: list[SimMig] = field(default_factory=list)
    lost: bool = False
    processes: list[SimProcess] = field(default_factory=list)
    # utilization and memory follow the processes (a GPU without any reads idle)
    telemetry_from_processes: bool = False


def _digits(seed: str, n: int) -> str:
    digest = hashlib.sha256(seed.encode()).hexdigest()
    return str(int(digest, 16))[:n]


def _uuid(seed: str, prefix: str = "GPU") -> str:
    return f"{prefix}-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, seed)}"


def h100x8(node: str) -> list[SimGpu]:
    """HGX H100: 8 GPUs, 8 serials, no platform info."""
    return [
        SimGpu(
            uuid=_uuid(f"{node}/gpu{i}"),
            serial=_digits(f"{node}/serial{i}", 13),
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id=f"00000000:{0x18 + i * 0x10:02X}:00.0",
            minor_number=i,
            module_id=i + 1,
            board_part_number="692-2G520-0200-000",
            memory_total=81559 * 1024 * 1024,
        )
        for i in range(8)
    ]


def gb200x4(node: str) -> list[SimGpu]:
    """GB200 compute tray: 4 GPUs, the two dies of each superchip share one serial."""
    chassis = _digits(f"{node}/chassis", 13)
    gpus = []
    for i in range(4):
        module = i + 1
        gpus.append(
            SimGpu(
                uuid=_uuid(f"{node}/gpu{i}"),
                serial=_digits(f"{node}/superchip{i // 2}", 13),
                name="NVIDIA GB200",
                pci_bus_id=f"00000008:{0x01 + i:02X}:00.0",
                minor_number=i,
                module_id=module,
                board_part_number="699-2G548-1200-A00",
                memory_total=189471 * 1024 * 1024,
                platform=PlatformInfo(
                    chassis_serial=chassis,
                    slot_number=7,
                    tray_index=3,
                    host_id=1,
                    peer_type=0,
                    module_id=module,
                ),
            )
        )
    return gpus


def mig_h100(node: str) -> list[SimGpu]:
    """Two H100s, the first split into MIG devices."""
    gpus = h100x8(node)[:2]
    gpus[0].mig = [
        SimMig(_uuid(f"{node}/mig0/{j}", "MIG"), f"NVIDIA H100 80GB HBM3 MIG {p}", gi, 0, mem)
        for j, (p, gi, mem) in enumerate(
            [
                ("3g.40gb", 1, 40 * 1024**3),
                ("2g.20gb", 2, 20 * 1024**3),
                ("1g.10gb", 9, 10 * 1024**3),
            ]
        )
    ]
    return gpus


def timesliced(node: str) -> list[SimGpu]:
    """HGX H100 whose pods run processes (simulate/process_tree.py): a time-sliced GPU shared by
    three pods, a training pod, an idle notebook, a GPU busy with a pod that holds none."""
    return h100x8(node)


def dra_h100(node: str) -> list[SimGpu]:
    """Four H100s under NVIDIA's DRA driver, the first split into MIG devices the driver
    created for claims (see simulate/dra.py for the pods and ResourceSlices)."""
    gpus = h100x8(node)[:4]
    gpus[0].mig = mig_h100(node)[0].mig
    return gpus


PROFILES = {
    "h100x8": h100x8,
    "gb200x4": gb200x4,
    "mig": mig_h100,
    "timesliced": timesliced,
    "dra": dra_h100,
}
# profiles whose pods run processes: process attribution is on for them
PROCESS_PROFILES = frozenset({"timesliced"})
# profiles whose pods get their GPUs through DRA claims instead of device plugins
DRA_PROFILES = frozenset({"dra"})
