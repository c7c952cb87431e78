"""The health rules on their own: XID classes, clock and fabric decoding, windows, transitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime.fault_spec import FAULT_KINDS, LINK_KINDS, Fault, parse_fault, parse_faults
from gpuid_agent.sources.nvml.signals import (
    EccCounts,
    FabricInfo,
    GpuHealthSignals,
    RemappedRows,
    XidEvent,
)
from gpuid_agent.state.health import checks
from gpuid_agent.state.health.clocks import MASK_64, REASON_BITS, decode_clock_reasons, unknown_bits
from gpuid_agent.state.health.fabric import decode_health_mask, fabric_verdict
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import ACTIONS, CHECK_STATES, GPU_CHECKS
from gpuid_agent.state.health.xid import CRITICAL_XIDS, XID_TABLE, classify_xid

hostile_values = st.one_of(
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.binary(max_size=8),
)

# ---- XID classification ------------------------------------------------------------------


@given(st.one_of(st.integers(), hostile_values))
def test_any_xid_code_gets_a_valid_class(code: object) -> None:
    cls = classify_xid(code)  # type: ignore[arg-type]
    assert cls.state in ("healthy", "degraded", "unhealthy")
    assert cls.action in ACTIONS
    if isinstance(code, int) and not isinstance(code, bool) and code in XID_TABLE:
        assert cls is XID_TABLE[code]
    else:
        assert cls.state == "degraded" and not cls.latched


@pytest.mark.parametrize(
    ("code", "state", "action"),
    [
        (48, "unhealthy", "reboot"),
        (63, "healthy", "none"),
        (64, "unhealthy", "reset"),
        (74, "unhealthy", "reboot"),
        (79, "unhealthy", "reboot"),
        (92, "degraded", "hardware_inspection"),
        (94, "degraded", "check_workload"),
        (95, "unhealthy", "reset"),
        (13, "degraded", "check_workload"),
        (45, "healthy", "none"),
    ],
)
def test_catalogue_entries(code: int, state: str, action: str) -> None:
    cls = classify_xid(code)
    assert (cls.state, cls.action) == (state, action)


def test_every_critical_xid_latches() -> None:
    assert {48, 64, 74, 79, 95, 173} <= CRITICAL_XIDS and 63 not in CRITICAL_XIDS
    assert all(XID_TABLE[c].latched for c in CRITICAL_XIDS)


# ---- clock-event reasons -----------------------------------------------------------------


@given(st.integers(min_value=0, max_value=MASK_64))
def test_clock_reasons_decode_exactly_the_set_bits(mask: int) -> None:
    names = decode_clock_reasons(mask)
    assert names == {name for name, bit in REASON_BITS.items() if mask & bit}
    rebuilt = 0
    for name in names:
        rebuilt |= REASON_BITS[name]
    assert rebuilt | unknown_bits(mask) == mask


@given(
    st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MASK_64 + 1),
        st.floats(),
        st.text(),
        st.none(),
        st.booleans(),
    )
)
def test_clock_reasons_reject_what_nvml_cannot_return(mask: object) -> None:
    with pytest.raises(ValueError, match="clock-event reasons"):
        decode_clock_reasons(mask)  # type: ignore[arg-type]


def _window(masks: list[int], window: float = 10.0) -> checks.ReasonWindow:
    w = checks.ReasonWindow(window)
    for t, mask in enumerate(masks):
        w.add(float(t), mask)
    return w


def test_clock_slowdown_needs_a_share_of_the_window() -> None:
    thermal = 0x40 | 0x8
    assert checks.clock_events_verdict(_window([thermal] * 2)).state == "healthy"  # too few
    assert checks.clock_events_verdict(_window([0] * 9 + [thermal])).state == "healthy"
    verdict = checks.clock_events_verdict(_window([0] * 6 + [thermal] * 4))
    assert verdict.state == "degraded" and verdict.action == "hardware_inspection"
    assert "hardware thermal" in (verdict.reason or "")
    # idle, sync boost and the software power cap are normal operation
    normal = 0x1 | 0x4 | 0x10 | 0x100
    assert checks.clock_events_verdict(_window([normal] * 10)).state == "healthy"
    # old samples leave the window
    w = _window([thermal] * 5, window=2.0)
    for t in range(5, 10):
        w.add(float(t), 0)
    assert checks.clock_events_verdict(w).state == "healthy"


def test_power_brake_is_named_over_the_umbrella_bit() -> None:
    verdict = checks.clock_events_verdict(_window([0x80 | 0x8] * 5))
    assert "power brake" in (verdict.reason or "")


# ---- fabric ------------------------------------------------------------------------------

HEALTHY_MASK = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8 | 1 << 12 | 1 << 14


def _fabric(state: int = 3, status: int = 0, mask: int = HEALTHY_MASK, summary: int | None = 1):  # type: ignore[no-untyped-def]
    return FabricInfo(state, status, mask, 1, None, summary)


@given(st.integers(min_value=0, max_value=(1 << 32) - 1))
def test_fabric_mask_fields_are_read_from_their_bits(mask: int) -> None:
    health = decode_health_mask(mask)
    assert health.degraded_bandwidth == (mask & 0x3 == 1)
    assert health.route_unhealthy == ((mask >> 4) & 0x3 == 1)
    assert health.fabric_manager_disconnected == ((mask >> 14) & 0x3 == 2)
    assert (health.incorrect_configuration is None) == ((mask >> 8) & 0xF in (0, 1))


@given(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.one_of(st.none(), st.integers(min_value=-5, max_value=300)),
)
def test_fabric_verdict_survives_any_values(
    state: int, status: int, mask: int, summary: int | None
) -> None:
    verdict = fabric_verdict(_fabric(state, status, mask, summary))
    assert verdict.state in CHECK_STATES and verdict.action in ACTIONS


def test_fabric_verdicts() -> None:
    assert fabric_verdict(_fabric()).state == "healthy"
    assert fabric_verdict(_fabric(state=0)).state == "not_supported"
    assert fabric_verdict(_fabric(state=2)).state == "degraded"
    assert fabric_verdict(_fabric(status=999)).state == "unhealthy"
    degraded = fabric_verdict(_fabric(mask=(HEALTHY_MASK & ~0x3) | 1))
    assert (degraded.state, degraded.action) == ("degraded", "hardware_inspection")
    wrong = fabric_verdict(_fabric(mask=(HEALTHY_MASK & ~(0xF << 8)) | 5 << 8))
    assert wrong.state == "unhealthy" and "insufficient NVLinks" in (wrong.reason or "")
    assert fabric_verdict(_fabric(summary=2)).state == "unhealthy"


# ---- ECC and remapped rows ---------------------------------------------------------------


def test_counter_window_growth_and_reset() -> None:
    w = checks.CounterWindow(10.0)
    w.add(0.0, 5)
    w.add(1.0, 5)
    assert w.growth() == 0
    w.add(2.0, 8)
    assert w.growth() == 3
    w.add(20.0, 8)  # the growth is older than the window now
    assert w.growth() == 0
    w.add(21.0, 2)  # counters cleared (driver reload): start again, not negative
    assert w.growth() == 0


def test_ecc_and_remap_verdicts() -> None:
    clean = EccCounts(0, 0, 10, 0)

    def ecc(counts: EccCounts | None, pending: bool | None = False, corr: int = 0, unc: int = 0):  # type: ignore[no-untyped-def]
        return checks.ecc_verdict(
            counts, pending, corrected_growth=corr, uncorrected_growth=unc, window=300
        )

    assert ecc(clean).state == "healthy"  # old aggregate errors alone are history
    assert (ecc(clean, corr=3).state, ecc(clean, corr=3).action) == ("degraded", "none")
    assert "last 5m" in (ecc(clean, corr=3).reason or "")
    assert ecc(EccCounts(0, 2, 0, 2)).action == "reboot"
    assert ecc(clean, unc=1).state == "unhealthy"
    assert (ecc(clean, pending=True).state, ecc(clean, pending=True).action) == (
        "unhealthy",
        "reboot",
    )
    assert ecc(None).state == "not_supported"
    pending = checks.remapped_rows_verdict(RemappedRows(0, 1, True, False))
    assert (pending.state, pending.action) == ("degraded", "reset")  # when convenient
    failed = checks.remapped_rows_verdict(RemappedRows(0, 9, True, True))
    assert (failed.state, failed.action) == ("unhealthy", "hardware_inspection")
    assert checks.remapped_rows_verdict(RemappedRows(3, 0, False, False)).state == "healthy"


# ---- the tracker: transitions exactly once -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=self.t)


def _gpus(n: int = 2) -> list[GpuIdentity]:
    return [GpuIdentity(index=i, uuid=f"GPU-{i}", serial=f"S{i}") for i in range(n)]


def _signals(index: int, **fields: object) -> GpuHealthSignals:
    base: dict[str, object] = {
        "ecc": EccCounts(0, 0, 0, 0),
        "retired_pages_pending": False,
        "remapped_rows": RemappedRows(0, 0, False, False),
        "clocks_event_reasons": 0,
        "fabric": _fabric(),
        "persistence_mode": 1,
    }
    base.update(fields)
    return GpuHealthSignals(index=index, uuid=f"GPU-{index}", **base)  # type: ignore[arg-type]


def _tracker(clock: Clock, **kw: float) -> HealthTracker:
    return HealthTracker(
        clock=clock, wall=clock.wall, window=kw.get("window", 5.0), xid_hold=kw.get("xid_hold", 3.0)
    )


def test_healthy_start_is_quiet_and_a_fault_is_one_transition_however_long() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    gpus = _gpus()
    assert tracker.observe(gpus, {0: _signals(0), 1: _signals(1)}, {}) == []
    bad = {0: _signals(0), 1: _signals(1, remapped_rows=RemappedRows(0, 1, False, True))}
    seen = []
    for _ in range(20):
        clock.t += 1
        seen += tracker.observe(gpus, bad, {})
    assert [(t.uuid, t.check, t.current.state, t.previous.state) for t in seen] == [  # type: ignore[union-attr]
        ("GPU-1", "remapped_rows", "unhealthy", "healthy")
    ]
    assert seen[0].gpu_state == "unhealthy"
    snap = tracker.snapshot()
    assert snap.by_uuid()["GPU-1"].checks["remapped_rows"].since == clock.wall() - timedelta(
        seconds=19
    )
    assert snap.by_uuid()["GPU-0"].state == "healthy"
    clock.t += 1
    back = tracker.observe(gpus, {0: _signals(0), 1: _signals(1)}, {})
    assert [(t.check, t.current.state) for t in back] == [("remapped_rows", "healthy")]


def test_an_action_change_is_a_transition_a_reworded_reason_is_not() -> None:
    clock = Clock()
    tracker = _tracker(clock, window=100.0)
    gpus = _gpus(1)
    changes = []
    for n in range(1, 6):  # corrected errors keep growing: same state, new wording
        clock.t += 1
        changes += tracker.observe(gpus, {0: _signals(0, ecc=EccCounts(n, 0, n, 0))}, {})
    assert [(t.check, t.current.state) for t in changes] == [("ecc", "degraded")]
    assert "4 new corrected" in (tracker.snapshot().gpus[0].checks["ecc"].reason or "")
    clock.t += 1
    pending = RemappedRows(0, 1, True, False)
    failed = RemappedRows(0, 1, True, True)
    first = tracker.observe(gpus, {0: _signals(0, remapped_rows=pending)}, {})
    second = tracker.observe(gpus, {0: _signals(0, remapped_rows=failed)}, {})
    assert [t.current.action for t in first + second if t.check == "remapped_rows"] == [
        "reset",
        "hardware_inspection",
    ]


def test_lost_gpu_freezes_its_other_checks_and_recovers() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    gpus = _gpus(1)
    tracker.observe(gpus, {0: _signals(0)}, {})
    clock.t += 1
    lost = tracker.observe(gpus, {}, {0: "GPU 0 is lost (NVML error 15)"})
    assert [(t.check, t.current.state, t.current.action) for t in lost] == [
        ("lost", "unhealthy", "reboot")
    ]
    assert tracker.snapshot().gpus[0].checks["ecc"].state == "healthy"  # kept, not unknown
    clock.t += 1
    assert tracker.observe(gpus, {}, {0: "still lost"}) == []
    back = tracker.observe(gpus, {0: _signals(0)}, {})
    assert [(t.check, t.current.state) for t in back] == [("lost", "healthy")]
    via_call = tracker.observe(
        gpus, {0: GpuHealthSignals(0, "GPU-0", lost="GPU requires a reset")}, {}
    )
    assert [(t.check, t.current.reason) for t in via_call] == [("lost", "GPU requires a reset")]


def test_xids_latch_or_hold_and_count() -> None:
    clock = Clock()
    tracker = _tracker(clock, xid_hold=3.0)
    gpus = _gpus()
    tracker.observe(gpus, {0: _signals(0), 1: _signals(1)}, {})

    def xid(index: int, code: int) -> list:  # type: ignore[type-arg]
        return tracker.record_xid(XidEvent(index, f"GPU-{index}", code, clock.wall()))

    assert xid(1, 45) == []  # informational: counted only
    [t] = xid(1, 13)
    assert (t.current.state, t.current.action) == ("degraded", "check_workload")
    [t] = xid(1, 79)
    assert (t.current.state, t.current.action) == ("unhealthy", "reboot")
    assert xid(1, 79) == []  # a repeat is no new transition
    assert xid(1, 13) == []
    for _ in range(10):  # the hold of XID 13 runs out; 79 stays
        clock.t += 1
        assert tracker.observe(gpus, {0: _signals(0), 1: _signals(1)}, {}) == []
    health = tracker.snapshot().by_uuid()
    assert health["GPU-1"].xid_counts == {45: 1, 13: 2, 79: 2}
    assert health["GPU-1"].checks["xid"].state == "unhealthy"
    assert health["GPU-0"].state == "healthy" and health["GPU-0"].xid_counts == {}
    [t] = xid(0, 31)
    clock.t += 5
    [t] = tracker.observe(gpus, {0: _signals(0), 1: _signals(1)}, {})
    assert (t.uuid, t.check, t.current.state) == ("GPU-0", "xid", "healthy")
    assert xid(7, 79) == []  # a GPU the tracker does not know


def test_unknown_is_shown_but_only_judgements_are_reported() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    gpus = _gpus(1)
    pending = _signals(0, remapped_rows=RemappedRows(0, 1, True, False))
    unreadable = _signals(0, remapped_rows=None, failed={"remapped_rows": "NVML error"})
    seen = []
    for sig in (_signals(0), pending, unreadable, pending, unreadable, _signals(0)):
        clock.t += 1
        seen += tracker.observe(gpus, {0: sig}, {})
        if sig is unreadable:
            assert tracker.snapshot().gpus[0].checks["remapped_rows"].state == "unknown"
    assert [(t.previous.state if t.previous else None, t.current.state) for t in seen] == [
        ("healthy", "degraded"),
        ("degraded", "healthy"),
    ]


def test_a_gpu_lost_before_it_was_ever_read() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    [t] = [
        t
        for t in tracker.observe(_gpus(1), {0: _signals(0)}, {1: "GPU 1 is lost"}, expected_gpus=2)
        if t.check == "lost"
    ]
    assert (t.uuid, t.index, t.current.state) == ("unknown-gpu-1", 1, "unhealthy")
    assert tracker.snapshot().node_checks["gpu_count"].state == "unhealthy"
    clock.t += 1
    back = tracker.observe(_gpus(2), {0: _signals(0), 1: _signals(1)}, {}, expected_gpus=2)
    assert sorted((t.uuid or "", t.check, t.current.state) for t in back) == [
        ("", "gpu_count", "healthy"),
        ("GPU-1", "lost", "healthy"),  # the same GPU, now with its identity
    ]
    assert [g.uuid for g in tracker.snapshot().gpus] == ["GPU-0", "GPU-1"]


def test_gpu_count_against_expected() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    gpus = _gpus(4)
    sig = {i: _signals(i) for i in range(4)}
    tracker.observe(gpus, sig, {}, expected_gpus=None)
    assert tracker.snapshot().node_checks["gpu_count"].state == "unknown"
    [t] = tracker.observe(gpus, sig, {}, expected_gpus=8, expected_source="EXPECTED_GPU_COUNT")
    assert (t.uuid, t.check, t.current.state) == (None, "gpu_count", "unhealthy")
    assert "4 of 8" in (t.current.reason or "")
    assert tracker.observe(gpus, sig, {}, expected_gpus=4) != []
    assert tracker.snapshot().node_checks["gpu_count"].state == "healthy"
    lost = tracker.observe(gpus, sig, {3: "lost"}, expected_gpus=4)
    assert {(t.check, t.current.state) for t in lost} == {
        ("lost", "unhealthy"),
        ("gpu_count", "unhealthy"),
    }


def test_unsupported_and_unreadable_signals() -> None:
    clock = Clock()
    tracker = _tracker(clock)
    sig = GpuHealthSignals(
        index=0,
        uuid="GPU-0",
        absent={"fabric": "the driver lacks this NVML call", "persistence_mode": "not supported"},
        failed={"remapped_rows": "NVML error: Unknown Error"},
        ecc=EccCounts(0, 0, 0, 0),
        clocks_event_reasons=0,
    )
    tracker.observe(_gpus(1), {0: sig}, {}, xid_unavailable="XID events not available: x")
    checks_ = tracker.snapshot().gpus[0].checks
    assert checks_["fabric"].state == "not_supported"
    assert checks_["fabric"].reason == "the driver lacks this NVML call"
    assert checks_["remapped_rows"].state == "unknown"
    assert checks_["xid"].state == "not_supported"
    assert tracker.snapshot().gpus[0].state == "healthy"
    assert list(checks_) == list(GPU_CHECKS)


signal_values = st.fixed_dictionaries(
    {
        "ecc": st.one_of(
            st.none(),
            st.builds(
                EccCounts,
                *(st.one_of(st.none(), st.integers(0, 2**64 - 1)) for _ in range(4)),
            ),
        ),
        "retired_pages_pending": st.one_of(st.none(), st.booleans()),
        "remapped_rows": st.one_of(
            st.none(),
            st.builds(
                RemappedRows,
                st.integers(0, 2**32),
                st.integers(0, 2**32),
                st.booleans(),
                st.booleans(),
            ),
        ),
        "clocks_event_reasons": st.one_of(st.none(), st.integers(-5, 2**65)),
        "fabric": st.one_of(
            st.none(),
            st.builds(
                FabricInfo,
                st.integers(-1, 5),
                st.integers(-1, 1000),
                st.integers(-1, 2**33),
                st.integers(0, 2**32),
                st.none(),
                st.one_of(st.none(), st.integers(0, 4)),
            ),
        ),
        "persistence_mode": st.one_of(st.none(), st.integers(-1, 3)),
        "lost": st.one_of(st.none(), st.just("GPU is lost")),
    }
)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(signal_values, st.lists(st.integers(0, 200), max_size=2)), max_size=12))
def test_transitions_report_every_judgement_change_once(steps: list) -> None:  # type: ignore[type-arg]
    """Any sequence of readings and XIDs: never a crash; the reported transitions of a check
    chain up (each starts where the last one ended), never repeat, and always end at the
    check's current judgement."""
    clock = Clock()
    tracker = _tracker(clock)
    gpus = _gpus(1)
    last: dict[str, tuple[str, str]] = {}  # what a consumer of the records knows

    def check(got: list) -> None:  # type: ignore[type-arg]
        for t in (t for t in got if t.uuid == "GPU-0"):
            assert t.current.state != "unknown"
            assert t.previous is None or t.previous.key != t.current.key
            assert (t.previous.key if t.previous else None) == last.get(t.check)
            last[t.check] = t.current.key
        for name, status in tracker.snapshot().gpus[0].checks.items():
            assert status.state in CHECK_STATES and status.action in ACTIONS
            if status.state in ("degraded", "unhealthy"):
                assert last.get(name) == status.key
            elif status.state != "unknown":
                # a quiet start (healthy, not supported) is the baseline
                assert last.setdefault(name, status.key) == status.key

    for values, xids in steps:
        clock.t += 1
        check(tracker.observe(gpus, {0: GpuHealthSignals(0, "GPU-0", **values)}, {}))
        for code in xids:
            check(tracker.record_xid(XidEvent(0, "GPU-0", code, clock.wall())))


