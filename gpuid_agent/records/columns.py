"""The one column registry: every column the PostgreSQL tables and S3 CSV objects fill from
records, with its types, the record kinds that carry it and what it means. The readings DDL,
the row mappings, the CSV header and the docs' column tables are all read from here."""

from __future__ import annotations

from dataclasses import dataclass

from gpuid_agent.records.types import Kind

_TEXT = "VARCHAR(255)"
_TEXT_NN = "VARCHAR(255) NOT NULL"
_TIME = "TIMESTAMP WITH TIME ZONE"
_STAGED = {"VARCHAR": "TEXT", "TIMESTAMP": "TIMESTAMPTZ"}


@dataclass(frozen=True, slots=True)
class Column:
    name: str  # the PostgreSQL column
    sql: str  # its declared type
    csv_type: str  # CSV/Parquet-style logical type
    kinds: tuple[Kind, ...]  # record kinds that carry it
    description: str
    field: str = ""  # the record field, when not named like the column
    csv: str = ""  # its name in S3 CSV objects; "" = not written there
    gpuid: bool = False  # in gpuid's own CREATE TABLE
    default: str = ""  # DEFAULT when added to an existing table

    @property
    def source(self) -> str:
        return self.field or self.name

    @property
    def staged(self) -> str:
        """Its type in the per-connection staging table that COPY fills."""
        head = self.sql.split()[0]
        return _STAGED.get(head.split("(")[0], head)

    @property
    def ddl(self) -> str:
        return f"{self.name} {self.declared}"

    @property
    def declared(self) -> str:
        return f"{self.sql} DEFAULT {self.default}" if self.default else self.sql


def _reading(name: str, sql: str, csv_type: str, description: str, **kw: str | bool) -> Column:
    return Column(name, sql, csv_type, ("reading",), description, **kw)  # type: ignore[arg-type]


def _alloc(name: str, sql: str, csv_type: str, description: str, **kw: str | bool) -> Column:
    return Column(name, sql, csv_type, ("allocation",), description, **kw)  # type: ignore[arg-type]


# The readings table (gpuid-compatible), in row (COPY) order; CSV keeps this order too.
READINGS: tuple[Column, ...] = (
    _reading("cluster", _TEXT_NN, "string", "cluster name", csv="cluster", gpuid=True),
    _reading("node", _TEXT_NN, "string", "Kubernetes node", csv="node", gpuid=True),
    _reading(
        "machine", _TEXT_NN, "string", "machine id (providerID or DMI)", csv="machine", gpuid=True
    ),
    _reading("source", _TEXT_NN, "string", "agent and version", csv="source", gpuid=True),
    _reading(
        "chassis", _TEXT_NN, "string", "chassis serial", csv="chassis", gpuid=True, default="''"
    ),
    _reading("gpu", _TEXT_NN, "string", "GPU serial", csv="gpu", gpuid=True),
    _reading(
        "read_time", f"{_TIME} NOT NULL", "timestamp", "when NVML was read", csv="time", gpuid=True
    ),
    _reading("record_id", _TEXT, "string", "idempotency key (unique index)", csv="record_id"),
    _reading("schema_version", "INTEGER", "int32", "record schema version"),
    _reading("uuid", _TEXT, "string", "GPU UUID", csv="uuid"),
    _reading("gpu_index", "INTEGER", "int32", "NVML index", field="index", csv="index"),
    _reading("model", _TEXT, "string", "GPU model name", csv="model"),
    _reading("pci_bus_id", _TEXT, "string", "PCI bus id", csv="pci_bus_id"),
    _reading("module_id", "INTEGER", "int32", "module id on the board", csv="module_id"),
    _reading("board_part_number", _TEXT, "string", "board part number"),
    _reading("driver_version", _TEXT, "string", "NVIDIA driver version", csv="driver_version"),
    _reading("machine_source", _TEXT, "string", "where `machine` came from"),
    _reading("mig_devices", "TEXT[]", "list<string>", "MIG device UUIDs"),
    _reading("reason", _TEXT, "string", "startup, change or heartbeat", csv="reason"),
    _reading("change", _TEXT, "string", "what changed for this GPU", csv="change"),
    _reading("attributes", "JSONB", "json", "fields without a column, originals of changed values"),
)

# The allocations table's columns filled from each record, in row (COPY) order.
ALLOCATIONS: tuple[Column, ...] = (
    _alloc("allocation_id", f"{_TEXT} PRIMARY KEY", "string", "the allocation's id"),
    _alloc("record_id", _TEXT, "string", "staged only: lands in start_record_id or end_record_id"),
    _alloc("cluster", _TEXT_NN, "string", "cluster name"),
    _alloc("node", _TEXT_NN, "string", "Kubernetes node"),
    _alloc("machine", _TEXT_NN, "string", "machine id", default="''"),
    _alloc("gpu", _TEXT_NN, "string", "GPU serial (`gpu` or `serial`)", default="''"),
    _alloc("uuid", _TEXT, "string", "GPU UUID"),
    _alloc("mig_uuid", _TEXT, "string", "MIG device UUID"),
    _alloc("namespace", _TEXT, "string", "pod namespace"),
    _alloc("pod", _TEXT, "string", "pod name"),
    _alloc("pod_uid", _TEXT, "string", "pod UID (with the Kubernetes API)"),
    _alloc("container", _TEXT, "string", "container name"),
    _alloc("resource_name", _TEXT, "string", "extended resource"),
    _alloc("device_id", _TEXT, "string", "device id the kubelet reports"),
    _alloc("workload_kind", _TEXT, "string", "owning workload's kind"),
    _alloc("workload_name", _TEXT, "string", "owning workload's name"),
    _alloc("claim_namespace", _TEXT, "string", "DRA claim's namespace (DRA allocations only)"),
    _alloc("claim_name", _TEXT, "string", "DRA claim's name (DRA allocations only)"),
    _alloc(
        "claim_source",
        _TEXT,
        "string",
        "how the DRA device was joined at the start: `dra` (ResourceSlices) or "
        "`dra-fallback` (node-local)",
    ),
    _alloc("started_at", _TIME, "timestamp", "earliest start seen"),
    _alloc("ended_at", _TIME, "timestamp", "earliest end seen; NULL while it lasts"),
    _alloc("attributes", "JSONB", "json", "the latest record as sent"),
)

CSV_COLUMNS: tuple[str, ...] = tuple(c.csv for c in READINGS if c.csv)
CSV_FIELDS: tuple[str, ...] = tuple(c.source for c in READINGS if c.csv)


def markdown(columns: tuple[Column, ...]) -> str:
    """The docs' column table of one registry."""
    lines = ["| column | type | CSV | kinds | meaning |", "| --- | --- | --- | --- | --- |"]
    for c in columns:
        csv = f"`{c.csv}`" if c.csv else ""
        kinds = ", ".join(c.kinds)
        lines.append(f"| `{c.name}` | `{c.declared}` | {csv} | {kinds} | {c.description} |")
    return "\n".join(lines) + "\n"
