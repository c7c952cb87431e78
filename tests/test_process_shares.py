"""Processes mapped to holders and summed per device: what each holder uses, the unattributed
rest by reason, and the rule that the parts add up to the device's own figure."""

from __future__ import annotations

from datetime import UTC, datetime
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity, GpuSample, MigDevice, NodeInventory
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.nvml.process_values import GpuProcesses, ProcessInfo
from gpuid_agent.sources.procfs import HOST_PROCESS, PID_GONE, UNKNOWN_CGROUP, CgroupOwner
from gpuid_agent.state.attribution.holders import Allocation, Attribution, Holder
from gpuid_agent.state.attribution.process_mapping import share_processes
from gpuid_agent.state.attribution.shares import UNACCOUNTED, UNKNOWN_POD, usage_state

GIB = 1024**3
GPU0, GPU1 = "GPU-0000", "GPU-1111"
UID_A, UID_B, UID_X = "aaaaaaaa-0000-4000-8000-000000000001", "b" * 32, "c" * 32
CID_A, CID_A2, CID_B = "a" * 64, "d" * 64, "b" * 64

HOLDER_A = Holder("ml", "train", "trainer", pod_uid=UID_A, workload_kind="Job")
HOLDER_B = Holder("ml", "serve", "server", pod_uid=UID_B)
PODS = {
    UID_A: PodMeta("ml", "train", UID_A, containers=MappingProxyType({CID_A: "trainer"})),
    UID_B: PodMeta("ml", "serve", UID_B, containers=MappingProxyType({CID_B: "server"})),
    # a pod on the node that holds no GPU through the kubelet
    UID_X: PodMeta("web", "rogue", UID_X, containers=MappingProxyType({"e" * 64: "app"})),
}


def inventory(*gpus: GpuIdentity) -> NodeInventory:
    return NodeInventory("n", "c", "m", "s", None, None, gpus, datetime.now(UTC))


def time_sliced() -> Attribution:
    allocations = (
        Allocation(HOLDER_A, "nvidia.com/gpu", f"{GPU0}::0", GPU0, replica=0),
        Allocation(HOLDER_B, "nvidia.com/gpu", f"{GPU0}::1", GPU0, replica=1),
    )
    return Attribution(
        "current",
        allocations=allocations,
        by_device=MappingProxyType({GPU0: (HOLDER_A, HOLDER_B)}),
    )


def sample(uuid: str, memory: float | None, util: float | None) -> GpuSample:
    values = {"memory_used_bytes": memory, "gpu_util": util}
    return GpuSample(uuid, MappingProxyType({k: v for k, v in values.items() if v is not None}))


OWNERS: dict[int, CgroupOwner | str] = {
    10: CgroupOwner(UID_A, CID_A, "burstable"),
    11: CgroupOwner(UID_A, CID_A2, "burstable"),  # a container id the status does not list yet
    20: CgroupOwner(UID_B, CID_B, "guaranteed"),
    30: HOST_PROCESS,
    40: PID_GONE,
    50: UNKNOWN_CGROUP,
    60: CgroupOwner("f" * 32, "f" * 64, "besteffort"),  # a pod UID nobody knows
    70: CgroupOwner(UID_X, "e" * 64, "burstable"),
}


