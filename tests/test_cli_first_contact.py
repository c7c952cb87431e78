"""First contact: every start that cannot work ends in one line naming the variable to fix,
exit status 2 and no traceback; the real CLI runs as a subprocess."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.waiting import eventually_blocking

AGENT = [sys.executable, "-m", "gpuid_agent"]


def _run(
    args: list[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(AGENT + args, env=env, capture_output=True, text=True, timeout=timeout)


def _one_line_failure(done: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The single `gpuid-agent: ...` line of a failed start (log lines before it are JSON)."""
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("gpuid-agent:")]
    assert len(lines) == 1, done.stderr
    assert done.stderr.rstrip("\n").endswith(lines[0])  # the last thing said
    return lines[0]


def _quiet(env: dict[str, str]) -> dict[str, str]:
    return env | {"LABELS": "off", "KUBE_API": "off", "SERVER_ADDRESS": "127.0.0.1"}


def test_port_in_use_names_server_port(subprocess_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _quiet(subprocess_env) | {"SERVER_PORT": str(port)}
        done = _run(["run", "--simulate", "gb200x4"], env)
    line = _one_line_failure(done)
    assert "SERVER_PORT" in line and f"127.0.0.1:{port}" in line and "in use" in line


def test_an_address_not_on_this_node_names_server_address(
    subprocess_env: dict[str, str],
) -> None:
    # TEST-NET-3: an IP address this machine never has
    env = _quiet(subprocess_env) | {"SERVER_ADDRESS": "203.0.113.7", "SERVER_PORT": "0"}
    line = _one_line_failure(_run(["run", "--simulate", "h100x8"], env))
    assert "SERVER_ADDRESS" in line and "203.0.113.7" in line


def _unresolvable() -> str:
    """`not-an-address`, unless a DNS search domain with a wildcard answers for it here;
    then a name under `.invalid`, which no resolver may answer for (RFC 2606)."""
    try:
        socket.getaddrinfo("not-an-address", None)
    except OSError:
        return "not-an-address"
    return "not-an-address.invalid"


def test_not_an_address_names_server_address(subprocess_env: dict[str, str]) -> None:
    address = _unresolvable()
    env = subprocess_env | {"SERVER_ADDRESS": address}
    for command in (["run", "--simulate", "h100x8"], ["check-config"]):
        line = _one_line_failure(_run(command, env))
        assert "SERVER_ADDRESS" in line and address not in line


def test_fault_on_a_gpu_the_profile_lacks(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {"SIMULATE": "gb200x4", "FAULT": "xid79:gpu9"}
    for command in (["run"], ["inventory"], ["check-config"]):
        line = _one_line_failure(_run(command, env))
        assert "FAULT" in line and "GPU 9" in line and "0-3" in line


def test_every_missing_exporter_setting_in_one_message(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {"EXPORTER_TYPE": "postgres,s3", "BATCH_SIZE": "0"}
    line = _one_line_failure(_run(["run"], env))
    for name in ("BATCH_SIZE", "POSTGRES_HOST", "S3_BUCKET"):
        assert name in line


@pytest.mark.parametrize("setting", ["HTTP_AUTH_TOKEN_FILE", "HTTP_CA_BUNDLE"])
def test_missing_token_or_ca_file_names_the_setting(
    setting: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    missing = tmp_path / "mounted" / "not-there"
    env = subprocess_env | {
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": "http://127.0.0.1:9/ingest",
        setting: str(missing),
    }
    for command in (["check-config"], ["run", "--simulate", "h100x8"]):
        line = _one_line_failure(_run(command, env))
        assert setting in line and "cannot read" in line and str(missing) not in line


def test_unreadable_token_file_and_a_ca_bundle_that_is_no_pem(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    token = tmp_path / "token"
    token.mkdir()  # a Secret mounted as a directory: unreadable as a file, even for root
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("this is not a certificate\n")
    env = subprocess_env | {
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": "https://127.0.0.1:9/ingest",
        "HTTP_AUTH_TOKEN_FILE": str(token),
        "HTTP_CA_BUNDLE": str(not_pem),
    }
    line = _one_line_failure(_run(["check-config"], env))
    assert "HTTP_CA_BUNDLE" in line and "PEM" in line
    assert "HTTP_AUTH_TOKEN_FILE" in line and "cannot read" in line
    assert str(tmp_path) not in line


def test_url_credentials_with_a_bearer_token_are_refused(
    subprocess_env: dict[str, str],
) -> None:
    env = subprocess_env | {
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": "https://ingest:hunter22@127.0.0.1:9/x?api_key=k3y-s3cret",
        "HTTP_AUTH_TOKEN": "bearer-s3cret",
    }
    done = _run(["check-config"], env)
    line = _one_line_failure(done)
    assert "HTTP_ENDPOINT" in line and "HTTP_AUTH_TOKEN" in line
    for secret in ("hunter22", "k3y-s3cret", "bearer-s3cret"):
        assert secret not in done.stderr + done.stdout


def test_no_command_runs_the_agent(subprocess_env: dict[str, str]) -> None:
    # The same bad start proves `run` took the flags: with no command given, --simulate
    # reaches the agent and the profile's GPU range is checked.
    done = _run(["--simulate", "gb200x4", "--fault", "lost:gpu7"], subprocess_env)
    assert "FAULT" in _one_line_failure(done)
    usage = _run(["--simulate", "gb200x4", "--server-port", "x"], subprocess_env)
    assert "SERVER_PORT" in _one_line_failure(usage)


def test_no_command_serves_until_sigterm(subprocess_env: dict[str, str]) -> None:
    import signal
    import urllib.request

    port = free_port()
    env = _quiet(subprocess_env) | {"SERVER_PORT": str(port)}
    proc = subprocess.Popen(
        [*AGENT, "--simulate", "gb200x4"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def status() -> str:
        assert proc.poll() is None, proc.communicate()[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=1) as r:
            return r.read().decode()

    try:
        body = eventually_blocking(status, within=30, ignoring=(OSError,), what="/status")
        assert '"simulate":"gb200x4"' in body.replace(" ", "")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err


def test_inventory_without_a_driver_says_what_to_try(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    library = tmp_path / "libnvidia-ml.so.1"
    line = _one_line_failure(
        _run(["inventory", "--nvml-library-path", str(library)], subprocess_env), code=3
    )
    assert "NVML unavailable" in line and str(library) in line
    assert "--simulate" in line and "NVML_LIBRARY_PATH" in line


def test_help_documents_the_exit_codes(subprocess_env: dict[str, str]) -> None:
    for args in (["--help"], ["run", "--help"], ["inventory", "--help"]):
        done = _run(args, subprocess_env)
        assert done.returncode == 0
        text = " ".join(done.stdout.split())
        assert "exit codes:" in text
        assert "2 invalid configuration" in text and "3 NVML unavailable" in text


def test_unused_gpuid_settings_are_logged_once(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {"NAMESPACE": "gpu-workloads", "LABEL_SELECTOR": "app=train"}
    done = _run(["check-config"], env)
    assert done.returncode == 0
    warned = [line for line in done.stderr.splitlines() if "not used" in line]
    assert len(warned) == 1
    assert "NAMESPACE" in warned[0] and "LABEL_SELECTOR" in warned[0]
    quiet = _run(["check-config"], subprocess_env)
    assert "not used" not in quiet.stderr


def test_check_config_redacts_the_endpoints_credentials(subprocess_env: dict[str, str]) -> None:
    env = subprocess_env | {
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": "https://ingest:hunter22@127.0.0.1:9/x?api_key=k3y-s3cret&tenant=t1",
    }
    done = _run(["check-config"], env)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)["http_endpoint"]
    assert shown == "https://<redacted>@127.0.0.1:9/x?api_key=<redacted>&tenant=<redacted>"
    for secret in ("hunter22", "ingest", "k3y-s3cret"):
        assert secret not in done.stdout + done.stderr


def test_a_password_in_a_numeric_variable_is_never_shown(subprocess_env: dict[str, str]) -> None:
    """A value pasted into the wrong variable may be a secret: the line says what is wrong
    with POSTGRES_PORT, not what it holds, at start and in check-config alike."""
    secret = "Tr0ub4dor&3-hunter2"
    env = subprocess_env | {"EXPORTER_TYPE": "stdout", "POSTGRES_PORT": secret}
    for command in (["check-config"], ["run", "--simulate", "h100x8"]):
        done = _run(command, env)
        line = _one_line_failure(done)
        assert "POSTGRES_PORT" in line and "integer" in line
        assert secret not in done.stderr + done.stdout
