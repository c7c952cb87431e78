"""Months of pod churn, time compressed: short-lived pods, each a workload of its own, pass
through an 8-GPU node one after another on every GPU (a collection every 10 s of simulated
time, a new pod on each GPU every 3 collections), through the real accountant, allocation
trail (with its state file) and /gpu/metrics families. Printed per 10,000 pods: the process's
RSS, the /gpu/metrics bytes and workload series, and the sizes of accounting.json and
allocations.json; then the same once ACCOUNTING_RETENTION (1h) has passed with the GPUs idle.

`python -m benchmarks churn [--churn-pods=N]` (default 100,000)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import tempfile
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType

from benchmarks.common import Row
from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.accounting_families import ACCOUNTING_METRICS
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.attribution.shares import PROCESSES_OFF
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.snapshot import NodeSnapshot
from gpuid_agent.state.state_file import StateDir

GPUS = 8
STEP = 10.0  # simulated seconds between collections
LIFE = 3  # collections each pod holds its GPU
REPORT_EVERY = 10_000
RETENTION = 3600.0
START = datetime(2026, 1, 1, tzinfo=UTC)
OPTIONS = gpu_metrics.RenderOptions(workload_labels=True)
_GPUS = tuple(
    GpuIdentity(i, f"GPU-{i:08d}-0000-4000-8000-000000000000", serial=f"1652{i:08d}")
    for i in range(GPUS)
)


def _pods() -> int:
    for arg in sys.argv[1:]:
        if arg.startswith("--churn-pods="):
            return int(arg.split("=", 1)[1])
    return 100_000


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Node:
    """The accountant, trail and page of one node, fed simulated collections."""

    def __init__(self, state: Path) -> None:
        state_dir = StateDir(str(state))
        self.state = state
        self.accountant = Accountant(
            AccountingConfig(state_dir=state_dir, retention=RETENTION), "churn-node"
        )
        self.now = START
        self.trail = AllocationTrail(
            TrailIdentity("bench", "churn-node", "bench"),
            publish_durable=self._delivered,
            state_dir=state_dir,
            clock=lambda: self.now,
        )
        self.step = 0
        self.sent = 0

    async def _delivered(self, records: list[AnyRecord]) -> None:
        self.sent += len(records)

    def snapshot(self, holders: list[Holder | None]) -> NodeSnapshot:
        allocations = tuple(
            Allocation(h, "nvidia.com/gpu", gpu.uuid, gpu.uuid)
            for h, gpu in zip(holders, _GPUS, strict=True)
            if h is not None
        )
        by_device = {a.gpu_uuid: (a.holder,) for a in allocations}
        attribution = Attribution("current", allocations, by_device=MappingProxyType(by_device))
        inventory = NodeInventory(
            "churn-node", "bench", "m", "bench", None, None, _GPUS, self.now
        )  # fmt: skip
        joules = self.step * STEP * 400
        samples = {
            g.uuid: GpuSample(g.uuid, MappingProxyType({"energy_mj": joules * 1000}))
            for g in _GPUS
        }
        view = self.accountant.advance(inventory, samples, attribution, PROCESSES_OFF)
        snap = NodeSnapshot(self.step, "collection", inventory, samples, NodeHealth(), attribution)
        return replace(snap, accounting=view)

    async def collect(self, holders: list[Holder | None]) -> NodeSnapshot:
        self.now = START + timedelta(seconds=STEP * self.step)
        snap = self.snapshot(holders)
        self.trail.note(snap)
        await self.trail.flush()
        await self.accountant.save_due()
        self.step += 1
        return snap

    def page(self, snap: NodeSnapshot) -> tuple[int, int]:
        families = gpu_metrics.collect(
            snap.inventory, snap.samples, "prometheus", snap.health,
            attribution=snap.attribution, options=OPTIONS, accounting=snap.accounting,
        )  # fmt: skip
        workloads = sum(
            len(f.rows) for f in families if f.series_name == ACCOUNTING_METRICS[0]
        )
        return len(gpu_metrics.expose(families, "text")), workloads

    def files(self) -> tuple[int, int]:
        (self.state / "accounting.json").write_bytes(self.accountant._state_bytes())
        sizes = [(self.state / n).stat().st_size for n in ("accounting.json", "allocations.json")]
        return sizes[0], sizes[1]


def _holder(pod: int) -> Holder:
    return Holder("ci", f"job-{pod}-x7k2p", "main", f"uid-{pod}", "Job", f"job-{pod}")


async def churn(pods: int) -> list[Row]:
    group, rows = "churn", []
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(Path(tmp))
        idle: list[Holder | None] = [None] * GPUS
        snap = await node.collect(idle)
        for _ in range(int(RETENTION / STEP) + 2):  # a settled node before the churn
            snap = await node.collect(idle)
        gc.collect()
        page0, series0 = node.page(snap)
        rss0 = _rss_mib()
        rows += [
            Row(group, "before: RSS", rss0, "MiB", "the benchmark process"),
            Row(group, "before: /gpu/metrics", page0 / 1024, "KiB", f"{series0} workload series"),
        ]
        started = 0
        while started < pods:
            holders: list[Holder | None] = [
                _holder(started + i) for i in range(min(GPUS, pods - started))
            ]
            holders += [None] * (GPUS - len(holders))
            started += sum(1 for h in holders if h is not None)
            for _ in range(LIFE):
                snap = await node.collect(holders)
            if started % REPORT_EVERY < GPUS or started >= pods:
                rows += _figures(node, snap, f"{started:,} pods", rss0)
        for _ in range(int(RETENTION / STEP) + 2):  # the retention passes, the GPUs idle
            snap = await node.collect(idle)
        rows += _figures(node, snap, "after the retention", rss0, f"; {node.sent:,} records sent")
    return rows


def _figures(node: Node, snap: NodeSnapshot, label: str, rss0: float, more: str = "") -> list[Row]:
    """RSS over `rss0`, the page, its workload series and the state files, at this point."""
    gc.collect()
    page, series = node.page(snap)
    accounting, allocations = node.files()
    note = (
        f"{series} workload series; accounting.json {accounting / 1024:.0f} KiB, "
        f"allocations.json {allocations / 1024:.0f} KiB{more}"
    )
    return [
        Row("churn", f"{label}: RSS", _rss_mib() - rss0, "MiB", "over before"),
        Row("churn", f"{label}: /gpu/metrics", page / 1024, "KiB", note),
    ]


async def run() -> list[Row]:
    return await churn(_pods())


if __name__ == "__main__":
    asyncio.run(run())
