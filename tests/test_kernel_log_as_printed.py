"""Kernel lines as drivers print them: column-aligned NVLink5 lines, XID 79 without a process
name, XID 154 naming its action on a driver older than field 230, NVLink5 link subcodes 42
and 43, and the recovery actions as nvml.h names them."""

from __future__ import annotations

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.sources.kmsg.lines import KernelLogParser, KernelXid
from gpuid_agent.state.health.kernel import xid_detail
from gpuid_agent.state.health.recovery import recovery_verdict
from gpuid_agent.state.health.xid import judge_xid
from gpuid_agent.state.health.xid_history import XidHistory

# As the R570+ drivers print them: unit, severity and instance padded into columns.
ALIGNED_149 = (
    "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 "
    "(0x025525c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
)
ALIGNED_145 = (
    "NVRM: Xid (PCI:0008:01:00): 145, RLW_REMAP       Nonfatal XC0 i0 Link 13 "
    "(0x00000082 0x00000004 0x00000000 0x00000000 0x00000000 0x00000000)"
)
XID_79_PID_ONLY = "NVRM: Xid (PCI:0000:18:00): 79, pid=4711, GPU has fallen off the bus."
XID_154_LINE = (
    "NVRM: Xid (PCI:0000:b3:00): 154, GPU recovery action changed from 0x4 (Drain and Reset) "
    "to 0x1 (GPU Reset Required)"
)
LINES = [
    ALIGNED_149,
    ALIGNED_145,
    XID_79_PID_ONLY,
    XID_154_LINE,
    "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
    "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ",
]


def xid(line: str) -> KernelXid:
    event = KernelLogParser().parse(line)
    assert isinstance(event, KernelXid), line
    return event


def test_a_column_aligned_link_down_is_decoded_and_asks_for_a_gpu_reset() -> None:
    line = xid(ALIGNED_149)
    assert line.nvlink is not None
    assert (line.nvlink.unit, line.nvlink.fatal, line.nvlink.link) == ("NETIR_LINK_EVT", True, 9)
    assert line.nvlink.subcode == 0x25
    judged = judge_xid(149, xid_detail(line))
    assert (judged.state, judged.action, judged.bucket) == ("unhealthy", "reset", "RESET_GPU")
    assert "link 9" in judged.name and "subcode 37" in judged.name


def test_column_aligned_nvlink5_lines_keep_their_registers() -> None:
    line = xid(ALIGNED_145)
    assert line.nvlink is not None
    assert (line.nvlink.unit, line.nvlink.intr_info, line.nvlink.error_status) == (
        "RLW_REMAP",
        0x82,
        4,
    )


@pytest.mark.parametrize("unit", ["NETIR_LINK_EVT", "NETIR_LINK_DOWN"])
@pytest.mark.parametrize("subcode", [42, 43])
def test_link_subcodes_42_and_43_ask_for_a_gpu_reset(unit: str, subcode: int) -> None:
    intr = (subcode << 20) | 0x1C6
    line = xid(
        f"NVRM: Xid (PCI:0018:01:00): 149, {unit}  Fatal   XC0 i0 Link 04 "
        f"(0x{intr:08x} 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    judged = judge_xid(149, xid_detail(line))
    assert (judged.state, judged.action, judged.bucket) == ("unhealthy", "reset", "RESET_GPU")


def test_xid_79_with_a_pid_and_no_name_keeps_the_pid() -> None:
    line = xid(XID_79_PID_ONLY)
    assert (line.code, line.pid, line.process) == (79, 4711, None)
    assert line.text == "GPU has fallen off the bus."
    assert "pid 4711" in (xid_detail(line).text or "")


def test_xid_154_without_field_230_takes_the_action_its_line_names() -> None:
    line = xid(XID_154_LINE)
    detail = xid_detail(line)
    judged = judge_xid(154, detail, recovery_field=False)
    assert (judged.state, judged.action, judged.latched) == ("unhealthy", "reset", True)
    assert "GPU Reset Required" in judged.name
    to_reboot = XID_154_LINE.replace("0x1 (GPU Reset Required)", "0x2 (Node Reboot Required)")
    assert judge_xid(154, xid_detail(xid(to_reboot)), recovery_field=False).action == "reboot"
    to_drain = XID_154_LINE.replace("0x1 (GPU Reset Required)", "0x3 (Drain P2P)")
    drain = judge_xid(154, xid_detail(xid(to_drain)), recovery_field=False)
    assert (drain.state, drain.action, drain.latched) == ("degraded", "drain", False)
    # no line at all: the catalogue's bucket, as before
    assert judge_xid(154, None, recovery_field=False).action == "reboot"
    # a driver with the field: counted, the recovery check decides
    assert judge_xid(154, detail, recovery_field=True).state == "healthy"


def test_xid_154_judged_by_its_line_stays_latched_across_a_restart() -> None:
    history = XidHistory()
    history.record(154, 1.0, "boot-1", detail=xid_detail(xid(XID_154_LINE)), recovery_field=False)
    saved = history.as_state("boot-1")
    again = XidHistory()
    again.restore(saved, "boot-1")
    assert [(c.code, c.action, c.latched) for c in again.latched.values()] == [
        (154, "reset", True)
    ]


def test_recovery_actions_are_named_as_nvml_h_names_them_and_unknown_ones_by_number() -> None:
    from gpuid_agent.state.health.recovery import action_name

    for value in range(8):
        name = action_name(value) if value else "NVML_GPU_RECOVERY_ACTION_NONE"
        assert getattr(pynvml, name) == value, name
    assert "NVML_GPU_RECOVERY_ACTION_BUS_RESET, 6" in (recovery_verdict(6).reason or "")
    unknown = recovery_verdict(9)
    assert unknown.state == "degraded" and "recovery action 9" in (unknown.reason or "")
    assert action_name(9) == "9"


_RUN = st.text(alphabet=" \t", min_size=1, max_size=6)


@given(st.sampled_from(LINES), st.data())
def test_any_run_of_blanks_between_words_parses_the_same(line: str, data: st.DataObject) -> None:
    words = line.split(" ")
    runs = data.draw(st.lists(_RUN, min_size=len(words) - 1, max_size=len(words) - 1))
    spaced = words[0] + "".join(run + word for run, word in zip(runs, words[1:], strict=True))
    assert KernelLogParser().parse(spaced) == KernelLogParser().parse(line)
