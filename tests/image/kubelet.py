"""Running a translated pod under podman the way the kubelet runs it: init containers one after
another to completion, then the containers, probed on the kubelet's schedule, and stopped with
SIGTERM and the pod's grace period."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import aiohttp

from tests.image.build import container_env
from tests.image.podspec import ContainerRun, Probe


async def podman(*args: str, check: bool = True, timeout: float = 120) -> tuple[int, str]:
    """Run podman; (exit code, stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        "podman",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=container_env(),
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    text = out.decode(errors="replace")
    code = proc.returncode if proc.returncode is not None else -1
    if check and code != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}… exit {code}:\n{text[-3000:]}")
    return code, text


@dataclass
class ProbeLog:
    """Every probe the kubelet would have sent: (seconds since start, status or error)."""

    probe: Probe
    results: list[tuple[float, str]] = field(default_factory=list)

    def passed(self) -> bool:
        """successThreshold consecutive successes seen."""
        run = 0
        for _, outcome in self.results:
            run = run + 1 if outcome == "200" else 0
            if run >= self.probe.success_threshold:
                return True
        return False

    def first_pass(self) -> float | None:
        return next((t for t, outcome in self.results if outcome == "200"), None)

    def failed(self) -> bool:
        """failureThreshold consecutive failures: a restart (liveness) or not-ready."""
        run = 0
        for _, outcome in self.results:
            run = run + 1 if outcome != "200" else 0
            if run >= self.probe.failure_threshold:
                return True
        return False


async def poll(probe: Probe, host_port: int, started: float, log: ProbeLog) -> None:
    """initialDelaySeconds, then one GET every periodSeconds with timeoutSeconds."""
    await asyncio.sleep(max(0.0, started + probe.initial_delay - time.monotonic()))
    timeout = aiohttp.ClientTimeout(total=probe.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            sent = time.monotonic()
            try:
                async with http.get(f"http://127.0.0.1:{host_port}{probe.path}") as resp:
                    outcome = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = type(exc).__name__
            log.results.append((round(sent - started, 2), outcome))
            await asyncio.sleep(max(0.0, sent + probe.period - time.monotonic()))


async def run_init(run: ContainerRun) -> str:
    """An init container must exit 0 before anything else starts."""
    code, out = await podman("run", "--rm", *run.args, check=False)
    assert code == 0, f"init container {run.name} exit {code}:\n{out[-2000:]}"
    return out


@dataclass
class Started:
    run: ContainerRun
    name: str
    started: float
    probes: dict[str, ProbeLog]
    tasks: list[asyncio.Task[None]]

    async def stop(self, grace_seconds: int) -> tuple[int, float, str]:
        """SIGTERM, SIGKILL after the grace period: (exit code, seconds to exit, logs)."""
        for task in self.tasks:
            task.cancel()
        began = time.monotonic()
        await podman("stop", "--time", str(grace_seconds), self.name, timeout=grace_seconds + 30)
        took = time.monotonic() - began
        _, code = await podman("inspect", "--format", "{{.State.ExitCode}}", self.name)
        _, logs = await podman("logs", self.name)
        return int(code.strip()), took, logs

    async def remove(self) -> None:
        for task in self.tasks:
            task.cancel()
        await podman("rm", "--force", "--time", "0", self.name, check=False)


async def start(run: ContainerRun, published: dict[int, int]) -> Started:
    name = next(a for a in run.args if a.startswith("--name=")).removeprefix("--name=")
    await podman("rm", "--force", "--time", "0", name, check=False)
    await podman("run", "--detach", *run.args)
    started = time.monotonic()
    logs = {kind: ProbeLog(p) for kind, p in run.probes.items()}
    tasks = [
        asyncio.create_task(poll(p, published[p.port], started, logs[kind]))
        for kind, p in run.probes.items()
    ]
    return Started(run, name, started, logs, tasks)


def rss_kib(status: str) -> int:
    """VmRSS of /proc/<pid>/status, in KiB."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc status")


def node_owned(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid
