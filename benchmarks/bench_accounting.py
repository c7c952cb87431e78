"""What GPU accounting adds to each /gpu/metrics snapshot at 8 GPUs x 128 pods (1,024 pods
time-slicing the GPUs): the accountant's advance, the accounting families and their text, and
the bytes they add, with the pods in 32 workloads (replicas) and each its own workload (the
most series accounting makes), by default and with ACCOUNTING_PER_POD. The advance is timed
with its inputs unchanged (the attributor's same object: the split is kept) and with a new
attribution each snapshot (the split taken again)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from types import MappingProxyType

from benchmarks.bench_serving import GPUS, OPTIONS, PODS, _best, snapshot
from benchmarks.common import Row
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.accounting_families import build_accounting_families
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.accounting_split import AccountingView
from gpuid_agent.state.attribution.holders import Attribution
from gpuid_agent.state.snapshot import NodeSnapshot

NAMING: gpu_metrics.Naming = "prometheus"
START = datetime(2026, 1, 1, tzinfo=UTC)  # fixed read times: the same totals every run


def _workload(pod: str, workloads: int) -> str:
    return f"job-{int(pod.rsplit('-', 1)[1]) % workloads}" if workloads < PODS else pod


def _node(step: int, workloads: int = PODS) -> NodeSnapshot:
    """The serving benchmark's node, its pods in `workloads` Jobs, 10 s apart."""
    snap = snapshot(step)
    by_device = {
        uuid: tuple(
            dataclasses.replace(h, workload_name=_workload(h.pod, workloads)) for h in holders
        )
        for uuid, holders in snap.attribution.by_device.items()
    }
    inventory = dataclasses.replace(snap.inventory, read_time=START + timedelta(seconds=10 * step))
    return dataclasses.replace(
        snap,
        inventory=inventory,
        attribution=Attribution("current", by_device=MappingProxyType(by_device)),
    )


def _view(per_pod: bool, workloads: int) -> tuple[Accountant, NodeSnapshot, AccountingView]:
    accountant = Accountant(AccountingConfig(per_pod=per_pod), "bench-node")
    view = AccountingView()
    snap = _node(0)
    for step in range(3):
        snap = _node(step, workloads)
        view = accountant.advance(snap.inventory, snap.samples, snap.attribution, snap.processes)
    return accountant, snap, view


def rows() -> list[Row]:
    group = "accounting"
    note = f"{GPUS} GPUs x {PODS // GPUS} pods, {NAMING} naming"
    out: list[Row] = []
    base = _node(0)
    plain = gpu_metrics.expose(
        gpu_metrics.collect(
            base.inventory, base.samples, NAMING, base.health,
            attribution=base.attribution, options=OPTIONS,
        ),
        "text",
    )  # fmt: skip
    out.append(Row(group, "/gpu/metrics without accounting", len(plain) / 1024, "KiB", note))
    for workloads, per_pod in ((32, False), (PODS, False), (PODS, True)):
        label = f"{workloads} workloads" + (", per pod too" if per_pod else "")
        accountant, snap, view = _view(per_pod, workloads)

        def advance(a: Accountant = accountant, s: NodeSnapshot = snap) -> AccountingView:
            return a.advance(s.inventory, s.samples, s.attribution, s.processes)

        def new_split(a: Accountant = accountant, s: NodeSnapshot = snap) -> AccountingView:
            attribution = Attribution("current", by_device=s.attribution.by_device)
            return a.advance(s.inventory, s.samples, attribution, s.processes)

        def render(v: AccountingView = view) -> bytes:
            return gpu_metrics.expose(build_accounting_families(v, NAMING, OPTIONS), "text")

        added = render()
        out += [
            Row(group, f"advance, split kept ({label})", _best(advance, 5), "ms", "per snapshot"),
            Row(
                group, f"advance, split again ({label})", _best(new_split, 5), "ms", "per snapshot"
            ),
            Row(group, f"families + text ({label})", _best(render, 5), "ms", "per render"),
            Row(group, f"bytes added ({label})", len(added) / 1024, "KiB", note),
        ]
    return out


async def run() -> list[Row]:
    return rows()
