"""The image alone: who it runs as, what it leaves out, and each command of the agent in it."""

from __future__ import annotations

import json
import re
from typing import Any

from gpuid_agent import __version__
from gpuid_agent.cli import NVML_HINT
from tests import fakenvml
from tests.image.kubelet import podman
from tests.waiting import eventually

HARDENED = ("--read-only", "--cap-drop=all", "--security-opt", "no-new-privileges")
OFFLINE = ("--env", "KUBE_API=off", "--env", "NODE_NAME=node-a", "--network", "none")


def readings(logs: str) -> list[dict[str, Any]]:
    found = []
    for line in logs.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("kind") == "reading":
                found.append(record)
    return found


async def test_runs_as_the_numeric_non_root_user(image: str, image_config: dict[str, Any]) -> None:
    assert image_config["User"] == "65532:65532"
    _, out = await podman("run", "--rm", "--entrypoint", "id", image)
    assert out.split()[:2] == ["uid=65532(65532)", "gid=65532(65532)"], out


async def test_final_stage_has_no_pip_and_no_compiler(image: str) -> None:
    script = (
        "for t in pip pip3 gcc cc c++ make; do command -v $t && echo FOUND $t; done;"
        " python -m pip --version || echo NO-PIP"
    )
    _, out = await podman("run", "--rm", "--entrypoint", "sh", image, "-c", script)
    assert "FOUND" not in out, out
    assert "No module named pip" in out and "NO-PIP" in out, out


async def test_the_base_interpreter_has_no_pip_and_its_packages_are_consistent(image: str) -> None:
    """The base's own pip is gone too (on the stand-in, Debian's python3-pip: purged with apt,
    so dpkg no longer lists it), and dpkg has nothing half-removed."""
    script = (
        'home=$(sed -n "s/^home = //p" /opt/gpuid-agent/pyvenv.cfg);'
        ' "$home/python3" -c "import pip" 2>&1 || echo BASE-NO-PIP;'
        " if command -v dpkg-query >/dev/null; then"
        " dpkg-query --search '*/pip/__init__.py' 2>&1 || echo DPKG-NO-PIP;"
        " dpkg --audit && echo DPKG-CONSISTENT; fi"
    )
    _, out = await podman("run", "--rm", "--entrypoint", "sh", image, "-c", script)
    assert "No module named 'pip'" in out and "BASE-NO-PIP" in out, out
    assert "DPKG-NO-PIP" in out and "DPKG-CONSISTENT" in out, out


async def test_version_and_check_config(image: str) -> None:
    _, out = await podman("run", "--rm", *HARDENED, image, "--version")
    assert out.strip() == f"gpuid-agent {__version__}"
    code, out = await podman("run", "--rm", *HARDENED, *OFFLINE, image, "check-config", check=False)
    assert code == 0, out
    code, out = await podman(
        "run", "--rm", *OFFLINE, "--env", "EXPORTER_TYPE=nowhere", image, "check-config",
        check=False,
    )  # fmt: skip
    assert code == 2 and "EXPORTER_TYPE" in out, out


async def test_inventory_without_a_driver_exits_3_with_the_hint(image: str) -> None:
    code, out = await podman("run", "--rm", *HARDENED, *OFFLINE, image, "inventory", check=False)
    assert code == 3, out
    assert NVML_HINT in re.sub(r"\s+", " ", out), out


async def test_run_with_injected_nvml_emits_a_reading_per_gpu(
    image: str, nvml_injection: tuple[str, ...], gpus: fakenvml.FakeNvmlConfig
) -> None:
    name = "gpuid-image-run"
    await podman("rm", "--force", "--time", "0", name, check=False)
    await podman(
        "run", "--detach", f"--name={name}", *HARDENED, *OFFLINE, *nvml_injection,
        "--env", "LABELS=off", "--env", "MACHINE_ID_PATH=", "--env", "DMI_PRODUCT_UUID_PATH=",
        image, "run",
    )  # fmt: skip
    try:
        serials = {g.serial for g in gpus.gpus}

        async def all_read() -> bool:
            _, logs = await podman("logs", name)
            return {r["gpu"] for r in readings(logs)} >= serials

        await eventually(all_read, within=60, step=0.5, what="a reading per fake GPU")
        _, out = await podman("stop", "--time", "20", name)
        _, code_text = await podman("inspect", "--format", "{{.State.ExitCode}}", name)
        assert code_text.strip() == "0", out
        _, logs = await podman("logs", name)
        found = {(r["gpu"], r["uuid"]) for r in readings(logs)}
        assert found == {(g.serial, g.uuid) for g in gpus.gpus}
    finally:
        await podman("rm", "--force", "--time", "0", name, check=False)
