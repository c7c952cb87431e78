from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.waiting import eventually_blocking

AGENT = [sys.executable, "-m", "gpuid_agent"]


def _run(
    args: list[str], env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(AGENT + args, env=env, capture_output=True, text=True, timeout=timeout)


def test_version(subprocess_env: dict[str, str]) -> None:
    from gpuid_agent import __version__

    done = _run(["--version"], subprocess_env)
    assert done.returncode == 0 and done.stdout.strip() == f"gpuid-agent {__version__}"


def test_bad_config_exits_2_naming_each_variable(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {"BATCH_SIZE": "-1", "TIMEOUT": "abc"}
    done = _run(["run"], env)
    assert done.returncode == 2
    assert "BATCH_SIZE" in done.stderr and "TIMEOUT" in done.stderr
    assert done.stdout == ""


def test_bad_flag_value_exits_2(subprocess_env: dict[str, str]) -> None:
    done = _run(["run", "--collect-interval", "soon"], subprocess_env)
    assert done.returncode == 2 and "COLLECT_INTERVAL" in done.stderr


def test_check_config_redacts_secrets(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {"HTTP_AUTH_TOKEN": "tok-123-secret", "CLUSTER_NAME": "prod-east"}
    done = _run(["check-config", "--batch-size", "42"], env)
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert config["http_auth_token"] == "<redacted>"
    assert config["cluster_name"] == "prod-east" and config["batch_size"] == 42
    assert "tok-123-secret" not in done.stdout + done.stderr


def test_inventory_json_and_table_on_simulated_node(subprocess_env: dict[str, str]) -> None:
    done = _run(["inventory", "--json", "--simulate", "gb200x4"], subprocess_env)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert len(body["gpus"]) == 4
    assert len({g["serial"] for g in body["gpus"]}) == 2
    assert len({g["platform"]["chassis_serial"] for g in body["gpus"]}) == 1
    table = _run(["inventory", "--simulate", "h100x8"], subprocess_env)
    assert table.returncode == 0
    assert table.stdout.splitlines()[1].split()[:2] == ["IDX", "UUID"]
    assert len(table.stdout.splitlines()) == 2 + 8


def test_inventory_without_driver_fails_clearly(subprocess_env: dict[str, str]) -> None:
    done = _run(
        ["inventory", "--nvml-library-path", "/nonexistent/libnvidia-ml.so.1"], subprocess_env
    )
    assert done.returncode == 3 and "NVML unavailable" in done.stderr


def _wait_ready(port: int, proc: subprocess.Popen[bytes], within: float = 20) -> None:
    def ready() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return resp.status == 200

    eventually_blocking(ready, within=within, ignoring=(OSError,), what="/readyz answering 200")


def _wait_emitted(port: int, counts: dict[str, float], within: float = 20) -> None:
    """Poll /metrics until gpuid_records_emitted_total reaches `counts` for each kind."""

    def emitted() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
        seen = {
            sample.labels["kind"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "gpuid_records_emitted_total"
        }
        assert all(seen.get(kind, 0) >= n for kind, n in counts.items()), f"emitted {seen}"
        return True

    eventually_blocking(
        emitted, within=within, ignoring=(AssertionError,), what=f"at least {counts} emitted"
    )


def test_sigterm_flushes_every_queued_record(subprocess_env: dict[str, str]) -> None:
    port = free_port()
    env = subprocess_env | {
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": str(port),
        "LABELS": "off",
        "KUBE_API": "off",
    }
    # Batches only leave on a full batch or after an hour: everything waits for the flush.
    proc = subprocess.Popen(
        [*AGENT, "run", "--simulate", "h100x8", "--batch-size", "1000", "--flush-interval", "1h"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_ready(port, proc)
        # the first collection is queued (readings and allocation starts) before the signal
        _wait_emitted(port, {"reading": 8, "allocation": 8})
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    records = [orjson.loads(line) for line in out.splitlines()]
    readings = [r for r in records if r["kind"] == "reading"]
    assert len(readings) == 8
    # the simulated kubelet puts pods on the GPUs: their allocation starts are flushed too
    assert len([r for r in records if r["kind"] == "allocation"]) == 8
    assert len({r["record_id"] for r in records}) == len(records)
    logs = [orjson.loads(line) for line in err.splitlines()]
    assert any(entry["msg"] == "agent stopped" for entry in logs)
    assert all({"time", "level", "msg", "component"} <= set(entry) for entry in logs)
