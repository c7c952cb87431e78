"""Agent memory with every feature on: the figure the chart's memory request and limit are set
from (charts/gpuid-agent/values.yaml, docs/operations.md).

A simulated h100x8 node (pods on the GPUs, one GPU shared by three) with dcgm naming (the
larger page), all four exporters delivering to real servers the benchmark starts (HTTP
receiver, PostgreSQL, moto S3, plus stdout), the disk spool, the Kubernetes API (fake API
server: pod cache, owner lookups, node labels, Node conditions) and a pod label allowlist.
RSS is read at ready, after a minute of work with Prometheus-like scrapes (text and
OpenMetrics), and the peak (VmHWM).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.agentproc import free_port, rss_mib, start_agent, stop, wait_http
from benchmarks.common import Row
from tests.fakekube import FakeKube, write_kubeconfig
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver
from tests.servers.s3 import CREDENTIALS, MotoServer

WORK_SECONDS = 120.0
SAMPLE_EVERY = 30.0
ROOT = str(Path(__file__).resolve().parent.parent)
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def _scrape(base: str, until: float) -> int:
    done = 0
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            for path, accept in (
                ("/gpu/metrics", OPENMETRICS),
                ("/gpu/metrics", ""),
                ("/metrics", ""),
            ):
                async with http.get(base + path, headers={"Accept": accept}) as resp:
                    await resp.read()
                done += 1
            await asyncio.sleep(1.0)
    return done


async def run() -> list[Row]:
    reason = PostgresCluster.unavailable()
    if reason:
        return [Row("memory", "all features", 0, "-", f"skipped: {reason}")]
    postgres, moto, receiver = PostgresCluster(), MotoServer(), Receiver()
    with tempfile.TemporaryDirectory() as tmp:
        postgres.start()
        moto.start()
        try:
            client = moto.client()
            client.create_bucket(Bucket="gpuid-memory")  # type: ignore[attr-defined]
            client.close()  # type: ignore[attr-defined]
            http_url = await receiver.start()
            async with FakeKube() as kube:
                kube.add_node("node-a", labels={"kubernetes.io/hostname": "node-a"})
                env = {
                    **postgres.env(),
                    **CREDENTIALS,
                    "KUBECONFIG": str(write_kubeconfig(Path(tmp) / "kc", kube.url)),
                    "SIMULATE": "h100x8",
                    "NODE_NAME": "node-a",
                    "METRICS_NAMING": "dcgm",
                    "EXPORTER_TYPE": "stdout,http,postgres,s3",
                    "HTTP_ENDPOINT": http_url,
                    "S3_BUCKET": "gpuid-memory",
                    "S3_ENDPOINT_URL": moto.url,
                    "S3_PATH_STYLE": "true",
                    "SPOOL_DIR": str(Path(tmp) / "spool"),
                    "KUBE_API": "auto",
                    "LABELS": "on",
                    "NODE_CONDITIONS": "true",
                    "POD_LABEL_ALLOWLIST": "app,app.kubernetes.io/name",
                    "DMI_PRODUCT_UUID_PATH": "",
                    "MACHINE_ID_PATH": "",
                    "COLLECT_INTERVAL": "2s",
                    "PYTHONPATH": ROOT,
                }
                os.environ.pop("KUBERNETES_SERVICE_HOST", None)
                return await _measure(env, receiver)
        finally:
            await receiver.stop()
            moto.stop()
            postgres.close()


async def _measure(env: dict[str, str], receiver: Receiver) -> list[Row]:
    port = free_port()
    agent = start_agent(port, env=env)
    base = f"http://127.0.0.1:{port}"
    samples: list[float] = []
    scrapes = 0
    try:
        await wait_http(f"{base}/readyz", within=60)
        at_ready = rss_mib(agent.pid)
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < WORK_SECONDS:
            scrapes += await _scrape(base, time.monotonic() + SAMPLE_EVERY)
            samples.append(rss_mib(agent.pid))
        peak = peak_mib(agent.pid)
    finally:
        stop(agent)
    note = "h100x8, dcgm naming, 4 exporters, spool, API"
    trail = ", ".join(f"{v:.0f}" for v in samples)
    delivered = len(receiver.accepted_ids())
    return [
        Row("memory", "RSS at ready (all features)", at_ready, "MiB", note),
        Row("memory", f"RSS after {elapsed:.0f} s", samples[-1], "MiB", f"every 30 s: {trail}"),
        Row("memory", "peak RSS (VmHWM)", peak, "MiB", f"{scrapes} scrapes, {delivered} via HTTP"),
    ]
