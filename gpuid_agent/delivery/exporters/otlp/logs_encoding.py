"""Records to an OTLP `ExportLogsServiceRequest` (wire types of `opentelemetry-proto`).

One LogRecord per record: its time is the record's `read_time` (the event's time for
allocations and health transitions), its body the whole record as JSON, its attributes the
fields `attributes` names. Records are grouped into one ResourceLogs per cluster, node and
machine. The same records always encode to the same bytes, so a re-sent batch is the same
request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.otlp.attributes import (
    BY_KIND,
    COMMON,
    INFO,
    RESOURCE,
    SCOPE_NAME,
    SERVICE_NAME,
    SEVERITY,
    WORKLOAD_KINDS,
)
from gpuid_agent.records.serialize import Wire, json_bytes, to_wire
from gpuid_agent.records.types import AnyRecord

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utf8(text: str) -> str:
    """Protobuf strings must be valid UTF-8: lone surrogates (from a hostile NVML string)
    become U+FFFD instead of failing the whole batch."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def set_value(target: AnyValue, value: Any) -> None:
    kind = type(value)
    if kind is str:  # most values: checked first, this runs ~20 times per record
        target.string_value = value if value.isascii() else utf8(value)
    elif kind is bool:
        target.bool_value = value
    elif kind is int and -(2**63) <= value < 2**63:
        target.int_value = value
    elif kind is float:
        target.double_value = value
    elif isinstance(value, list | tuple):
        items = target.array_value.values
        for item in value:
            if item is not None:
                set_value(items.add(), item)
    else:
        target.string_value = utf8(str(value))


def add_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    """Append `attributes` (absent and empty values left out) to a repeated KeyValue field."""
    add = target.add
    for key, value in attributes.items():
        if value is None or value == "":
            continue
        pair: KeyValue = add()
        pair.key = key
        set_value(pair.value, value)


def unix_nanos(text: Any) -> int:
    """Nanoseconds since the epoch of an RFC 3339 time; 0 (unknown, in OTLP) if unreadable."""
    if not isinstance(text, str):
        return 0
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return 0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - _EPOCH
    nanos = (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    return nanos if 0 <= nanos < 2**64 else 0


def record_attributes(record: Wire) -> dict[str, Any]:
    """The attributes of one record's LogRecord, by attribute name."""
    kind = str(record.get("kind", ""))
    out: dict[str, Any] = {}
    for table in (COMMON, BY_KIND.get(kind, {})):
        for field, key in table.items():
            value = record.get(field)
            if value is not None and value != "":
                out[key] = value
    workload = WORKLOAD_KINDS.get(str(record.get("workload_kind")))
    if workload and record.get("workload_name"):
        out[workload] = record["workload_name"]
    return out


def _fill(log: LogRecord, record: Wire) -> None:
    log.time_unix_nano = log.observed_time_unix_nano = unix_nanos(record.get("read_time"))
    kind = str(record.get("kind", ""))
    number, text = SEVERITY.get(str(record.get("state")), INFO) if kind == "health" else INFO
    log.severity_number = number  # type: ignore[assignment]
    log.severity_text = text
    log.event_name = utf8(f"gpuid.{kind}")
    log.body.string_value = json_bytes(record).decode("utf-8")
    add_attributes(log.attributes, record_attributes(record))


def _resource_key(record: Wire) -> tuple[str, ...]:
    return tuple(str(record.get(field) or "") for field in RESOURCE)


def encode_logs(
    records: Sequence[AnyRecord], extra_resource: Mapping[str, str] | None = None
) -> ExportLogsServiceRequest:
    """The request carrying `records`, in their order within each resource."""
    request = ExportLogsServiceRequest()
    groups: dict[tuple[str, ...], Any] = {}
    for typed in records:
        record = to_wire(typed)
        key = _resource_key(record)
        logs = groups.get(key)
        if logs is None:
            resource_logs = request.resource_logs.add()
            add_attributes(resource_logs.resource.attributes, resource(key, extra_resource))
            scope_logs = resource_logs.scope_logs.add()
            scope_logs.scope.name = SCOPE_NAME
            scope_logs.scope.version = __version__
            logs = groups[key] = scope_logs.log_records
        _fill(logs.add(), record)
    return request


def resource(values: Iterable[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Resource attributes: the service, then OTEL_RESOURCE_ATTRIBUTES (which may rename the
    service), then what the records say about the node (they describe this node and win)."""
    out = {"service.name": SERVICE_NAME, "service.version": __version__}
    out.update({key: utf8(value) for key, value in (extra or {}).items()})
    out.update({attr: utf8(value) for attr, value in zip(RESOURCE.values(), values, strict=True)})
    return out
