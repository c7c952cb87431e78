"""Records: one typed record per kind, the one serializer to and from the wire, and the
emitters that turn snapshots and state changes into records."""

from gpuid_agent.records.serialize import from_wire, to_wire
from gpuid_agent.records.types import (
    AllocationRecord,
    AnyRecord,
    HardwareRecord,
    HealthRecord,
    ReadingRecord,
)

__all__ = [
    "AllocationRecord",
    "AnyRecord",
    "HardwareRecord",
    "HealthRecord",
    "ReadingRecord",
    "from_wire",
    "to_wire",
]