def test_time_sliced_gpu_split_between_holders_and_reasons() -> None:
    inv = inventory(GpuIdentity(0, GPU0), GpuIdentity(1, GPU1))
    procs = tuple(ProcessInfo(pid, GIB * (i + 1)) for i, pid in enumerate(OWNERS))
    sm = {10: 20.0, 11: 5.0, 20: 30.0, 30: 10.0}
    readings = {GPU0: GpuProcesses(GPU0, procs, sm), GPU1: GpuProcesses(GPU1, (), {})}
    samples = {GPU0: sample(GPU0, 40 * GIB, 70), GPU1: sample(GPU1, 0.5 * GIB, 0)}
    view = share_processes(
        inv, samples, time_sliced(), readings, OWNERS, by_uid=PODS.get, label_allowlist=()
    )
    shares = view.devices[GPU0].shares
    by = {(s.holder.pod, s.holder.container) if s.holder else s.reason: s for s in shares}
    # pids 10 and 11: one container (11's id is unknown, the pod's one GPU container is used)
    assert by[("train", "trainer")].memory_bytes == 3 * GIB
    assert by[("train", "trainer")].processes == 2
    assert by[("train", "trainer")].sm_util == 25.0
    assert by[("train", "trainer")].holder is HOLDER_A  # the kubelet's holder, with workload
    assert by[("train", "trainer")].allocated
    assert by[("serve", "server")].memory_bytes == 3 * GIB
    assert by[("rogue", "app")].memory_bytes == 8 * GIB
    assert not by[("rogue", "app")].allocated  # busy on a GPU it does not hold
    assert by[HOST_PROCESS].memory_bytes == 4 * GIB and by[HOST_PROCESS].sm_util == 10.0
    assert by[PID_GONE].memory_bytes == 5 * GIB
    assert by[UNKNOWN_CGROUP].memory_bytes == 6 * GIB
    assert by[UNKNOWN_POD].memory_bytes == 7 * GIB
    assert by[UNACCOUNTED].memory_bytes == 40 * GIB - 36 * GIB
    assert by[UNACCOUNTED].sm_util == 70 - 65
    assert sum(s.memory_bytes or 0 for s in shares) == 40 * GIB
    assert not view.devices[GPU0].scaled
    assert [s.reason for s in view.devices[GPU1].shares] == [UNACCOUNTED]
    assert view.devices[GPU1].shares[0].memory_bytes == 0.5 * GIB


def test_sum_above_the_device_figure_is_scaled_to_it() -> None:
    inv = inventory(GpuIdentity(0, GPU0))
    procs = (ProcessInfo(10, 30 * GIB), ProcessInfo(20, 10 * GIB))
    readings = {GPU0: GpuProcesses(GPU0, procs, {10: 80.0, 20: 40.0})}
    view = share_processes(
        inv, {GPU0: sample(GPU0, 20 * GIB, 90)}, time_sliced(), readings, OWNERS, by_uid=PODS.get
    )
    d = view.devices[GPU0]
    assert d.scaled
    mem = {s.holder.pod if s.holder else s.reason: s.memory_bytes for s in d.shares}
    assert mem == {"train": 15 * GIB, "serve": 5 * GIB, UNACCOUNTED: 0}
    assert sum(s.sm_util or 0 for s in d.shares) == pytest.approx(90)


def test_without_the_api_pods_are_unknown_and_nothing_is_guessed() -> None:
    inv = inventory(GpuIdentity(0, GPU0))
    no_uids = Attribution(
        "current",
        allocations=(Allocation(Holder("ml", "train", "t"), "nvidia.com/gpu", GPU0, GPU0),),
        by_device=MappingProxyType({GPU0: (Holder("ml", "train", "t"),)}),
    )
    readings = {GPU0: GpuProcesses(GPU0, (ProcessInfo(10, GIB),), None)}
    view = share_processes(inv, {GPU0: sample(GPU0, 2 * GIB, None)}, no_uids, readings, OWNERS)
    (use,) = view.devices[GPU0].processes
    assert use.holder is None and use.reason == UNKNOWN_POD and use.sm_util is None
    reasons = [(s.reason, s.memory_bytes, s.sm_util) for s in view.devices[GPU0].shares]
    assert reasons == [(UNKNOWN_POD, GIB, None), (UNACCOUNTED, GIB, None)]