# ---- the FAULT setting -------------------------------------------------------------------


@given(st.text(max_size=40))
def test_fault_spec_parses_or_says_why(text: str) -> None:
    try:
        fault = parse_fault(text)
    except ValueError as exc:
        message = str(exc)
        fault = None
    if fault is None:
        assert "fault" in message
    else:
        assert fault.kind in (*FAULT_KINDS, "xid")


@given(
    st.one_of(
        st.builds(
            Fault, st.sampled_from(sorted(set(FAULT_KINDS) - LINK_KINDS)), st.integers(0, 999)
        ),
        st.builds(
            Fault,
            st.sampled_from(sorted(LINK_KINDS)),
            st.integers(0, 999),
            delay=st.integers(0, 9999).map(float),
            link=st.integers(0, 99),
        ),
        st.builds(
            Fault,
            st.just("xid"),
            st.integers(0, 999),
            st.integers(0, 999_999),
            st.integers(0, 9999).map(float),
        ),
    )
)
def test_fault_spec_round_trips(fault: Fault) -> None:
    assert parse_fault(str(fault)) == fault


def test_link_faults_name_their_link_and_others_take_none() -> None:
    assert parse_fault("nvlink-down:gpu0:3") == Fault("nvlink-down", 0, link=3)
    assert parse_fault("nvlink-errors:gpu7:17@30s") == Fault(
        "nvlink-errors", 7, delay=30.0, link=17
    )
    assert parse_fault("pcie-down:gpu1") == Fault("pcie-down", 1)
    with pytest.raises(ValueError, match="needs a link"):
        parse_fault("nvlink-down:gpu0")
    with pytest.raises(ValueError, match="takes no link"):
        parse_fault("pcie-down:gpu1:3")
    with pytest.raises(ValueError, match="bad fault"):
        parse_fault("nvlink-down:gpu0:-1")


