"""Hypothesis strategies for typed records of every kind, hostile strings included."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from gpuid_agent.records.types import (
    SCHEMA_VERSION,
    AllocationRecord,
    HardwareRecord,
    HealthRecord,
    ReadingRecord,
)

# Any code point, lone surrogates included: NVML and the API server hand over whatever they hold.
HOSTILE = st.text(st.characters(exclude_categories=()), max_size=12) | st.sampled_from(
    ["", "\t\n\\\"',", "\x00", "é😀", "\u2028", "null"]
)
# Reading and health ids hash the record as JSON, which a lone surrogate cannot be written in
# (`to_wire` refuses those records before any exporter sees them).
HASHABLE = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", "\t\n\\\"',", "\x00", "é😀"]
)
INT = st.integers(-(2**63), 2**63 - 1)


def _opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


def _header(text: st.SearchStrategy[str]) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "schema_version": st.just(SCHEMA_VERSION),
        "cluster": text,
        "node": text,
        "machine": text,
        "source": text,
        "chassis": text,
        "gpu": text,
        "read_time": text,
    }


READINGS = st.builds(
    ReadingRecord,
    kind=st.just("reading"),
    uuid=HASHABLE,
    index=INT,
    model=_opt(HASHABLE),
    pci_bus_id=_opt(HASHABLE),
    module_id=_opt(INT),
    board_part_number=_opt(HASHABLE),
    driver_version=_opt(HASHABLE),
    machine_source=HASHABLE,
    mig_devices=st.lists(HASHABLE, max_size=3).map(tuple),
    reason=HASHABLE,
    change=HASHABLE,
    **_header(HASHABLE),
)
HEALTH = st.builds(
    HealthRecord,
    kind=st.just("health"),
    uuid=_opt(HASHABLE),
    index=_opt(INT),
    check=HASHABLE,
    state=HASHABLE,
    previous_state=_opt(HASHABLE),
    action=HASHABLE,
    reason=_opt(HASHABLE),
    since=HASHABLE,
    gpu_state=_opt(HASHABLE),
    machine_source=HASHABLE,
    holders=st.lists(st.dictionaries(HASHABLE, HASHABLE, max_size=3), max_size=2).map(tuple),
    **_header(HASHABLE),
)
ALLOCATIONS = st.builds(
    AllocationRecord,
    kind=st.just("allocation"),
    record_id=HOSTILE,
    event=st.sampled_from(["start", "end", "usage"]),
    machine_source=HOSTILE,
    allocation_id=HOSTILE,
    serial=_opt(HOSTILE),
    uuid=HOSTILE,
    gpu_index=_opt(INT),
    mig_uuid=_opt(HOSTILE),
    mig_gpu_instance_id=_opt(INT),
    mig_profile=_opt(HOSTILE),
    namespace=HOSTILE,
    pod=HOSTILE,
    pod_uid=_opt(HOSTILE),
    container=HOSTILE,
    resource_name=HOSTILE,
    device_id=HOSTILE,
    replica=_opt(INT),
    workload_kind=_opt(HOSTILE),
    workload_name=_opt(HOSTILE),
    started_at=HOSTILE,
    start_observed=st.booleans(),
    ended_at=_opt(HOSTILE),
    end_observed=st.none() | st.booleans(),
    last_seen_at=_opt(HOSTILE),
    claim_namespace=_opt(HOSTILE),
    claim_name=_opt(HOSTILE),
    claim_source=_opt(HOSTILE),
    gpu_seconds=_opt(st.floats(min_value=0, max_value=1e12)),
    energy_joules=_opt(st.floats(min_value=0, max_value=1e15)),
    usage_start=_opt(HOSTILE),
    **_header(HOSTILE),
)
HARDWARE = st.builds(
    HardwareRecord,
    kind=st.just("hardware"),
    record_id=HOSTILE,
    event=st.sampled_from(["replaced", "added"]),
    machine_source=HOSTILE,
    pci_bus_id=HOSTILE,
    old_serial=_opt(HOSTILE),
    new_serial=_opt(HOSTILE),
    uuid=_opt(HOSTILE),
    index=_opt(INT),
    **_header(HOSTILE),
)
RECORDS = READINGS | HEALTH | ALLOCATIONS | HARDWARE
