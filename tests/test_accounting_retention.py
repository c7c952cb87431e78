"""Flat under churn: workloads, pods and holdings that hold no GPU any more leave accounting
(and with it /gpu/metrics and the state file) ACCOUNTING_RETENTION after they let go, at
most MAX_ENDED at a time, the longest unheld first; the idle rows stay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType

import pytest

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.runtime.config import Settings
from gpuid_agent.state import accounting
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.accounting_split import IDLE, AccountingView, idle_holding
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.attribution.shares import PROCESSES_OFF
from gpuid_agent.state.state_file import StateDir

GPUS = [GpuIdentity(index=i, uuid=f"GPU-{i}") for i in range(2)]
START = datetime(2026, 1, 1, tzinfo=UTC)


def _inventory(at: float) -> NodeInventory:
    return NodeInventory(
        node="n", cluster="c", machine="m", machine_source="test", driver_version=None,
        cuda_driver_version=None, gpus=tuple(GPUS), read_time=START + timedelta(seconds=at),
    )  # fmt: skip


def _held_by(job: int | None) -> Attribution:
    if job is None:
        return Attribution("current", by_device=MappingProxyType({}))
    holder = Holder("batch", f"job-{job}-pod", "main", workload_kind="Job", workload_name=f"job-{job}")
    return Attribution("current", by_device=MappingProxyType({GPUS[0].uuid: (holder,)}))


def _advance(a: Accountant, at: float, job: int | None) -> AccountingView:
    samples = {g.uuid: GpuSample(g.uuid, MappingProxyType({"energy_mj": at * 1000})) for g in GPUS}
    return a.advance(_inventory(at), samples, _held_by(job), PROCESSES_OFF)


def test_a_workload_leaves_retention_after_it_let_go() -> None:
    a = Accountant(AccountingConfig(per_pod=True, retention=60.0), "n")
    for at in range(0, 50, 10):
        view = _advance(a, at, job=1)
    names = {k.owner_name for k in view.workloads}
    assert names == {"", "job-1"} and len(view.pods) == 1
    view = _advance(a, 50, job=None)  # let go: still there while the retention runs
    for at in range(60, 111, 10):
        view = _advance(a, at, job=None)
        assert {k.owner_name for k in view.workloads} == {"", "job-1"}
    view = _advance(a, 111, job=None)  # 61 s after the read that ended its time
    assert set(view.workloads) == {IDLE}
    assert not view.pods
    assert set(view.holdings) == {idle_holding(g.uuid) for g in GPUS}


def test_held_again_within_the_retention_keeps_its_series() -> None:
    a = Accountant(AccountingConfig(retention=60.0), "n")
    _advance(a, 0, job=1)
    _advance(a, 10, job=None)
    _advance(a, 50, job=1)  # back before its retention ran out
    view = _advance(a, 200, job=1)
    job = next(k for k in view.workloads if k.owner_name == "job-1")
    assert view.workloads[job].gpu_seconds == pytest.approx(10 + 150)


def test_churn_keeps_at_most_max_ended_and_the_state_file_small(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(accounting, "MAX_ENDED", 50)
    state = StateDir(str(tmp_path))
    a = Accountant(AccountingConfig(per_pod=True, retention=10**9, state_dir=state), "n")
    for job in range(2000):  # each its own workload, one read each
        view = _advance(a, 10.0 * job, job=job)
    # 50 ended keys in all (a workload, a pod and a holding each), the holder now, idle
    assert len(view.workloads) <= 50 // 3 + 3
    assert len(view.pods) <= 50 // 3 + 2
    kept = sorted(int(k.owner_name.split("-")[1]) for k in view.workloads if k.owner_name)
    assert len(kept) >= 50 // 3 - 1
    assert kept == list(range(kept[0], kept[0] + len(kept)))  # the most recently held
    assert kept[-1] >= 1998
    size = len(a._state_bytes())
    assert size < 50 * 400, size


def test_a_restart_forgets_what_ended_before_it_in_time(tmp_path: Path) -> None:
    state = StateDir(str(tmp_path))
    a = Accountant(AccountingConfig(retention=60.0, state_dir=state), "n")
    _advance(a, 0, job=1)
    _advance(a, 10, job=2)  # job-1 ended
    (tmp_path / "accounting.json").write_bytes(a._state_bytes())
    again = Accountant(AccountingConfig(retention=60.0, state_dir=state), "n")
    view = _advance(again, 20, job=2)
    assert any(k[1] == "job-1-pod" for k in view.holdings)
    view = _advance(again, 100, job=2)
    assert not any(k[1] == "job-1-pod" for k in view.holdings)


def test_the_retention_is_a_setting_with_a_one_hour_default() -> None:
    assert Settings().accounting_retention == 3600.0
    assert Settings(accounting_retention="15m").accounting_retention == 900.0  # type: ignore[arg-type]
