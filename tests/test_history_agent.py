"""History over what a real agent wrote: the agent runs as a subprocess on the simulated HGX
H100 node, with a kubelet whose pods the test changes, an XID and a GPU replacement injected, its
records going to stdout (a file in a directory) and to the real PostgreSQL at once. Both
sources answer every question, and answer it the same way."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuid_agent.history import questions
from gpuid_agent.history.command import SETTINGS
from gpuid_agent.history.postgres_source import PostgresSource
from gpuid_agent.history.records_dir import RecordsDirectory
from gpuid_agent.history.render_data import as_dict
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.simulate.profiles import h100x8
from tests.fakekubelet import FakeKubelet, pod
from tests.servers.postgres import PostgresCluster
from tests.waiting import eventually

NODE = "sim-history"
POLL = 0.1


def records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line cut by the read while the agent writes it
    return out


def start(env: dict[str, str], out: Path, log: Path) -> subprocess.Popen[bytes]:
    """The agent on the simulated HGX H100 node, its records into `out`."""
    with open(out, "wb") as stdout, open(log, "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuid_agent", "run", "--simulate", "h100x8"],
            env=env,
            stdout=stdout,
            stderr=stderr,
        )


@pytest.fixture
async def agent_records(
    postgres: PostgresCluster, subprocess_env: dict[str, str], tmp_path: Path
) -> dict[str, Any]:
    """Run the agent through pod churn, an XID and a replaced GPU; its stdout's directory
    and the PostgreSQL tables it filled."""
    gpus = [g.uuid for g in h100x8(NODE)]
    socket_dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    kubelet = FakeKubelet(
        str(socket_dir / "kubelet.sock"), allocatable=(("nvidia.com/gpu", tuple(gpus)),)
    )
    await kubelet.start()
    kubelet.pods = [pod("ml", "train-0", "main", "nvidia.com/gpu", gpus[0], gpus[1])]
    schema = f"h_{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "records"
    folder.mkdir()
    out = folder / "agent.jsonl"
    env = {
        **subprocess_env,
        **postgres.env(),
        "EXPORTER_TYPE": "stdout,postgres",
        "POSTGRES_TABLE": f"{schema}.gpu_readings",
        "STATE_DIR": str(tmp_path / "state"),
        "POD_RESOURCES_SOCKET": kubelet.socket_path,
        "POD_RESOURCES_INTERVAL": str(POLL),
        "COLLECT_INTERVAL": str(POLL),
        "ACCOUNTING_INTERVAL": "1s",
        "FAULT": "xid79:gpu2@1s,gpu-replaced:gpu3@2s",
        "KUBE_API": "off",
        "LABELS": "off",
        "NODE_NAME": NODE,
        "CLUSTER_NAME": "test",
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "FLUSH_INTERVAL": "0.2",
        "LOG_LEVEL": "warning",
    }
    proc = start(env, out, tmp_path / "agent.log")
    kinds = lambda: {(r["kind"], r.get("event")) for r in records(out)}  # noqa: E731
    try:
        await eventually(lambda: ("allocation", "usage") in kinds(), within=60, what="usage")
        kubelet.pods = [pod("ml", "eval-0", "main", "nvidia.com/gpu", gpus[2])]
        await eventually(
            lambda: {("allocation", "end"), ("health", None), ("hardware", "replaced")} <= kinds(),
            within=60,
            what="an end, an XID and a replacement",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        await kubelet.stop()
    assert proc.returncode == 0, (tmp_path / "agent.log").read_text()
    env_settings = {k.lower(): v for k, v in postgres.env().items()}
    settings = load_settings(env_settings | {"postgres_table": f"{schema}.gpu_readings"}, SETTINGS)
    return {"folder": folder, "settings": settings, "records": records(out)}


def both(agent_records: dict[str, Any], ask: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    local = RecordsDirectory(str(agent_records["folder"]))
    database = PostgresSource(agent_records["settings"])
    try:
        return as_dict(ask(local), UTC), as_dict(ask(database), UTC)
    finally:
        database.close()


def test_every_question_over_the_agents_records(agent_records: dict[str, Any]) -> None:
    written = agent_records["records"]
    [xid] = [r for r in written if r["kind"] == "health" and r["check"] == "xid"]
    [replaced] = [r for r in written if r["kind"] == "hardware"]
    ends = [r for r in written if r["kind"] == "allocation" and r["event"] == "end"]
    train_serials = {r["gpu"] for r in ends if r["pod"] == "train-0"}
    assert len(train_serials) == 2

    local, database = both(agent_records, lambda s: questions.gpu(s, xid["gpu"]))
    assert local == database
    assert [(e["kind"], e["xid"]) for e in local["events"]] == [("xid", 79)]
    assert [p["node"] for p in local["placements"]] == [NODE]

    local, database = both(agent_records, lambda s: questions.gpu(s, replaced["old_serial"]))
    assert local == database
    assert ("replaced", replaced["new_serial"]) in [
        (e["kind"], e["new_serial"]) for e in local["events"]
    ]

    local, database = both(agent_records, lambda s: questions.pod(s, "ml", "train-0"))
    assert local == database
    assert {a["serial"] for a in local["allocations"]} == train_serials
    assert all(a["ended_at"] and a["gpu_hours"] is not None for a in local["allocations"])

    now = datetime.now(UTC)
    local, database = both(agent_records, lambda s: questions.node(s, [NODE], at=now))
    assert local == database
    assert [a["pod"] for a in local["allocations"]] == ["eval-0"]
    serials = {p["serial"] for p in local["placements"]}
    assert replaced["new_serial"] in serials and replaced["old_serial"] not in serials

    hour = now.replace(minute=0, second=0, microsecond=0)
    span = (hour - timedelta(hours=1), hour + timedelta(hours=1))
    local, database = both(agent_records, lambda s: questions.usage(s, "namespace", *span))
    assert local == database
    assert {u["namespace"] for u in local["usage"]} >= {"ml"}
