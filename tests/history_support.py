"""A small fleet's records with known answers, for `gpuid-agent history` on every source.

Cluster `prod`, March 2025 (UTC). Node gpu-1 (chassis CH-1) has the GB200 superchips SN-A
(dies in slots 0000:01 and 0000:02) and SN-B (0000:03, 0000:04). On day 1 ml/train-0 holds
both dies of SN-A from 10:00 to 16:00 (an XID 79 hits SN-A at 14:00) and inf/serve-0 holds
SN-B's first die from 12:00 on (still open). On day 3 SN-A is in gpu-2 (chassis CH-2, beside
SN-C), where ml/train-1 holds its first die from 10:00 to 12:30; gpu-1 got SN-D in its slots
(a `replaced` record at 08:00). Every allocation has its hourly usage records; a GPU's idle
hour has one too (nobody's), and one usage record is sent twice.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory, PlatformInfo
from gpuid_agent.records.readings import SCHEMA_VERSION, reading_records, rfc3339
from gpuid_agent.records.types import AllocationRecord, AnyRecord, HardwareRecord, HealthRecord

DAY1 = datetime(2025, 3, 1, tzinfo=UTC)
WATTS = 500.0  # every GPU draws this much: joules = 500 x GPU-seconds
SLOTS = ("00000000:01:00.0", "00000000:02:00.0", "00000000:03:00.0", "00000000:04:00.0")


def at(day: int, hour: float) -> datetime:
    return DAY1 + timedelta(days=day - 1, hours=hour)


def _digest(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:32]


def uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def _inventory(node: str, chassis: str, serials: list[str], when: datetime) -> NodeInventory:
    gpus = tuple(
        GpuIdentity(
            index=i,
            uuid=uuid(node, i) if serial != "SN-A" or node == "gpu-1" else f"GPU-SN-A-{i}",
            serial=serial,
            name="NVIDIA GB200",
            pci_bus_id=SLOTS[i],
            platform=PlatformInfo(chassis, 1, i, 1, 0, i + 1),
        )
        for i, serial in enumerate(serials)
    )
    return NodeInventory(node, "prod", f"m-{node}", "dmi", "570.1", "12.8", gpus, when)


def readings() -> list[AnyRecord]:
    out: list[AnyRecord] = []
    gpu1_before = ["SN-A", "SN-A", "SN-B", "SN-B"]
    for when in (at(1, 9), at(1, 21), at(2, 9)):
        out += reading_records(_inventory("gpu-1", "CH-1", gpu1_before, when),
                               source="test/agent", reason="heartbeat")  # fmt: skip
    for when in (at(3, 9), at(3, 21)):
        out += reading_records(_inventory("gpu-1", "CH-1", ["SN-D", "SN-D", "SN-B", "SN-B"], when),
                               source="test/agent", reason="heartbeat")  # fmt: skip
        out += reading_records(_inventory("gpu-2", "CH-2", ["SN-A", "SN-A", "SN-C", "SN-C"], when),
                               source="test/agent", reason="heartbeat")  # fmt: skip
    return out


def _allocation(
    event: str,
    node: str,
    gpu_uuid: str,
    serial: str,
    namespace: str,
    pod: str,
    start: datetime,
    end: datetime | None = None,
    **extra: Any,
) -> AllocationRecord:
    allocation_id = _digest(node, gpu_uuid, namespace, pod, rfc3339(start))
    idle = not namespace
    return AllocationRecord(
        schema_version=SCHEMA_VERSION,
        kind="allocation",
        record_id=_digest(allocation_id, event, rfc3339(extra.get("usage_from", start))),
        event=event,  # type: ignore[arg-type]
        cluster="prod",
        node=node,
        machine=f"m-{node}",
        machine_source="dmi",
        source="test/agent",
        chassis="CH-1" if node == "gpu-1" else "CH-2",
        gpu=serial,
        read_time=rfc3339(extra.get("read_time", end or start)),
        allocation_id=allocation_id,
        serial=serial,
        uuid=gpu_uuid,
        gpu_index=None,
        mig_uuid=None,
        mig_gpu_instance_id=None,
        mig_profile=None,
        namespace=namespace,
        pod=pod,
        pod_uid=None if idle else f"uid-{pod}",
        container="" if idle else "main",
        resource_name="" if idle else "nvidia.com/gpu",
        device_id=gpu_uuid,
        replica=None,
        workload_kind=None if idle else "Job",
        workload_name=None if idle else pod.rsplit("-", 1)[0],
        started_at=rfc3339(start),
        start_observed=True,
        ended_at=rfc3339(end) if event == "end" and end else None,
        end_observed=True if event == "end" else None,
        gpu_seconds=extra.get("gpu_seconds"),
        energy_joules=extra.get("energy_joules"),
        usage_start=rfc3339(extra["usage_from"]) if "usage_from" in extra else None,
    )


def _held(
    node: str, index: int, serial: str, namespace: str, pod: str, start: datetime,
    end: datetime | None, last: datetime,
) -> list[AllocationRecord]:  # fmt: skip
    """Start, hourly usage up to `end` (or `last` while open) and the end with its totals."""
    gpu_uuid = uuid(node, index) if node == "gpu-1" else f"GPU-SN-A-{index}"
    records = [] if not namespace else [
        _allocation("start", node, gpu_uuid, serial, namespace, pod, start)
    ]  # fmt: skip
    until = end or last
    moment = start
    while moment < until:
        step = min(moment.replace(minute=0) + timedelta(hours=1), until)
        seconds = (step - moment).total_seconds()
        records.append(
            _allocation("usage", node, gpu_uuid, serial, namespace, pod, start, None,
                        usage_from=moment, read_time=step, gpu_seconds=seconds,
                        energy_joules=seconds * WATTS)
        )
        moment = step
    if end is not None and namespace:
        seconds = (end - start).total_seconds()
        records.append(
            _allocation("end", node, gpu_uuid, serial, namespace, pod, start, end,
                        gpu_seconds=seconds, energy_joules=seconds * WATTS)
        )
    return records


def allocations() -> list[AnyRecord]:
    out: list[AnyRecord] = []
    out += _held("gpu-1", 0, "SN-A", "ml", "train-0", at(1, 10), at(1, 16), at(1, 16))
    out += _held("gpu-1", 1, "SN-A", "ml", "train-0", at(1, 10), at(1, 16), at(1, 16))
    out += _held("gpu-1", 2, "SN-B", "inf", "serve-0", at(1, 12), None, at(2, 0))
    out += _held("gpu-2", 0, "SN-A", "ml", "train-1", at(3, 10), at(3, 12.5), at(3, 12.5))
    out += _held("gpu-1", 3, "SN-B", "", "", at(1, 10), at(1, 11), at(1, 11))  # idle
    return [*out, out[3]]  # a usage record sent twice


def marks() -> list[AnyRecord]:
    def transition(when: datetime, state: str, previous: str, reason: str | None) -> HealthRecord:
        return HealthRecord(
            schema_version=SCHEMA_VERSION, kind="health", cluster="prod", node="gpu-1",
            machine="m-gpu-1", source="test/agent", chassis="CH-1", gpu="SN-A",
            read_time=rfc3339(when), uuid=uuid("gpu-1", 0), index=0, check="xid", state=state,
            previous_state=previous, action="reboot" if state == "unhealthy" else "none",
            reason=reason, since=rfc3339(when), gpu_state=state, machine_source="dmi",
            holders=({"namespace": "ml", "pod": "train-0", "container": "main"},),
        )  # fmt: skip

    replaced = HardwareRecord(
        schema_version=SCHEMA_VERSION, kind="hardware", record_id=_digest("replaced", "gpu-1"),
        event="replaced", cluster="prod", node="gpu-1", machine="m-gpu-1", machine_source="dmi",
        source="test/agent", chassis="CH-1", gpu="SN-D", read_time=rfc3339(at(3, 8)),
        pci_bus_id=SLOTS[0], old_serial="SN-A", new_serial="SN-D", uuid=uuid("gpu-1", 0), index=0,
    )  # fmt: skip
    return [
        transition(at(1, 14), "unhealthy", "healthy", "XID 79: GPU has fallen off the bus"),
        replaced,
    ]


def fleet() -> list[AnyRecord]:
    return readings() + allocations() + marks()


# What each question answers, as `history ... --json` prints it (the lists' essentials).
GPU_SN_A_PLACEMENTS = [
    ("gpu-1", "CH-1", [SLOTS[0], SLOTS[1]], "2025-03-01T09:00:00.000Z", "2025-03-02T09:00:00.000Z"),
    ("gpu-2", "CH-2", [SLOTS[0], SLOTS[1]], "2025-03-03T09:00:00.000Z", "2025-03-03T21:00:00.000Z"),
]
