"""Health state across restarts and reboots (STATE_DIR/health.json, the boot id under
HOST_PROC), reboot-aware escalation, and an operator's clear through the CLI: real agents on
the fake libnvidia-ml.so.1, restarted on the same state directory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.sources.nvml.signals import XidEvent
from gpuid_agent.state.health.health_file import STATE_FILE, HealthFile
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.xid import XidDetail
from gpuid_agent.state.state_file import StateDir
from tests import fakenvml
from tests.conftest import node_health
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on
from tests.waiting import eventually


def _proc(root: Path, boot: str) -> str:
    path = root / "proc" / "sys" / "kernel" / "random" / "boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot + "\n")
    return str(root / "proc")


def _config() -> fakenvml.FakeNvmlConfig:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g) for g in config.gpus[:2]]  # an H100's 18 links
    return config


async def _run_with_xid(
    fake: FakeNvml, tmp: Path, boot: str, code: int | None, **extra: Any
) -> dict[str, Any]:
    """One agent run in `boot` (an XID on GPU 1 if `code`); GPU 1's xid and nvlink checks."""
    config = extra.pop("config", None) or _config()
    proc = _proc(tmp, boot)
    async with agent_on(fake, config, state_dir=str(tmp / "state"), host_proc=proc) as run:
        await eventually(lambda: run.check(1, "nvlink") is not None)
        await eventually(lambda: run.agent.collector.health.xid.alive)
        if code is not None:
            config.gpus[1].xids.append((code, 0))
            fake.apply(config)
            await eventually(lambda: node_health(run.agent).gpus[1].xid_counts)
        await run.wait_ticks(3)  # saved after the collection that changed it
        return {"xid": run.check(1, "xid"), "nvlink": run.check(1, "nvlink")}


