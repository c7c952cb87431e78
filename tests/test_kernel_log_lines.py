"""Kernel log lines parsed into driver events, and NVLink5 XIDs judged from their decode."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.sources.kmsg.lines import (
    TEXT_MAX,
    GpuOffBus,
    KernelLogParser,
    KernelXid,
    NvSwitchSxid,
    PciAddress,
    pci_address,
    record_message,
)
from gpuid_agent.state.health.kernel import xid_detail
from gpuid_agent.state.health.nvlink5 import DECODE, parse_decode
from gpuid_agent.state.health.xid import judge_xid


def parse(line: str) -> object:
    return KernelLogParser().parse(line)


def test_xid_lines_with_and_without_the_process_and_with_the_kmsg_header() -> None:
    line = "4,1042,88123456,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    xid = parse(line)
    assert isinstance(xid, KernelXid)
    assert (xid.pci, xid.code, xid.pid, xid.process) == (
        PciAddress(0, 0x18, 0),
        79,
        1234,
        "python3",
    )
    assert xid.text == "GPU has fallen off the bus." and xid.nvlink is None
    bare = parse("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    assert isinstance(bare, KernelXid) and bare.pid is None and bare.pci == PciAddress(0, 0x3B, 0)
    unknown = parse(
        "NVRM: Xid (PCI:0000:9b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception"
    )
    assert isinstance(unknown, KernelXid) and (unknown.pid, unknown.process) == (None, None)


def test_nvlink5_lines_carry_unit_severity_link_and_registers() -> None:
    xid = parse(
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 "
        "(0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"
    )
    assert isinstance(xid, KernelXid) and xid.pci == PciAddress(0x18, 1, 0)
    assert xid.nvlink is not None
    assert (xid.nvlink.unit, xid.nvlink.fatal, xid.nvlink.link) == ("RLW_RXPIPE", False, 13)
    assert (xid.nvlink.intr_info, xid.nvlink.error_status) == (0x0409A0C2, 8)
    link_evt = parse(
        "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link -1 "
        "(0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    assert isinstance(link_evt, KernelXid) and link_evt.nvlink is not None
    assert link_evt.nvlink.link is None and link_evt.nvlink.subcode == 37


def test_xid_154_names_the_recovery_action_it_changed_to() -> None:
    xid = parse(
        "NVRM: Xid (PCI:0000:b3:00): 154, GPU recovery action changed from 0x0 (None) "
        "to 0x2 (Node Reboot Required)"
    )
    assert isinstance(xid, KernelXid)
    assert (xid.recovery_action, xid.recovery_text) == (2, "Node Reboot Required")


def test_fallen_off_the_bus_in_one_record_or_split_over_three() -> None:
    assert parse("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.") == GpuOffBus(
        PciAddress(0, 0x3B, 0)
    )
    escaped = (
        "3,512,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0a               NVRM: "
        "(PCI ID: 10de:26b5) installed in this system has\\x0a               NVRM: fallen "
        "off the bus and is not responding to commands."
    )
    assert parse(escaped) == GpuOffBus(PciAddress(0, 0xB3, 0))
    parser = KernelLogParser()
    assert parser.parse("NVRM: The NVIDIA GPU 0000:b3:00.0") is None
    assert parser.parse("NVRM: (PCI ID: 10de:26b5) installed in this system has") is None
    split = parser.parse("NVRM: fallen off the bus and is not responding to commands.")
    assert split == GpuOffBus(PciAddress(0, 0xB3, 0))
    assert parser.parse("NVRM: fallen off the bus and is not responding to commands.") is None


def test_sxid_lines_say_fatal_non_fatal_or_nothing() -> None:
    non_fatal = parse(
        "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link "
        "DLREQ interrupt"
    )
    assert non_fatal == NvSwitchSxid(
        3, PciAddress(0, 4, 0), 22013, False, "Non-fatal, Link 44 Minion Link DLREQ interrupt"
    )
    fatal = parse("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert isinstance(fatal, NvSwitchSxid) and fatal.fatal is True
    data = parse("nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data {0x000001c0, 0x00bd5c8a}")
    assert isinstance(data, NvSwitchSxid) and data.fatal is None


def test_other_lines_and_addresses() -> None:
    for line in ("", "usb 1-1: new device", "NVRM: loading NVIDIA UNIX Open Kernel Module", ";;;"):
        assert parse(line) is None
    assert pci_address("00000000:18:00.0") == pci_address("0000:18:00") == PciAddress(0, 0x18, 0)
    assert pci_address("not a bus id") is None
    assert record_message("6,1,2,-;hello\\x41") == "helloA"
    assert record_message("a;b") == "a;b"  # no kmsg header: the line is the message


def test_nvlink5_rows_decide_and_unlisted_rows_keep_the_catalogue() -> None:
    parser = KernelLogParser()

    def judged(line: str) -> object:
        xid = parser.parse(line)
        assert isinstance(xid, KernelXid)
        return judge_xid(xid.code, xid_detail(xid))

    regs = "(0x{:08x} 0x{:08x} 0x00000000 0x00000000 0x00000000 0x00000000)"
    ignore = judged(
        f"NVRM: Xid (PCI:0008:01:00): 148, NVLPW_CTRL Nonfatal XC0 i0 Link 2 {regs.format(0xF, 0x80000000)}"
    )
    assert (ignore.state, ignore.action, ignore.bucket) == ("healthy", "none", "IGNORE")
    assert "NVLPW_CTRL non-fatal, link 2" in ignore.name
    peer = judged(
        f"NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 {regs.format(0x025001C6, 0)}"
    )
    assert (peer.bucket, peer.state, peer.latched) == ("RESET_GPU", "unhealthy", True)
    sw = judged(
        f"NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 {regs.format(0x026001C6, 0)}"
    )
    assert (sw.bucket, sw.state) == ("IGNORE", "healthy")
    eval154 = judged(
        f"NVRM: Xid (PCI:0000:00:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 1 {regs.format(0x82, 4)}"
    )
    assert (eval154.bucket, eval154.state, eval154.action) == (
        "XID_154_EVAL",
        "degraded",
        "check_workload",
    )
    unlisted = judged(
        f"NVRM: Xid (PCI:0000:00:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 1 {regs.format(0xC2, 1)}"
    )
    plain = judge_xid(145)  # as without the line: degraded, read the kernel log
    assert (unlisted.state, unlisted.action, unlisted.bucket) == (
        plain.state,
        plain.action,
        plain.bucket,
    )
    assert unlisted.name.startswith(plain.name) and "no decode row" in unlisted.name
    assert set(DECODE) == set(range(144, 151))


def test_a_decode_row_naming_a_bucket_the_catalogue_does_not_judge_is_refused() -> None:
    doc = {"codes": {"144": {"SAW_MVB": {"by": "error_status", "rows": {"0x1": "REBOOT_IT"}}}}}
    with pytest.raises(ValueError, match="XID 144 SAW_MVB"):
        parse_decode(doc, {"IGNORE": {}})
    with pytest.raises(ValueError, match="bad rule"):
        parse_decode({"codes": {"147": {"*": {"by": "vibes", "bucket": "IGNORE"}}}}, {"IGNORE": {}})


_driverish = st.sampled_from(
    [
        "NVRM: Xid (PCI:",
        "nvidia-nvswitch",
        ": SXid (PCI:",
        "NVRM: GPU ",
        "fallen off the bus",
        "NVRM: The NVIDIA GPU ",
        "pid=",
        ", name=",
        " Fatal XC",
        " Link ",
        "(0x",
        " 0x",
        "\\x0a",
        "0000:18:00",
        ": 79, ",
        ": 149, ",
        ";",
        ",",
        "\n",
        " ",
        "99999999999",
        "-1",
    ]
)


@given(st.lists(st.one_of(_driverish, st.text(max_size=40)), max_size=30))
def test_any_record_parses_or_is_ignored_never_raises_and_stays_bounded(parts: list[str]) -> None:
    parser = KernelLogParser()
    for record in ("".join(parts), "6,1,2,-;" + "".join(parts)):
        event = parser.parse(record)
        if event is None or isinstance(event, GpuOffBus):
            continue
        assert 0 <= event.code <= 99_999 and len(event.text) <= TEXT_MAX
        assert event.text.isprintable()
        assert 0 <= event.pci.domain < 2**32 and event.pci.bus < 256 and event.pci.device < 256
        if isinstance(event, KernelXid):
            assert event.pid is None or 0 <= event.pid < 10**10
            assert event.process is None or (
                len(event.process) <= 64 and event.process.isprintable()
            )
            if event.nvlink is not None:
                judged = judge_xid(event.code, xid_detail(event))  # never raises either
                assert judged.code == event.code
