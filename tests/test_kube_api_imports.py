"""What of kubernetes_asyncio a running agent imports: nothing without the API (KUBE_API=off,
or no configuration found), and with it only the configuration, auth and transport modules:
none of the generated API or model classes. Read from `python -X importtime` of real agent
processes, which names every module as it is imported, until the agent is stopped."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.conftest import free_port
from tests.fakekube import FakeKube, write_kubeconfig
from tests.waiting import eventually

NODE = "node-a"
PACKAGE = "kubernetes_asyncio"


def _start(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = env | {
        "SIMULATE": "h100x8",
        "NODE_NAME": NODE,
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": str(port),
        "EXPORTER_TYPE": "stdout",
        "LOG_LEVEL": "warning",
    }
    with log.open("wb") as err:
        command = [sys.executable, "-X", "importtime", "-m", "gpuid_agent", "run"]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, port


async def _ready(port: int) -> bool:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/readyz") as resp,
    ):
        return resp.status == 200


def _imported(proc: subprocess.Popen[bytes], log: Path) -> set[str]:
    """Every module the process imported, once it has exited."""
    proc.terminate()
    assert proc.wait(20) == 0
    lines = log.read_text(errors="replace").splitlines()
    return {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")} - {
        "package"
    }


async def test_no_kubernetes_library_without_the_api(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    base = subprocess_env | {"HOME": str(tmp_path), "LABELS": "on", "NODE_CONDITIONS": "true"}
    base.pop("KUBECONFIG", None)
    base.pop("KUBERNETES_SERVICE_HOST", None)
    started = {
        mode: (
            *_start(base | {"KUBE_API": mode}, tmp_path / f"{mode}.log"),
            tmp_path / f"{mode}.log",
        )
        for mode in ("off", "auto")  # auto: no kubeconfig and no service account here
    }
    for _, port, _ in started.values():
        await eventually(lambda p=port: _ready(p), within=60, ignoring=(aiohttp.ClientError,))
    for name, (proc, _, log) in started.items():
        modules = _imported(proc, log)
        assert "gpuid_agent.sources.kube.client" in modules  # the log is the whole import list
        assert not {m for m in modules if m.split(".")[0] == PACKAGE}, name


async def test_with_the_api_no_generated_api_or_model_class_is_imported(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    async with FakeKube() as kube:
        kube.add_node(NODE)
        env = subprocess_env | {
            "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", kube.url)),
            "KUBE_API": "auto",
            "LABELS": "on",
            "NODE_CONDITIONS": "true",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        proc, port = _start(env, tmp_path / "on.log")
        try:
            await eventually(lambda: _ready(port), within=60, ignoring=(aiohttp.ClientError,))
            # the labeller patched the Node and the pod cache listed and watches
            await eventually(lambda: kube.count("patch") and kube.count("watch"), within=60)
        finally:
            modules = await asyncio.to_thread(_imported, proc, tmp_path / "on.log")
    ours = {m for m in modules if m.split(".")[0] == PACKAGE}
    assert f"{PACKAGE}.client.api_client" in ours, sorted(ours)
    assert f"{PACKAGE}.config.kube_config" in ours
    generated = {
        m for m in ours if m.startswith((f"{PACKAGE}.client.models.", f"{PACKAGE}.client.api."))
    }
    assert not generated
    assert len(ours) < 30, sorted(ours)
