"""Node labelling: API load per node in steady state, and the cost of one reconciliation.

The real NodeLabeler talks to the fake API server through the real kubernetes_asyncio client.
Time is scaled: the resync period runs at RESYNC_SCALED seconds instead of the default
LABEL_RESYNC_INTERVAL, and the requests counted over many periods are extrapolated to one
hour at the default period. Meanwhile the inventory is re-offered about every scaled
collection interval (same hardware, new read time), as the agent's collector does.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry

from benchmarks.common import Row, median, percentile
from gpuid_agent.facts import GpuIdentity, NodeInventory, PlatformInfo
from gpuid_agent.node.labels import LabelMetrics, NodeLabeler, desired_state
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.state.inventory import build_inventory
from tests.fakekube import FakeKube, write_kubeconfig

NODE = "bench-node"
RESYNC_DEFAULT = float(Settings.model_fields["label_resync_interval"].default)
COLLECT_DEFAULT = float(Settings.model_fields["collect_interval"].default)
RESYNC_SCALED = 0.05
PERIODS = 60
SCALE = RESYNC_DEFAULT / RESYNC_SCALED
FLEET = 5000


def _gb200() -> NodeInventory:
    gpus = [
        GpuIdentity(
            index=i,
            uuid=f"GPU-{i:04d}",
            serial=f"13308240600{i // 2}",
            module_id=i + 1,
            platform=PlatformInfo("1821325191357", 3, 1, 1, 0, i + 1),
        )
        for i in range(4)
    ]
    return build_inventory(
        gpus,
        node=NODE,
        cluster="bench",
        machine="i-0abc",
        machine_source="provider_id:aws",
        driver_version="570.1",
        cuda_driver_version="12.8",
        read_time=datetime.now(UTC),
    )


def _h100() -> NodeInventory:
    gpus = [
        GpuIdentity(index=i, uuid=f"GPU-{i:04d}", serial=f"16528230545{i:02d}") for i in range(8)
    ]
    return build_inventory(
        gpus,
        node=NODE,
        cluster="bench",
        machine="i-0abc",
        machine_source="provider_id:aws",
        driver_version="570.1",
        cuda_driver_version="12.8",
        read_time=datetime.now(UTC),
    )


async def _steady_state(
    kube: FakeKube, api: KubeClient
) -> tuple[dict[str, float], int, float, float]:
    registry = CollectorRegistry()
    labeler = NodeLabeler(
        api,
        NODE,
        prefix="gpuid.github.com",
        metrics=LabelMetrics(registry),
        board=StatusBoard(),
        resync_interval=RESYNC_SCALED,
        startup_jitter=0.0,
        debounce=0.001,
        rand=random.Random(1),
    )
    labeler.offer(_gb200())
    await labeler.reconcile_once()  # the startup reconciliation: read, then patch
    startup = start_index = len(kube.requests)
    attempts_before = registry.get_sample_value("gpuid_label_reconcile_attempts_total") or 0.0
    task = asyncio.create_task(labeler.run())
    started = time.monotonic()
    offers = 0
    collect_scaled = COLLECT_DEFAULT / SCALE
    while time.monotonic() - started < PERIODS * RESYNC_SCALED:
        labeler.offer(_gb200())  # the same hardware, a new read_time
        offers += 1
        await asyncio.sleep(max(collect_scaled, 0.0005))
    elapsed = time.monotonic() - started
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    window = kube.requests[start_index:]
    by_verb: dict[str, int] = {}
    for request in window:
        by_verb[request.verb] = by_verb.get(request.verb, 0) + 1
    scaled_hours = elapsed * SCALE / 3600.0
    per_hour = {verb: n / scaled_hours for verb, n in by_verb.items()}
    attempts = (registry.get_sample_value("gpuid_label_reconcile_attempts_total") or 0.0) - (
        attempts_before
    )
    per_cycle = len(window) / attempts if attempts else float("nan")
    return per_hour, startup, offers / elapsed, per_cycle


async def _reconcile_latency(api: KubeClient) -> list[float]:
    labeler = NodeLabeler(
        api,
        NODE,
        prefix="gpuid.github.com",
        metrics=LabelMetrics(CollectorRegistry()),
        board=StatusBoard(),
    )
    labeler.offer(_gb200())
    samples = []
    for _ in range(200):
        begin = time.perf_counter()
        await labeler.reconcile_once()
        samples.append(time.perf_counter() - begin)
    return samples


def _desired_cost(inventory: NodeInventory, rounds: int = 2000) -> float:
    begin = time.perf_counter()
    for _ in range(rounds):
        desired_state(inventory, "gpuid.github.com", annotation=True)
    return (time.perf_counter() - begin) / rounds


async def run() -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeKube() as kube:
            kube.add_node(NODE, labels={"kubernetes.io/hostname": NODE})
            path = write_kubeconfig(Path(tmp) / "kubeconfig", kube.url)
            client = await create_kube_client(environ={"KUBECONFIG": str(path)})
            assert client is not None
            try:
                per_hour, startup, offer_rate, per_cycle = await _steady_state(kube, client)
                samples = await _reconcile_latency(client)
            finally:
                await client.close()
    how = (
        f"resync {RESYNC_SCALED}s x {PERIODS} periods, scaled to LABEL_RESYNC_INTERVAL="
        f"{RESYNC_DEFAULT:g}s (x{SCALE:g}); inventory re-offered {offer_rate:.0f}/s"
    )
    gets = float(per_hour.get("get", 0))
    patches = float(per_hour.get("patch", 0))
    total = float(sum(per_hour.values()))
    rows += [
        Row(
            "labels",
            "steady_state_get_per_node_hour",
            gets,
            "req/h",
            f"{how}; ideal {3600 / RESYNC_DEFAULT:g} (scaling adds the GET latency to each period)",
        ),
        Row(
            "labels",
            "requests_per_resync_cycle",
            per_cycle,
            "req",
            f"x {3600 / RESYNC_DEFAULT:g} cycles/h at the default resync = "
            f"{per_cycle * 3600 / RESYNC_DEFAULT:.2f} req/h",
        ),
        Row("labels", "steady_state_patch_per_node_hour", patches, "req/h", "goal 0"),
        Row("labels", "steady_state_requests_per_node_hour", total, "req/h", "all verbs"),
        Row(
            "labels",
            f"fleet_{FLEET}_nodes_requests_per_second",
            total * FLEET / 3600.0,
            "req/s",
            "steady state, derived from the per-node figure",
        ),
        Row("labels", "startup_requests_until_labelled", startup, "req", "GET + PATCH"),
        Row(
            "labels",
            "noop_reconcile_p50",
            median(samples) * 1e3,
            "ms",
            "GET over loopback + diff, GB200 node",
        ),
        Row("labels", "noop_reconcile_p99", percentile(samples, 99) * 1e3, "ms", ""),
        Row(
            "labels",
            "desired_state_gb200",
            _desired_cost(_gb200()) * 1e6,
            "us",
            "per collection offer (labels + annotation)",
        ),
        Row("labels", "desired_state_h100x8", _desired_cost(_h100()) * 1e6, "us", ""),
    ]
    return rows
