"""The OTLP log encoding: hostile record content survives, and the documented attribute table
is the one the code uses."""

from __future__ import annotations

import gzip
import json
import re
from datetime import datetime
from pathlib import Path

from hypothesis import given
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from gpuid_agent.delivery.exporters.otlp import OtlpExporter, attributes
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from tests.exporter_support import readings, wire_id
from tests.record_strategies import RECORDS
from tests.servers.otlp import flatten


@given(record=RECORDS)
def test_hostile_records_encode_and_decode(record: AnyRecord) -> None:
    wire = to_wire(record)
    other = readings(1, node="n2")[1]
    body = OtlpExporter("http://127.0.0.1:1/v1/logs").body([record, other])
    request = ExportLogsServiceRequest()
    request.ParseFromString(gzip.decompress(body))
    mine, decoded = flatten(request)  # the receiver's decoding: unique keys, valid UTF-8
    if (wire["node"], wire["cluster"], wire["machine"]) == ("n2", "c1", "m1"):
        assert len(request.resource_logs) == 1  # same node: one resource
    assert decoded.attributes["gpuid.record.id"] == wire_id(other)
    assert decoded.resource["k8s.node.name"] == "n2"
    assert set(json.loads(mine.body)) == set(wire)  # the body keeps every field
    assert mine.attributes.get("gpuid.record.kind", "") == record.kind
    try:
        datetime.fromisoformat(record.read_time)
    except ValueError:
        assert mine.time_unix_nano == 0  # unknown, as OTLP spells it


def test_the_attribute_table_in_the_docs_matches_the_code() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "exporters" / "otlp.md").read_text()
    table = doc.split("<!-- attribute-table -->")[1].split("<!-- /attribute-table -->")[0]
    documented = {
        name
        for row in table.splitlines()[2:]
        for name in re.findall(r"`([a-z0-9_.]+)`", row.split("|")[1])
    }
    in_code = (
        {"service.name", "service.version"}
        | set(attributes.RESOURCE.values())
        | set(attributes.COMMON.values())
        | {key for table in attributes.BY_KIND.values() for key in table.values()}
        | set(attributes.WORKLOAD_KINDS.values())
    )
    assert documented == in_code