def test_mig_processes_land_on_their_instance_and_the_parent_has_no_remainder() -> None:
    migs = (MigDevice(0, "MIG-a", 1, 0, "3g.40gb"), MigDevice(1, "MIG-b", 2, 0, "1g.10gb"))
    inv = inventory(GpuIdentity(0, GPU0, mig_enabled=True, mig_devices=migs))
    procs = (ProcessInfo(10, GIB, 1, 0), ProcessInfo(20, 2 * GIB, 2, 0), ProcessInfo(30, GIB, 9, 0))
    readings = {GPU0: GpuProcesses(GPU0, procs, None)}
    samples = {
        GPU0: sample(GPU0, 50 * GIB, None),
        "MIG-a": sample("MIG-a", 1.5 * GIB, None),
        "MIG-b": sample("MIG-b", 2 * GIB, None),
    }
    view = share_processes(inv, samples, Attribution("current"), readings, OWNERS, by_uid=PODS.get)
    assert [u.pid for u in view.devices["MIG-a"].processes] == [10]
    assert [u.pid for u in view.devices["MIG-b"].processes] == [20]
    assert [u.pid for u in view.devices[GPU0].processes] == [30]  # no such instance: the GPU
    assert view.devices["MIG-a"].shares[-1].memory_bytes == 0.5 * GIB
    assert all(s.reason != UNACCOUNTED for s in view.devices[GPU0].shares)


@pytest.mark.parametrize(
    ("held", "util", "procs", "state"),
    [
        (True, 0, False, "held_idle"),
        (True, 5, False, "held_busy"),
        (True, 0, True, "held_busy"),
        (False, 0, True, "unowned_busy"),
        (False, 40, False, "unowned_busy"),
        (False, None, False, "free"),
    ],
)
def test_usage_state(held: bool, util: float | None, procs: bool, state: str) -> None:
    inv = inventory(GpuIdentity(0, GPU0))
    readings = {GPU0: GpuProcesses(GPU0, (ProcessInfo(30, 1),) if procs else (), None)}
    shares = share_processes(inv, {}, Attribution("current"), readings, OWNERS).devices[GPU0]
    assert usage_state(held, util, shares) == state


def test_usage_unknown_without_utilization_or_processes() -> None:
    # a MIG device (no utilization of its own) with process attribution off
    assert usage_state(True, None, None) == "held"
    assert usage_state(False, None, None) == "unowned"
    assert usage_state(True, 0, None) == "held_idle"


@given(
    memories=st.lists(
        st.tuples(st.sampled_from(sorted(OWNERS)), st.one_of(st.none(), st.integers(0, 2**45))),
        max_size=40,
    ),
    sms=st.dictionaries(st.sampled_from(sorted(OWNERS)), st.floats(0, 100), max_size=8),
    figure=st.one_of(st.none(), st.integers(0, 2**46)),
    util=st.one_of(st.none(), st.integers(0, 100)),
)
@settings(max_examples=300, deadline=None)
def test_parts_never_exceed_the_device_and_add_up_to_it(memories, sms, figure, util) -> None:  # type: ignore[no-untyped-def]
    inv = inventory(GpuIdentity(0, GPU0))
    procs = tuple(ProcessInfo(pid, mem) for pid, mem in memories)
    readings = {GPU0: GpuProcesses(GPU0, procs, sms)}
    view = share_processes(
        inv, {GPU0: sample(GPU0, figure, util)}, time_sliced(), readings, OWNERS, by_uid=PODS.get
    )
    shares = view.devices[GPU0].shares
    assert all((s.memory_bytes or 0) >= 0 and (s.sm_util or 0) >= 0 for s in shares)
    if figure is not None:
        total = sum(s.memory_bytes or 0 for s in shares)
        assert total == pytest.approx(figure, rel=1e-9, abs=1)
        held = sum(s.memory_bytes or 0 for s in shares if s.holder is not None)
        assert held <= figure * (1 + 1e-9)
    if util is not None:
        assert sum(s.sm_util or 0 for s in shares) == pytest.approx(util, abs=1e-6)


def test_no_samples_leave_utilization_unsplit() -> None:
    inv = inventory(GpuIdentity(0, GPU0))
    readings = {GPU0: GpuProcesses(GPU0, (ProcessInfo(10, GIB),), None)}
    view = share_processes(
        inv, {GPU0: sample(GPU0, GIB, 55)}, time_sliced(), readings, OWNERS, by_uid=PODS.get
    )
    assert [s.sm_util for s in view.devices[GPU0].shares] == [None, None]
