"""The kernel log as a source, through a FIFO standing in for /dev/kmsg (written record by
record, as the device returns one record per read), the fake NVML and a running agent."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.sources.kmsg.lines import KernelEvent, KernelLogParser, KernelXid
from gpuid_agent.sources.kmsg.reader import KernelLogReader
from gpuid_agent.sources.nvml.signals import XidEvent
from gpuid_agent.state.health.kernel import xid_detail
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.xid import XidDetail, classify_xid
from tests import fakenvml
from tests.conftest import node_health
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on
from tests.waiting import eventually

REGS = "(0x0000000f 0x80000000 0x00000000 0x00000000 0x00000000 0x00000000)"


class KmsgFifo:
    """The writing end of a FIFO the agent reads as its kernel log."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.fd: int | None = None
        self.seq = 0

    def connect(self) -> bool:
        try:  # non-blocking: fails (ENXIO) until the agent opened its end
            self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            return False
        return True

    def record(self, message: str) -> None:
        assert self.fd is not None
        self.seq += 1
        os.write(self.fd, f"3,{self.seq},{self.seq * 1000},-;{message}\n".encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


async def test_kernel_lines_judge_gpus_and_nvswitches(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    kmsg = KmsgFifo(tmp_path / "kmsg")
    config = fakenvml.gb200x4()
    try:
        async with agent_on(fake_nvml, config, kernel_log=str(kmsg.path)) as run:
            await eventually(kmsg.connect)
            await eventually(lambda: run.agent.collector.health.xid.alive)
            assert node_health(run.agent).node_checks["nvswitch"].state == "healthy"

            # GPU 0: the NVML event of an NVLink5 XID, then its line: IGNORE, counted once
            config.gpus[0].xids.append((148, 0))
            fake_nvml.apply(config)
            await eventually(lambda: node_health(run.agent).gpus[0].xid_counts == {148: 1})
            kmsg.record(
                f"NVRM: Xid (PCI:0008:01:00): 148, NVLPW_CTRL Nonfatal XC0 i0 Link 2 {REGS}"
            )
            await eventually(lambda: run.check(0, "xid").state == "healthy")
            assert node_health(run.agent).gpus[0].xid_counts == {148: 1}

            # GPU 2: an XID only the kernel reported, naming its process
            kmsg.record(
                "NVRM: Xid (PCI:0018:01:00): 79, pid=4242, name=trainer, GPU has fallen off the bus."
            )
            xid = await eventually(
                lambda: run.check(2, "xid") if run.check(2, "xid").state == "unhealthy" else None
            )
            assert xid.action == "reboot" and "pid 4242 trainer" in xid.reason
            assert node_health(run.agent).gpus[2].xid_counts == {79: 1}

            # GPU 3: fallen off the bus without an XID; a GPU NVML does not know is passed over
            kmsg.record("NVRM: GPU 0000:77:00.0: GPU has fallen off the bus.")
            kmsg.record("NVRM: GPU 0019:01:00.0: GPU has fallen off the bus.")
            lost = await eventually(
                lambda: run.check(3, "lost") if run.check(3, "lost").state == "unhealthy" else None
            )
            assert (lost.reason, lost.action) == (
                "GPU has fallen off the bus (kernel log)",
                "reboot",
            )
            await run.wait_ticks(3)  # the next collection keeps it: NVML still reads the GPU
            assert run.check(3, "lost").state == "unhealthy"

            # NVSwitch: a line without a severity is not judged, a non-fatal one degrades, a
            # fatal one makes the node's check unhealthy
            kmsg.record("nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data {0x000001c0}")
            kmsg.record(
                "nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ interrupt"
            )
            await eventually(
                lambda: node_health(run.agent).node_checks["nvswitch"].state == "degraded"
            )
            kmsg.record(
                "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
            )
            switch = await eventually(
                lambda: (
                    c
                    if (c := node_health(run.agent).node_checks["nvswitch"]).state == "unhealthy"
                    else None
                )
            )
            assert switch.reason.startswith("NVSwitch 0 (0000:05:00): SXID 20034 fatal")
            [record] = await run.settled_health(1, check="nvswitch", state="unhealthy")
            assert record["action"] == "reboot"
            _, status = await run.get("/status")
            assert status["health"]["node"]["nvswitch"]["state"] == "unhealthy"
            assert status["components"]["kernel_log"]["state"] == "ok"
            _, text = await run.get("/gpu/metrics")
            node = {
                (s.labels["check"], s.labels["state"], s.labels["action"])
                for f in text_string_to_metric_families(text)
                if f.name == "gpuid_node_health_state"
                for s in f.samples
            }
            assert ("nvswitch", "unhealthy", "reboot") in node
            assert node_health(run.agent).gpus[1].state == "healthy"
    finally:
        kmsg.close()


async def test_an_unreadable_kernel_log_is_reported_and_collection_goes_on(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    missing = tmp_path / "no-kmsg"
    async with agent_on(fake_nvml, fakenvml.gb200x4(), kernel_log=str(missing)) as run:
        await eventually(lambda: run.agent.board.get("kernel_log") is not None)
        state = run.agent.board.get("kernel_log")
        assert state.state == "degraded" and str(missing) in (state.reason or "")
        await run.wait_ticks(3)


async def test_a_regular_file_is_read_from_its_end_and_polled(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\n")  # before
    events: list[KernelEvent] = []
    reader = KernelLogReader(str(log), events.append)
    task = asyncio.create_task(reader.run())
    try:
        await eventually(lambda: reader.records == 0 and task.done() is False)
        await asyncio.sleep(0.1)
        with log.open("a") as f:
            f.write("3,1,1,-;NVRM: Xid (PCI:0000:2a:00): 13, pid=7, name=a, Graphics\n")
            f.write(" SUBSYSTEM=pci\n3,2,2,-;NVRM: Xid (PCI:0000:2a:00): 31, par")  # partial
        await eventually(lambda: len(events) == 1)
        with log.open("a") as f:
            f.write("tial line\n")
        await eventually(lambda: reader.records == 2)
        assert [e.code for e in events if isinstance(e, KernelXid)] == [13, 31]
    finally:
        task.cancel()


def test_twins_count_once_in_either_order_and_the_line_decides() -> None:
    now = [0.0]
    tracker = HealthTracker(kernel_log=True, clock=lambda: now[0])
    gpus = fakenvml.gb200x4().gpus
    ids = [GpuIdentity(index=i, uuid=g.uuid or "", name=g.name) for i, g in enumerate(gpus)]
    tracker.observe(ids, {}, {})
    ignore = XidDetail(subcode=0, bucket="IGNORE", text="NVLPW_CTRL non-fatal: IGNORE")

    def event(i: int) -> XidEvent:
        return XidEvent(i, ids[i].uuid, 148, datetime.now(UTC))

    # the line first, then the event: one XID, judged by the line
    tracker.record_xid(event(0), ignore, source="kernel")
    assert tracker.record_xid(event(0)) == []
    # the event first, then the line: the line's judgement replaces the event's
    tracker.record_xid(event(1))
    tracker.record_xid(event(1), ignore, source="kernel")
    # too far apart: two XIDs
    tracker.record_xid(event(2))
    now[0] = 10.0
    tracker.record_xid(event(2), ignore, source="kernel")
    snap = {g.index: g for g in tracker.snapshot().gpus}
    assert snap[0].xid_counts == {148: 1} and snap[0].checks["xid"].state == "healthy"
    assert snap[1].xid_counts == {148: 1} and snap[1].checks["xid"].state == "healthy"
    assert snap[2].xid_counts == {148: 2}
    assert snap[2].checks["xid"].state == classify_xid(148).state  # the event's stands

    # an event escalated by repeats is still taken back by its line
    repeats = HealthTracker(kernel_log=True, clock=lambda: now[0], xid_repeat_count=2)
    repeats.observe(ids, {}, {})
    repeats.record_xid(event(3), ignore, source="kernel")
    repeats.record_xid(event(3))  # its twin
    now[0] = 20.0
    repeats.record_xid(event(3))  # a second 148: escalated (two within the window)
    repeats.record_xid(event(3), ignore, source="kernel")
    gpu3 = {g.index: g for g in repeats.snapshot().gpus}[3]
    assert gpu3.xid_counts == {148: 2} and gpu3.checks["xid"].state == "healthy"


def test_a_line_after_its_event_replaces_its_judgement_latched_or_not() -> None:
    tracker = HealthTracker(kernel_log=True, boot_id="b")
    gpus = fakenvml.gb200x4().gpus
    ids = [GpuIdentity(index=i, uuid=g.uuid or "", name=g.name) for i, g in enumerate(gpus)]
    tracker.observe(ids, {}, {})
    parser = KernelLogParser()

    def line(text: str) -> XidDetail:
        parsed = parser.parse(text)
        assert isinstance(parsed, KernelXid)
        return xid_detail(parsed)

    def xid(i: int, code: int) -> XidEvent:
        return XidEvent(i, ids[i].uuid, code, datetime.now(UTC))

    # 149 without detail is degraded; its line's decode row (a fatal link event) latches a reset
    tracker.record_xid(xid(0, 149))
    fatal = f"NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 {REGS}"
    tracker.record_xid(xid(0, 149), line(fatal.replace("0x0000000f", "0x025001c6")), "kernel")
    # 79 latched by the event, then its line names the process: one XID, the line's reason
    tracker.record_xid(xid(1, 79))
    named = "NVRM: Xid (PCI:0008:01:00): 79, pid=7, name=trainer, GPU has fallen off the bus."
    tracker.record_xid(xid(1, 79), line(named), "kernel")
    snap = {g.index: g for g in tracker.snapshot().gpus}
    assert snap[0].xid_counts == {149: 1}
    assert (snap[0].checks["xid"].state, snap[0].checks["xid"].action) == ("unhealthy", "reset")
    assert "NETIR_LINK_EVT fatal, link 0" in (snap[0].checks["xid"].reason or "")
    assert snap[1].xid_counts == {79: 1} and snap[1].checks["xid"].action == "reboot"
    assert "pid 7 trainer" in (snap[1].checks["xid"].reason or "")
    saved = tracker.as_state()["gpus"]
    assert saved[ids[0].uuid]["latched"] == [{"code": 149, "boot_id": "b", "bucket": "RESET_GPU"}]
    assert [x["code"] for x in saved[ids[1].uuid]["latched"]] == [79]


def test_off_by_default_nothing_of_the_kernel_log_is_imported() -> None:
    code = (
        "import sys, gpuid_agent.agent, gpuid_agent.cli;"
        "print(sorted(m for m in sys.modules if 'kmsg' in m or m.endswith('health.kernel')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_relative_kernel_log_path_fails_at_start_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERNEL_LOG", "dev/kmsg")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert set(info.value.problems) == {"KERNEL_LOG"}
    monkeypatch.setenv("KERNEL_LOG", "/dev/kmsg")
    assert load_settings().kernel_log == "/dev/kmsg"
