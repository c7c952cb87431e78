"""The OTLP log encoding: hostile record content survives, and the documented attribute table
is the one the code uses."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from gpuid_agent.delivery.exporters.otlp import OtlpExporter, attributes
from tests.exporter_support import readings
from tests.servers.otlp import flatten

hostile_text = st.one_of(
    st.text(st.characters(codec=None), max_size=30),
    # lone surrogates (protobuf refuses them) next to ordinary text
    st.tuples(st.text(max_size=5), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)).map(
        "".join
    ),
)
hostile_value = st.one_of(
    st.none(),
    hostile_text,
    st.integers(),  # beyond int64 too
    st.floats(),
    st.booleans(),
    st.lists(st.one_of(hostile_text, st.integers(-5, 5), st.none()), max_size=3),
)


@given(
    fields=st.dictionaries(
        st.sampled_from([*sorted(readings(1)[0]), "pod", "namespace", "mystery"]),
        hostile_value,
        max_size=8,
    ),
    kind=st.sampled_from(["reading", "allocation", "health", "future-kind", ""]),
)
def test_hostile_records_encode_and_decode(fields: dict[str, Any], kind: str) -> None:
    record = {**readings(1)[0], **fields, "kind": kind}
    other = readings(1, node="n2")[1]
    body = OtlpExporter("http://127.0.0.1:1/v1/logs").body([record, other])
    request = ExportLogsServiceRequest()
    request.ParseFromString(gzip.decompress(body))
    mine, decoded = flatten(request)  # the receiver's decoding: unique keys, valid UTF-8
    if (
        record.get("node") == "n2"
        and record.get("cluster") == "c1"
        and record.get("machine") == "m1"
    ):
        assert len(request.resource_logs) == 1  # same node: one resource
    assert decoded.attributes["gpuid.record.id"] == other["record_id"]
    assert decoded.resource["k8s.node.name"] == "n2"
    assert set(json.loads(mine.body)) == set(record)  # the body keeps every field
    assert mine.attributes.get("gpuid.record.kind", "") == kind
    if not isinstance(record.get("read_time"), str):
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