def test_fault_specs() -> None:
    assert parse_faults(["xid79:gpu2", "lost:gpu3@2m", "THERMAL:GPU1"]) == [
        Fault("xid", 2, 79),
        Fault("lost", 3, delay=120.0),
        Fault("thermal", 1),
    ]
    with pytest.raises(ValueError, match=r"entry 1: unknown fault kind.*entry 2: bad fault"):
        parse_faults(["melt:gpu1", "gpu2"])


def test_health_records_have_the_reading_envelope_and_a_stable_id() -> None:
    from gpuid_agent.facts import PlatformInfo
    from gpuid_agent.records.health import health_records
    from gpuid_agent.records.serialize import to_wire
    from gpuid_agent.state.inventory import build_inventory

    clock = Clock()
    tracker = _tracker(clock)
    platform = PlatformInfo("CHASSIS1", 1, 2, 3, 0, 1)
    gpus = [GpuIdentity(index=0, uuid="GPU-0", serial="S0", platform=platform)]
    inventory = build_inventory(
        gpus,
        node="n",
        cluster="c",
        machine="m",
        machine_source="dmi",
        driver_version="570",
        cuda_driver_version=None,
        read_time=clock.wall(),
    )
    tracker.observe(gpus, {0: _signals(0)}, {})
    clock.t += 1
    transitions = tracker.observe(gpus, {0: _signals(0, persistence_mode=0)}, {}, expected_gpus=2)
    first = [to_wire(r) for r in health_records(transitions, inventory, source="ns/pod")]
    again = [to_wire(r) for r in health_records(transitions, inventory, source="ns/pod")]
    assert first == again and len({r["record_id"] for r in first}) == 2
    gpu = next(r for r in first if r["check"] == "persistence")
    node = next(r for r in first if r["check"] == "gpu_count")
    assert {k: gpu[k] for k in ("schema_version", "kind", "cluster", "node", "machine")} == {
        "schema_version": 1,
        "kind": "health",
        "cluster": "c",
        "node": "n",
        "machine": "m",
    }
    assert (gpu["gpu"], gpu["chassis"], gpu["uuid"], gpu["source"]) == (
        "S0",
        "CHASSIS1",
        "GPU-0",
        "ns/pod",
    )
    assert (gpu["state"], gpu["previous_state"], gpu["action"]) == ("degraded", "healthy", "none")
    assert gpu["read_time"] == gpu["since"] == "2025-01-01T00:00:01.000Z"
    assert (node["uuid"], node["gpu"], node["chassis"], node["previous_state"]) == (
        None,
        "",
        "",
        None,
    )
