"""Fault injection on a simulated node, the FAULT setting, and which threads touch NVML."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.nvml.xid import XidWatcher
from tests.conftest import node_health, running_agent, serves, settings
from tests.waiting import eventually

AGENT = [sys.executable, "-m", "gpuid_agent"]


def _records(out: io.BytesIO, kind: str = "health") -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def test_fault_setting_is_validated_naming_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        settings(simulate="gb200x4", fault="xid79:gpu2,melt:gpu1")
    # the entry is named by its position, never echoed (a value may be a pasted secret)
    assert "FAULT: entry 2" in str(info.value) and "melt" not in str(info.value)
    with pytest.raises(ConfigError, match=r"FAULT.*SIMULATE"):
        settings(fault="lost:gpu0")
    assert settings(simulate="gb200x4", fault="XID79:GPU2, lost:gpu3@2s").fault == [
        "xid79:gpu2",
        "lost:gpu3@2s",
    ]


def test_fault_flag_repeats_and_takes_comma_lists(subprocess_env: dict[str, str]) -> None:
    argv = ["check-config", "--simulate", "gb200x4", "--fault", "xid79:gpu2"]
    done = subprocess.run(
        [*AGENT, *argv, "--fault", "lost:gpu3,thermal:gpu1", "--exporter-type", "stdout"],
        env=subprocess_env | {"FAULT": "ecc-growth:gpu0"},  # the flag wins over the env
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    config = orjson.loads(done.stdout)
    assert config["fault"] == ["xid79:gpu2", "lost:gpu3", "thermal:gpu1"]
    assert config["exporter_type"] == ["stdout"]  # a single use is unchanged
    bad = subprocess.run(
        [*AGENT, "check-config", "--fault", "xid79:gpu2"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "FAULT" in bad.stderr and "SIMULATE" in bad.stderr


def test_a_fault_on_a_gpu_the_profile_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="has 4 GPUs"):
        SimulatedNvml("gb200x4", "n", ["lost:gpu7"])


async def test_simulated_faults_show_as_health() -> None:
    faults = "xid79:gpu2,remap-pending:gpu1,ecc-growth:gpu0,lost:gpu3,persistence-off:gpu0"
    out = io.BytesIO()
    s = settings(simulate="gb200x4", fault=faults, health_window=1.0)
    async with running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent:

        def states() -> dict[int, dict[str, str]]:
            return {
                g.index: {n: c.state for n, c in g.checks.items()} for g in node_health(agent).gpus
            }

        await eventually(
            lambda: (
                (st := states())
                and st.get(2, {}).get("xid") == "unhealthy"
                and st[0]["ecc"] == "degraded"
                and st[1]["remapped_rows"] == "degraded"
                and st[3]["lost"] == "unhealthy"
            )
        )
        st = states()
        assert st[0]["persistence"] == "degraded"
        assert st[1]["ecc"] == "healthy" and st[2]["remapped_rows"] == "healthy"
        # the simulated kubelet offers 4 GPUs and NVML shows 3: gpu_count is unhealthy too
        await eventually(lambda: len(_records(out)) >= 6)
        assert {(r["index"], r["check"]) for r in _records(out)} == {
            (2, "xid"),
            (0, "ecc"),
            (1, "remapped_rows"),
            (3, "lost"),
            (0, "persistence"),
            (None, "gpu_count"),
        }


async def test_a_delayed_fault_is_one_transition_later() -> None:
    out = io.BytesIO()
    s = settings(simulate="h100x8", fault="xid74:gpu5@0.3s,fabric-degraded:gpu0")
    async with running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent:
        await eventually(lambda: len(node_health(agent).gpus) == 8)
        assert node_health(agent).gpus[5].state == "healthy"
        await eventually(lambda: node_health(agent).gpus[5].state == "unhealthy")
        gpu5 = node_health(agent).gpus[5]
        assert "NVLink" in (gpu5.checks["xid"].reason or "") and gpu5.action == "reboot"
        # an HGX H100 is not on a multi-node fabric: the fabric fault has nothing to degrade
        assert node_health(agent).gpus[0].checks["fabric"].state == "not_supported"
        await eventually(lambda: _records(out))
        assert [(r["index"], r["check"], r["state"]) for r in _records(out)] == [
            (5, "xid", "unhealthy")
        ]


async def test_health_reads_stay_on_the_nvml_thread_and_xid_waits_on_their_own() -> None:
    seen: dict[str, set[str]] = {}
    os_names: set[tuple[str, str]] = set()  # (Python's name, the OS's) of each calling thread
    event_calls = {"event_set_create", "register_xid_events", "event_set_wait", "event_set_free"}

    class Recording(SimulatedNvml):
        def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
            value = super().__getattribute__(name)
            if name.startswith("_") or name == "inject_xid" or not callable(value):
                return value

            def called(*args, **kwargs):  # type: ignore[no-untyped-def]
                seen.setdefault(name, set()).add(threading.current_thread().name)
                comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                os_names.add((threading.current_thread().name, comm.read_text().strip()))
                return value(*args, **kwargs)

            return called

    api = Recording("gb200x4", "node-a")
    s = settings(simulate="gb200x4")
    async with running_agent(
        Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])
    ) as agent:
        await eventually(lambda: "event_set_wait" in seen and "fabric_info" in seen)
        api.inject_xid(1, 95)
        await eventually(lambda: node_health(agent).gpus[1].state == "unhealthy")
    health_calls = {
        "ecc_errors",
        "retired_pages_pending",
        "remapped_rows",
        "clocks_event_reasons",
        "fabric_info",
        "persistence_mode",
    }
    assert health_calls <= set(seen)
    for name in health_calls:
        assert all(t.startswith("nvml_") for t in seen[name]), (name, seen[name])
    for name in event_calls & set(seen):
        assert seen[name] == {"nvml-xid"}, (name, seen[name])
    on_xid_thread = {n for n, threads in seen.items() if "nvml-xid" in threads}
    assert on_xid_thread <= event_calls | {"handle_by_index", "device_count", "device_key"}
    assert all(t.startswith("nvml") for threads in seen.values() for t in threads), seen
    # and `top -H` names them too
    named = {python for python, _ in os_names}
    assert "nvml-xid" in named and any(n.startswith("nvml_") for n in named), named
    assert all(python == os_name for python, os_name in os_names), os_names


async def test_the_xid_thread_survives_wait_errors_and_its_own_failures() -> None:
    failures = ["nvml", "bug"]
    created = []

    class Flaky(SimulatedNvml):
        def event_set_create(self) -> Any:
            created.append(1)
            return super().event_set_create()

        def event_set_wait(self, event_set: Any, timeout_ms: int) -> Any:
            if failures:
                kind = failures.pop(0)
                if kind == "nvml":
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
                raise RuntimeError("a bug in the wait path")
            return super().event_set_wait(event_set, timeout_ms)

    api = Flaky("h100x8", "node-a")
    s = settings(simulate="h100x8")
    async with running_agent(
        Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])
    ) as agent:
        agent.collector.health.xid._retry_after = 0.01  # keep the pause after the NVML error short
        await eventually(
            lambda: not failures and agent.collector.health.xid.alive and len(created) >= 3
        )
        api.inject_xid(4, 64)
        await eventually(lambda: node_health(agent).gpus[4].state == "unhealthy")
        assert node_health(agent).gpus[4].action == "reset"  # NVIDIA: reset first


async def test_dcgm_naming_gets_the_last_xid_gauge() -> None:
    api = SimulatedNvml("h100x8", "node-a")
    s = settings(simulate="h100x8", metrics_naming="dcgm")
    async with running_agent(
        Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])
    ) as agent:
        await eventually(lambda: agent.collector.health.xid.alive and node_health(agent).gpus)
        await eventually(lambda: serves(agent, b"gpuid_gpu_health_state"))
        api.inject_xid(3, 48)
        await eventually(lambda: node_health(agent).gpus[3].last_xid == 48)

        async def rendered() -> dict[str, Any]:
            text = (await agent.renderer.rendered()).text.decode()
            return {f.name: f for f in text_string_to_metric_families(text)}

        def last_xid(families: dict[str, Any]) -> dict[str, float]:
            samples = families["DCGM_FI_DEV_XID_ERRORS"].samples
            return {s.labels["gpu"]: s.value for s in samples}

        async def xid_48_on_gpu_3() -> dict[str, Any] | None:
            families = await rendered()
            return families if last_xid(families).get("3") == 48 else None

        # the page follows the XID's snapshot
        families = await eventually(xid_48_on_gpu_3)
        assert last_xid(families)["0"] == 0
        states = families["gpuid_gpu_health_state"].samples
        # gpuid_* families keep snake_case labels; DCGM_* ones dcgm-exporter's
        assert all("uuid" in s.labels and "model_name" in s.labels for s in states)
        xid = families["DCGM_FI_DEV_XID_ERRORS"].samples
        assert all("UUID" in s.labels and "modelName" in s.labels for s in xid)


class _CountingNvml(SimulatedNvml):
    """The simulated driver, counting the event calls the XID thread makes."""

    def __init__(self) -> None:
        super().__init__("h100x8", "node-a")
        self.registered: list[int] = []
        self.waits = 0

    def register_xid_events(self, handle: Any, event_set: Any) -> None:
        super().register_xid_events(handle, event_set)
        self.registered.append(self.gpus.index(self._gpu(handle)))

    def event_set_wait(self, event_set: Any, timeout_ms: int) -> Any:
        self.waits += 1
        return super().event_set_wait(event_set, timeout_ms)


async def test_the_xid_thread_registers_a_gpu_once_and_one_watched_later_too() -> None:
    """Most waits time out with nothing to do, so the thread registers only when the watched
    GPUs change: a GPU readable later is still registered, and none twice."""
    api = _CountingNvml()
    api.init()
    uuids = {i: api.uuid(api.handle_by_index(i)) for i in range(8)}
    watcher = XidWatcher(api, lambda event: None, wait_ms=10)
    try:
        watcher.watch({0: uuids[0], 1: uuids[1]})
        await eventually(lambda: api.waits >= 20)
        watcher.watch({0: uuids[0], 1: uuids[1]})  # the next collection: nothing new
        waits = api.waits
        await eventually(lambda: api.waits >= waits + 20)
        assert sorted(api.registered) == [0, 1]
        watcher.watch({0: uuids[0], 1: uuids[1], 5: uuids[5]})  # a GPU became readable
        await eventually(lambda: 5 in api.registered)
        waits = api.waits
        await eventually(lambda: api.waits >= waits + 20)
        assert sorted(api.registered) == [0, 1, 5]
    finally:
        assert watcher.stop(2.0)
