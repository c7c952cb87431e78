"""Records for the exporter tests, built by the agent's own record code."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory, PlatformInfo
from gpuid_agent.records.readings import SCHEMA_VERSION, reading_records, record_id, rfc3339

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
) -> list[dict[str, Any]]:
    """`snapshots` consecutive readings of one node (4 records each by default)."""
    start = kw.pop("read_time", BASE_TIME)
    out: list[dict[str, Any]] = []
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
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "allocation",
        "cluster": "c1",
        "node": node,
        "machine": "m1",
        "gpu": serial,
        "uuid": uuid,
        "mig_uuid": None,
        "namespace": namespace,
        "pod": pod,
        "pod_uid": f"uid-{pod}",
        "container": "main",
        "resource_name": "nvidia.com/gpu",
        "device_id": uuid,
        "workload_kind": workload[0] if workload else None,
        "workload_name": workload[1] if workload else None,
        "started_at": rfc3339(started_at),
        "ended_at": rfc3339(ended_at) if ended_at else None,
        "event": "end" if ended_at else "start",
    }
    if allocation_id:
        record["allocation_id"] = allocation_id
    record["record_id"] = record_id(record)
    return record


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
