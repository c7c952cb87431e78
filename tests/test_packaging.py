"""What the container image is built from: the project's wheel, installed alone into a clean
venv, runs. No container engine is needed; the Dockerfile's promises are checked as text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import gpuid_agent

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEST_ONLY = {"pytest", "hypothesis", "helm-python-sdk", "kubernetes-validate", "moto", "mypy"}


def _clean_env(**extra: str) -> dict[str, str]:
    """No agent settings from this process; keep what pip needs to reach its index."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    return {**env, **extra}


def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        env=env if env is not None else _clean_env(),
        timeout=240,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packaging_wheel_builds_installs_alone_and_runs(tmp_path: Path) -> None:
    built = _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", tmp_path / "dist", ROOT
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("gpuid_agent-*.whl")
    assert wheel.name.startswith(f"gpuid_agent-{gpuid_agent.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"gpuid_agent-{gpuid_agent.__version__}.dist-info/METADATA")
    assert "gpuid_agent/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "charts/", "docker/", "benchmarks/"))]
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in metadata.decode().splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    declared = PYPROJECT["project"]["dependencies"]
    assert sorted(r.replace(" ", "") for r in requires) == sorted(
        d.replace(" ", "") for d in declared
    )

    target = tmp_path / "venv"
    venv.create(target, with_pip=True, clear=True)
    python, agent = target / "bin" / "python", target / "bin" / "gpuid-agent"
    installed = _run(python, "-m", "pip", "install", "--quiet", wheel)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = _run(python, "-m", "pip", "list", "--format", "json")
    present = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not present & TEST_ONLY, f"test tools in the runtime venv: {present & TEST_ONLY}"
    assert _run(python, "-m", "pip", "check").returncode == 0

    version = _run(agent, "--version")
    assert (version.returncode, version.stdout.strip()) == (
        0,
        f"gpuid-agent {gpuid_agent.__version__}",
    )
    config = _run(
        agent,
        "check-config",
        "--batch-size",
        "50",
        env=_clean_env(
            EXPORTER_TYPE="stdout,http",
            HTTP_ENDPOINT="http://127.0.0.1:9/batches",
            HTTP_AUTH_TOKEN="s3cr3t-token",
            COLLECT_INTERVAL="2m",
        ),
    )
    assert config.returncode == 0, config.stderr
    effective = json.loads(config.stdout)
    assert effective["exporter_type"] == ["stdout", "http"]
    assert effective["batch_size"] == 50
    assert effective["collect_interval"] == 120.0
    assert effective["http_auth_token"] == "<redacted>"
    assert "s3cr3t-token" not in config.stdout + config.stderr
    bad = _run(agent, "check-config", env=_clean_env(BATCH_SIZE="lots", LOG_LEVEL="loud"))
    assert bad.returncode == 2
    assert "BATCH_SIZE" in bad.stderr
    assert "LOG_LEVEL" in bad.stderr


# ---- the Dockerfile, read as text -------------------------------------------------------------

DOCKER_TEXT = DOCKERFILE.read_text()
STAGES = re.split(r"^FROM ", DOCKER_TEXT, flags=re.M)[1:]


def test_dockerfile_is_multi_stage_on_one_python_base() -> None:
    assert len(STAGES) == 2
    bases = [stage.split()[0] for stage in STAGES]
    assert bases == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"], "builder and final must match"
    default = re.search(r"^ARG PYTHON_IMAGE=python:(\d+)\.(\d+)-slim", DOCKER_TEXT, re.M)
    assert default, "a slim Python base"
    minimum = re.search(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum
    image = (int(default.group(1)), int(default.group(2)))
    assert image >= (int(minimum.group(1)), int(minimum.group(2)))


def test_final_stage_has_no_compiler_and_runs_as_a_numeric_non_root_user() -> None:
    final = STAGES[-1]
    instructions = "\n".join(line for line in final.splitlines() if not line.lstrip().startswith("#"))
    # Removing the base's pip is allowed (apt-get purge, pip uninstall); installing is not.
    installs = r"apt-get (-\S+ )*install|apk add|gcc|build-essential|pip install"
    assert not re.search(installs, instructions)
    assert "COPY --from=build /opt/gpuid-agent /opt/gpuid-agent" in final
    user = re.search(r"^USER (\d+):(\d+)$", final, re.M)
    assert user, "numeric USER uid:gid, so runAsNonRoot can verify it"
    assert int(user.group(1)) != 0
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', final, re.M)
    assert entry
    assert entry.group(1) in PYPROJECT["project"]["scripts"]


def test_builder_installs_the_projects_own_wheel_into_a_venv() -> None:
    build = STAGES[0]
    assert "pip wheel --no-deps" in build
    assert re.search(r"python -m venv /opt/gpuid-agent", build)
    assert re.search(r"bin/pip install --only-binary=:all: /wheels/gpuid_agent-\*\.whl", build)


def test_oci_labels() -> None:
    labels = set(re.findall(r"org\.opencontainers\.image\.([a-z.]+)=", DOCKER_TEXT))
    assert {
        "title",
        "description",
        "source",
        "licenses",
        "version",
        "revision",
        "created",
    } <= labels
    assert PYPROJECT["project"]["license"] in DOCKER_TEXT


def test_dockerignore_sends_only_what_the_wheel_needs() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!gpuid_agent/"} <= set(lines)
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", STAGES[0], re.M)
    for sources in copied:
        for source in sources.split():
            assert f"!{source.rstrip('*')}" in lines or f"!{source}/" in lines, source