async def test_a_latched_xid_outlives_a_restart_and_clears_with_a_reboot(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    first = await _run_with_xid(fake_nvml, tmp_path, "boot-a", 79)
    assert (first["xid"].state, first["xid"].action) == ("unhealthy", "reboot")
    saved = orjson.loads((tmp_path / "state" / STATE_FILE).read_bytes())
    [gpu1] = [g for g in saved["gpus"].values() if g["latched"]]
    assert gpu1["latched"] == [{"code": 79, "boot_id": "boot-a", "bucket": "RESTART_BM"}]

    restarted = await _run_with_xid(fake_nvml, tmp_path, "boot-a", None)
    assert (restarted["xid"].state, restarted["xid"].action) == ("unhealthy", "reboot")

    rebooted = await _run_with_xid(fake_nvml, tmp_path, "boot-b", None)
    assert rebooted["xid"].state == "healthy"


async def test_the_same_xid_after_two_reboots_asks_for_hardware_inspection(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    actions = []
    for boot in ("boot-1", "boot-2", "boot-3"):
        seen = await _run_with_xid(fake_nvml, tmp_path, boot, 46)
        actions.append(seen["xid"].action)
    assert actions == ["reset", "reset", "hardware_inspection"]
    assert "again after 2 reboots" in (seen["xid"].reason or "")


async def test_repeats_before_a_restart_count_towards_escalation_after_it(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    repeats = {"xid_repeat_count": 3, "xid_repeat_window": 3600}
    config = _config()
    config.gpus[1].xids.append((13, 0))  # RESTART_APP: degraded, check workload
    first = await _run_with_xid(fake_nvml, tmp_path, "boot-a", 13, config=config, **repeats)
    assert (first["xid"].state, first["xid"].action) == ("degraded", "check_workload")
    saved = orjson.loads((tmp_path / "state" / STATE_FILE).read_bytes())
    [gpu1] = [g for g in saved["gpus"].values() if g.get("repeats")]
    assert len(gpu1["repeats"]["13"]) == 2 and gpu1["repeats_boot_id"] == "boot-a"

    third = await _run_with_xid(fake_nvml, tmp_path, "boot-a", 13, **repeats)
    assert (third["xid"].state, third["xid"].action) == ("degraded", "reset")
    assert "seen 3 times" in (third["xid"].reason or "")

    # after a reboot the repeats of the previous boot count no more
    rebooted = await _run_with_xid(fake_nvml, tmp_path, "boot-b", 13, **repeats)
    assert rebooted["xid"].action == "check_workload"


async def test_links_seen_up_before_a_restart_stay_the_baseline(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    first = await _run_with_xid(fake_nvml, tmp_path, "boot-a", None)
    assert first["nvlink"].state == "healthy"
    config = _config()
    config.gpus[1].nvlink_down = 0b0100  # link 2 went down while the agent was away
    again = await _run_with_xid(fake_nvml, tmp_path, "boot-a", None, config=config)
    assert (again["nvlink"].state, again["nvlink"].reason) == ("unhealthy", "NVLink 2 down")


async def test_an_operator_clears_one_gpu_through_the_cli(
    fake_nvml: FakeNvml, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    config = _config()
    state = str(tmp_path / "state")
    async with agent_on(fake_nvml, config, state_dir=state) as run:
        await eventually(lambda: run.agent.collector.health.xid.alive)
        config.gpus[0].xids.append((79, 0))
        config.gpus[1].xids.append((79, 0))
        fake_nvml.apply(config)
        await eventually(
            lambda: run.check(1, "xid").state == run.check(0, "xid").state == "unhealthy"
        )
        cli = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "gpuid_agent",
                "health",
                "clear",
                config.gpus[1].uuid or "",
                "--state-dir",
                state,
            ],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        await eventually(lambda: run.check(1, "xid").state == "healthy")
        assert run.check(0, "xid").state == "unhealthy"  # only the GPU named
        [record] = await run.settled_health(1, check="xid", index=1, state="healthy")
        assert record["previous_state"] == "unhealthy"
        (Path(state) / "health-clear" / "junk.json").write_bytes(b"\xff not json")
        await eventually(lambda: (Path(state) / "health-clear" / "junk.rejected").exists())
        assert run.check(0, "xid").state == "unhealthy"  # a bad request changes nothing


def test_the_clear_command_needs_the_state_dir(subprocess_env: dict[str, str]) -> None:
    no_dir = subprocess.run(
        [sys.executable, "-m", "gpuid_agent", "health", "clear", "0"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_dir.returncode == 2 and "STATE_DIR" in no_dir.stderr


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_shaped = st.fixed_dictionaries(
    {
        "version": st.sampled_from([1, 1, 2, "1"]),
        "gpus": st.dictionaries(
            st.sampled_from(["GPU-0", "GPU-1", "x"]),
            st.fixed_dictionaries(
                {},
                optional={
                    "latched": st.lists(
                        st.fixed_dictionaries(
                            {"code": _json | st.integers(0, 200), "boot_id": _json | st.just("b")},
                            optional={"bucket": _json | st.sampled_from(["RESET_GPU", "x y"])},
                        ),
                        max_size=3,
                    )
                    | _json,
                    "boots": st.dictionaries(st.text(max_size=4), _json, max_size=3) | _json,
                    "nvlink_seen_up": st.lists(_json | st.integers(-3, 20), max_size=4) | _json,
                    "repeats": st.dictionaries(
                        st.sampled_from(["13", "79", "x", "-1"]),
                        st.lists(st.floats() | st.integers(-5, 2**41) | _json, max_size=70) | _json,
                        max_size=3,
                    )
                    | _json,
                    "repeats_boot_id": _json | st.just("b"),
                },
            ),
            max_size=3,
        )
        | _json,
    }
)


@hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.one_of(_json, _shaped), st.binary(max_size=30))
def test_a_hostile_health_file_never_stops_the_tracker(
    tmp_path: Path, doc: Any, junk: bytes
) -> None:
    path = tmp_path / STATE_FILE
    for payload in (
        orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS) if _encodable(doc) else junk,
        junk,
    ):
        path.write_bytes(payload)
        tracker = HealthTracker(boot_id="b")
        tracker.restore(HealthFile(StateDir(str(tmp_path))).load())
        gpus = [GpuIdentity(index=0, uuid="GPU-0"), GpuIdentity(index=1, uuid="GPU-1")]
        tracker.observe(gpus, {}, {})
        assert {g.uuid for g in tracker.snapshot().gpus} == {"GPU-0", "GPU-1"}
        orjson.dumps(tracker.as_state())


def test_a_kernel_lines_latched_verdict_outlives_a_restart(tmp_path: Path) -> None:
    gpus = [GpuIdentity(index=0, uuid="GPU-0", name="NVIDIA GB200")]
    line = XidDetail(subcode=37, bucket="RESET_GPU", text="NETIR_LINK_EVT fatal: RESET_GPU")
    first = HealthTracker(boot_id="b", kernel_log=True)
    first.observe(gpus, {}, {})
    first.record_xid(XidEvent(0, "GPU-0", 149, datetime.now(UTC)), line, source="kernel")
    HealthFile(StateDir(str(tmp_path))).save(first.as_state())
    again = HealthTracker(boot_id="b")
    again.restore(HealthFile(StateDir(str(tmp_path))).load())
    again.observe(gpus, {}, {})
    xid = again.snapshot().gpus[0].checks["xid"]
    assert (xid.state, xid.action) == ("unhealthy", "reset")  # not the code's plain "degraded"


def _encodable(doc: Any) -> bool:
    try:
        orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True
