from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.sources.nvml.pynvml_api import PLATFORM_INFO_V2, parse_platform_info


def _raw(chassis: bytes, guid: bytes = b"\0" * 16, tail: bytes = b"\x07\x03\x01\x00\x02") -> bytes:
    return struct.pack("<I16s16s", PLATFORM_INFO_V2, guid, chassis) + tail


def test_decodes_fields() -> None:
    info = parse_platform_info(_raw(b"1821324190123", guid=bytes(range(16))))
    assert info.chassis_serial == "1821324190123"
    assert (info.slot_number, info.tray_index, info.host_id, info.peer_type, info.module_id) == (
        7,
        3,
        1,
        0,
        2,
    )
    assert info.ib_guid == bytes(range(16)).hex()


def test_high_bytes_in_single_byte_fields_are_numbers() -> None:
    info = parse_platform_info(_raw(b"C1", tail=b"\xc8\xff\x80\x90\xfe"))
    assert (info.slot_number, info.tray_index, info.module_id) == (200, 255, 254)


@pytest.mark.parametrize("chassis", [b"\xff\xfe\x80binary", b"\0" * 16, b"   ", b"ab\ncd"])
def test_unreadable_chassis_serial_is_absent(chassis: bytes) -> None:
    assert parse_platform_info(_raw(chassis.ljust(16, b"\0")[:16])).chassis_serial is None


def test_wrong_version_or_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="version"):
        parse_platform_info(struct.pack("<I", 0x100002C) + b"\0" * 40)
    with pytest.raises(ValueError, match="bytes"):
        parse_platform_info(b"\0" * 10)


@given(st.binary(min_size=0, max_size=80))
def test_hostile_bytes_never_crash(raw: bytes) -> None:
    try:
        info = parse_platform_info(raw)
    except ValueError:
        return
    assert info.chassis_serial is None or (
        info.chassis_serial.isprintable() and info.chassis_serial.isascii()
    )


@given(
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=5, max_size=5),
)
def test_any_v2_struct_decodes(guid: bytes, chassis: bytes, tail: bytes) -> None:
    info = parse_platform_info(_raw(chassis, guid, tail))
    assert 0 <= info.slot_number <= 255
    assert info.module_id == tail[4]
    if info.chassis_serial is not None:
        assert info.chassis_serial.encode() in chassis
