"""Records for the exporter tests, built by the agent's own record code."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory, PlatformInfo
from gpuid_agent.records.readings import SCHEMA_VERSION, reading_records, rfc3339
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AllocationRecord, AnyRecord, HealthRecord, ReadingRecord

BASE_TIME = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def inventory(
    *,
    cluster: str = "c1",
    node: str = "n1",
    machine: str = "m1",
    serials: list[str] | None = None,
    chassis: str | None = "CH-1",
    read_time: datetime = BASE_TIME,
) -> NodeInventory:
    serials = serials or ["SN-A", "SN-A", "SN-B", "SN-B"]  # GB200: two dies per serial
    gpus = tuple(
        GpuIdentity(
            index=i,
            uuid=f"GPU-{node}-{i}",
            serial=serial,
            name="NVIDIA GB200",
            pci_bus_id=f"0000:0{i}:00.0",
            module_id=i + 1,
            platform=None
            if chassis is None
            else PlatformInfo(
                chassis, slot_number=1, tray_index=2, host_id=1, peer_type=0, module_id=i + 1
            ),
        )
        for i, serial in enumerate(serials)
    )
    return NodeInventory(node, cluster, machine, "test", "570.1", "12.8", gpus, read_time)


def readings(
    snapshots: int = 1, step: timedelta = timedelta(milliseconds=1), **kw: Any
) -> list[ReadingRecord]:
    """`snapshots` consecutive readings of one node (4 records each by default)."""
    start = kw.pop("read_time", BASE_TIME)
    out: list[ReadingRecord] = []
    for i in range(snapshots):
        out += reading_records(
            inventory(read_time=start + i * step, **kw), source="test/agent", reason="heartbeat"
        )
    return out


def allocation(
    *,
    pod: str,
    namespace: str = "ml",
    uuid: str = "GPU-n1-0",
    serial: str = "SN-A",
    started_at: datetime = BASE_TIME,
    ended_at: datetime | None = None,
    node: str = "n1",
    workload: tuple[str, str] | None = ("Deployment", "trainer"),
    allocation_id: str | None = None,
) -> AllocationRecord:
    """A start (or, with `ended_at`, the end) of one container's allocation of one GPU."""
    alloc_id = allocation_id or _digest("allocation", node, namespace, pod, uuid)
    event = "end" if ended_at else "start"
    started = rfc3339(started_at)
    return AllocationRecord(
        schema_version=SCHEMA_VERSION,
        kind="allocation",
        record_id=_digest(alloc_id, event),
        event=event,
        cluster="c1",
        node=node,
        machine="m1",
        machine_source="test",
        source="test/agent",
        chassis="CH-1",
        gpu=serial,
        read_time=rfc3339(ended_at) if ended_at else started,
        allocation_id=alloc_id,
        serial=serial,
        uuid=uuid,
        gpu_index=None,
        mig_uuid=None,
        mig_gpu_instance_id=None,
        mig_profile=None,
        namespace=namespace,
        pod=pod,
        pod_uid=f"uid-{pod}",
        container="main",
        resource_name="nvidia.com/gpu",
        device_id=uuid,
        replica=None,
        workload_kind=workload[0] if workload else None,
        workload_name=workload[1] if workload else None,
        started_at=started,
        start_observed=True,
        ended_at=rfc3339(ended_at) if ended_at else None,
        end_observed=True if ended_at else None,
    )


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def spool_files(directory: Path) -> list[Path]:
    """The batch files of one exporter's spool directory (whatever their stored form)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


def spooled_record_ids(path: Path) -> list[str]:
    """The record ids one spool file holds: JSON lines, or the PostgreSQL exporter's COPY
    text (read with its own decoder, which the tests of that form check separately)."""
    data = path.read_bytes()
    if path.suffix == ".ndjson":
        return [json.loads(line)["record_id"] for line in data.splitlines() if line.strip()]
    from gpuid_agent.delivery.exporters.postgres import rows as rowmap
    from gpuid_agent.delivery.exporters.postgres.copytext import Payload, column_values

    payload = Payload.decode(data)
    ids = column_values(payload.readings, rowmap.READING_COLUMNS.index("record_id"))
    ids += column_values(payload.allocations, rowmap.ALLOCATION_COLUMNS.index("record_id"))
    ids += column_values(payload.events, rowmap.EVENT_COLUMNS.index("record_id"))
    return ids


def numbered(count: int, *, node: str = "n1", padding: int = 0) -> list[ReadingRecord]:
    """`count` readings told apart by their uuid, `r<i>` (each `padding` characters longer)."""
    read_time = rfc3339(BASE_TIME)
    return [
        ReadingRecord(
            schema_version=SCHEMA_VERSION,
            kind="reading",
            cluster="c1",
            node=node,
            machine="m1",
            source="test/agent",
            chassis="CH-1",
            gpu=f"SN-{i}",
            read_time=read_time,
            uuid=f"r{i}",
            index=i,
            model="NVIDIA GB200",
            pci_bus_id=None,
            module_id=None,
            board_part_number=None,
            driver_version="570.1",
            machine_source="test",
            mig_devices=(),
            reason="heartbeat" + "x" * padding,
            change="unchanged",
        )
        for i in range(count)
    ]


def wire_id(record: AnyRecord) -> str:
    """The record id a sink receives for `record`."""
    return str(to_wire(record)["record_id"])


def health(
    *, check: str = "xid", state: str = "degraded", node: str = "n1", uuid: str = "GPU-n1-0"
) -> HealthRecord:
    """One GPU's health check changing state."""
    at = rfc3339(BASE_TIME)
    return HealthRecord(
        schema_version=SCHEMA_VERSION,
        kind="health",
        cluster="c1",
        node=node,
        machine="m1",
        source="test/agent",
        chassis="CH-1",
        gpu="SN-A",
        read_time=at,
        uuid=uuid,
        index=0,
        check=check,
        state=state,
        previous_state="healthy",
        action="none",
        reason="XID 79",
        since=at,
        gpu_state=state,
        machine_source="test",
    )
