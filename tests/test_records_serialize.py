"""The one serializer both ways: every wire dict `to_wire` writes reads back (`from_wire`) into
the record that writes it again byte for byte, through the spool's JSON lines too, whatever the
strings hold; anything else is refused with a reason, never turned into another record."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.records.serialize import (
    WireError,
    from_json_lines,
    from_wire,
    json_bytes,
    json_lines,
    to_wire,
)
from gpuid_agent.records.types import SCHEMA_VERSION, AllocationRecord, AnyRecord, ReadingRecord
from tests.record_strategies import RECORDS


@given(RECORDS)
def test_every_wire_dict_reads_back_into_a_record_that_writes_it_again(record: AnyRecord) -> None:
    wire = to_wire(record)
    again = to_wire(from_wire(wire))
    assert list(again.items()) == list(wire.items())  # same keys, same order, same values
    assert json_bytes(again) == json_bytes(wire)


@given(st.lists(RECORDS, min_size=1, max_size=4))
def test_spooled_json_lines_drain_byte_identically(records: list[AnyRecord]) -> None:
    # What a spool file of the previous release holds: JSON lines of these wire dicts.
    written = b"".join(json_bytes(to_wire(r)) + b"\n" for r in records)
    read = from_json_lines(written)
    assert json_lines(read) == written
    assert [to_wire(r) for r in read] == [to_wire(r) for r in records]


def _reading() -> dict[str, Any]:
    return to_wire(
        ReadingRecord(
            SCHEMA_VERSION, "reading", "c", "n", "m", "s", "ch", "g", "t", "GPU-0", 0, None,
            None, None, None, None, "dmi", ("MIG-1",), "startup", "",
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda w: w.update(kind="sensor"), "unknown record kind 'sensor'"),
        (lambda w: w.pop("kind"), "unknown record kind None"),
        (lambda w: w.pop("uuid"), "reading record lacks uuid"),
        (lambda w: w.update(extra=1), "reading record has no field extra"),
        (lambda w: w.update(index="0"), "reading record has a wrong type in index"),
        (lambda w: w.update(index=True), "reading record has a wrong type in index"),
        (lambda w: w.update(mig_devices=[1]), "wrong type in mig_devices"),
        (lambda w: w.update(node="other"), "reading record_id does not match"),
        (lambda w: w.update(model="\ud800"), "reading record_id does not match"),
    ],
)
def test_what_to_wire_cannot_have_written_is_refused_with_a_reason(
    change: Any, reason: str
) -> None:
    wire = _reading()
    change(wire)
    with pytest.raises(WireError, match=reason.replace("(", r"\(")):
        from_wire(wire)


def test_allocation_shapes_are_exactly_what_to_wire_writes() -> None:
    start = to_wire(
        AllocationRecord(
            SCHEMA_VERSION, "allocation", "r1", "end", "c", "n", "m", "dmi", "s", "ch", "g",
            "t", "a1", None, "GPU-0", 0, None, None, None, "ns", "pod", None, "main",
            "nvidia.com/gpu", "GPU-0", None, None, None, "t0", True, "t1", False, None,
        )
    )  # fmt: skip
    assert from_wire(start) == from_wire(
        orjson.loads(orjson.dumps(start, option=orjson.OPT_SORT_KEYS))
    )
    unseen_without_last_seen = {k: v for k, v in start.items() if k != "last_seen_at"}
    with pytest.raises(WireError, match="lacks last_seen_at"):
        from_wire(unseen_without_last_seen)
    with pytest.raises(WireError, match="has no field claim_name"):
        from_wire({**start, "claim_name": None})
    with pytest.raises(WireError, match="a record is a JSON object"):
        from_wire([start])  # type: ignore[arg-type]
