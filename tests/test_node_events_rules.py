"""Node Events without an API server: what each transition says (reason, type, action, note),
the note's bounds under hostile input, the write budget and the series on a fake clock, Event
names, the clears the tracker marks, and the reasons table of docs/health.md."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.node.events.ledger import Decision, EventLedger, TokenBucket
from gpuid_agent.node.events.notes import (
    NOTE_LIMIT,
    REASONS,
    EventText,
    transition_event,
)
from gpuid_agent.node.events.objects import NodeRef, event_name, event_object
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.state.attribution.holders import Holder
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import CheckStatus, Transition

HEALTH_DOC = Path(__file__).resolve().parent.parent / "docs" / "health.md"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def status(state: str, reason: str | None = None, action: str = "none") -> CheckStatus:
    return CheckStatus(state, reason, action, T0)  # type: ignore[arg-type]


def xid(
    now: CheckStatus, was: CheckStatus | None, holders: tuple[Holder, ...] = (), **more: object
) -> Transition:
    return Transition("xid", now, was, "GPU-5c3a", 2, now.state, holders, **more)  # type: ignore[arg-type]


def text(note: str, at: datetime = T0) -> EventText:
    return EventText("GpuUnhealthy", note, at)


POD = Holder("team-a", "train-0", "main")

# ---- what each transition says -----------------------------------------------------------


def test_each_kind_of_transition_has_its_reason_type_and_action() -> None:
    bad = status("unhealthy", "XID 79: GPU has fallen off the bus", "reboot")
    cases = {
        "GpuUnhealthy": xid(bad, status("healthy")),
        "GpuDegraded": xid(status("degraded", "XID 13: graphics", "check_workload"), None),
        "GpuRecovered": xid(status("healthy"), status("degraded", "XID 13 (recent)")),
        "GpuLatchedCleared": xid(status("healthy"), bad, cleared_by="operator"),
        "NodeGpusUnhealthy": Transition("gpu_count", status("unhealthy", "3 of 4", "reboot"), None),
        "NodeGpusDegraded": Transition("nvswitch", status("degraded", "SXID 1"), None),
        "NodeGpusRecovered": Transition("gpu_count", status("healthy"), status("unhealthy", "x")),
    }
    for reason, transition in cases.items():
        said = transition_event(transition, "1652423010002")
        assert said is not None and said.reason == reason, reason
        assert (said.type, said.action) == (REASONS[reason].type, REASONS[reason].action)
    assert {r.type for n, r in REASONS.items() if "Recovered" in n or "Cleared" in n} == {"Normal"}
    # a check that starts out not supported, or leaves unknown for healthy, is no news
    assert transition_event(xid(status("not_supported"), None), None) is None
    assert transition_event(xid(status("healthy"), status("not_supported")), None) is None


def test_the_note_names_the_gpu_check_state_action_reason_and_pods() -> None:
    bad = status("unhealthy", "XID 79: GPU has fallen off the bus", "reboot")
    holders = (POD, Holder("team-a", "train-0", "sidecar"), Holder("team-b", "eval-1", "main"))
    said = transition_event(xid(bad, status("healthy"), holders), "1652423010002")
    assert said is not None
    assert said.note == (
        "GPU 2 (serial 1652423010002, GPU-5c3a): xid unhealthy, action reboot: XID 79: GPU has "
        "fallen off the bus (was healthy). Pods hit: team-a/train-0, team-b/eval-1"
    )
    cleared = transition_event(xid(status("healthy"), bad, cleared_by="reset"), None)
    assert cleared is not None
    assert cleared.note == (
        "GPU 2 (no serial, GPU-5c3a): xid healthy, XIDs cleared by a GPU reset "
        "(was unhealthy: XID 79: GPU has fallen off the bus)"
    )
    node = transition_event(
        Transition("gpu_count", status("unhealthy", "3 of 4 expected GPUs usable", "reboot"), None),
        None,
    )
    assert node is not None and node.note.startswith("node: gpu_count unhealthy, action reboot")


def test_many_pods_are_listed_as_far_as_they_fit_and_the_rest_counted() -> None:
    holders = tuple(Holder("ns", f"pod-{i:03}-" + "x" * 40, "c") for i in range(100))
    said = transition_event(xid(status("degraded", "XID 13", "check_workload"), None, holders), "S")
    assert said is not None
    size = len(said.note.encode())
    assert NOTE_LIMIT - 60 < size <= NOTE_LIMIT
    shown = said.note.count("ns/pod-")
    assert said.note.endswith(f" and {100 - shown} more")


hostile = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF)),
    st.text(alphabet="\x00\n\r\t\u2028\u200b\ud800é☃/ ", max_size=50),
    st.sampled_from(["", "a" * 5000, "💥" * 2000, "\udcff\udc80"]),
)


@settings(max_examples=300, deadline=None)
@given(
    reason=hostile,
    serial=st.one_of(st.none(), hostile),
    uuid=hostile,
    pods=st.lists(st.tuples(hostile, hostile), max_size=40),
    state=st.sampled_from(["unhealthy", "degraded", "healthy"]),
)
def test_any_input_makes_a_valid_note_within_the_limit(
    reason: str, serial: str | None, uuid: str, pods: list[tuple[str, str]], state: str
) -> None:
    holders = tuple(Holder(ns, pod, "c") for ns, pod in pods)
    was = status("degraded", reason) if state == "healthy" else None
    transition = Transition("xid", status(state, reason, "reset"), was, uuid, 0, None, holders)  # type: ignore[arg-type]
    said = transition_event(transition, serial)
    assert said is not None
    encoded = said.note.encode("utf-8")  # no lone surrogate: the API server takes it as UTF-8
    assert 0 < len(encoded) <= NOTE_LIMIT
    assert said.note.isprintable()
    assert said.note.startswith("GPU 0 (") and f"xid {state}" in said.note
    # the event object a note goes into is JSON the API server reads back the same
    body = event_object(said, event_name("n"), NodeRef("n", "uid"))
    assert body["note"] == said.note and body["reason"] in REASONS


@settings(max_examples=300, deadline=None)
@given(node=hostile)
def test_event_names_are_unique_dns_subdomains_for_any_node_name(node: str) -> None:
    names = {event_name(node) for _ in range(3)}
    assert len(names) == 3
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    for name in names:
        assert len(name) <= 253 and re.fullmatch(rf"{label}(\.{label})*", name), name


def test_a_long_node_name_keeps_its_start_and_the_reporting_instance_is_bounded() -> None:
    node = "gpu-" + "a" * 250
    name = event_name(node)
    assert name.startswith("gpu-aaa") and len(name) <= 253
    body = event_object(text("x"), name, NodeRef(node, "u-1"))
    assert len(body["reportingInstance"]) == 128
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": node, "uid": "u-1"}
    assert body["eventTime"] == "2026-03-01T12:00:00.000000Z"


# ---- the budget and the series, on a fake clock ------------------------------------------


def test_the_bucket_gives_a_burst_then_one_token_per_refill() -> None:
    clock = FakeClock()
    bucket = TokenBucket(25, 10.0, clock())
    assert sum(bucket.take(clock()) for _ in range(40)) == 25
    assert bucket.wait(clock()) == 10.0
    clock.advance(9.9)
    assert not bucket.take(clock())
    clock.advance(0.1)
    assert bucket.take(clock()) and not bucket.take(clock())
    clock.advance(3600)  # a long quiet spell refills no more than the burst
    assert sum(bucket.take(clock()) for _ in range(40)) == 25


def test_a_repeat_within_the_window_joins_the_series_and_a_later_one_is_new() -> None:
    clock = FakeClock()
    ledger = EventLedger(series_window=600, patch_every=10, clock=clock)
    first = text("GPU 2: xid unhealthy")
    assert ledger.decide(first) is Decision.CREATE
    series = ledger.created(first, "node-a.1")
    clock.advance(599)
    assert (
        ledger.decide(text("GPU 2: xid unhealthy", T0 + timedelta(minutes=10))) is Decision.REPEAT
    )
    assert (series.count, series.written) == (2, 1)
    assert series.last_observed == T0 + timedelta(minutes=10)
    assert ledger.decide(text("GPU 3: xid unhealthy")) is Decision.CREATE  # another note: new
    clock.advance(601)  # past the window since the last repeat
    assert ledger.decide(first) is Decision.CREATE


def test_repeats_are_coalesced_into_one_patch_per_interval() -> None:
    clock = FakeClock()
    ledger = EventLedger(patch_every=10, clock=clock)
    event = text("GPU 2: xid degraded")
    ledger.decide(event)
    series = ledger.created(event, "node-a.1")
    for _ in range(40):
        clock.advance(0.125)
        assert ledger.decide(event) is Decision.REPEAT
    assert ledger.due() == []  # 5 s after the create: not yet
    assert ledger.next_due_in() == 5.0
    clock.advance(5)
    assert ledger.due() == [series] and series.count == 41
    assert ledger.take()
    ledger.patched(series, series.count)
    assert ledger.due() == [] and ledger.next_due_in() is None
    ledger.decide(event)
    clock.advance(9.9)
    assert ledger.due() == []
    clock.advance(0.1)
    assert ledger.due() == [series] and series.count == 42


def test_a_series_patch_waits_for_a_token_and_is_never_dropped() -> None:
    clock = FakeClock()
    ledger = EventLedger(burst=2, refill_every=10, patch_every=1, clock=clock)
    events = [text(f"GPU {i}") for i in range(3)]
    assert [ledger.decide(e) for e in events] == [Decision.CREATE, Decision.CREATE, Decision.DROP]
    one = ledger.created(events[0], "n.1")
    ledger.created(events[1], "n.2")
    ledger.decide(events[0])  # a repeat: owed
    clock.advance(1)
    assert ledger.due() == [one] and not ledger.take()
    assert ledger.next_due_in() == 9.0  # the next token, not the patch interval
    clock.advance(9)
    assert ledger.take()
    ledger.patched(one, one.count)
    assert one.written == 2


def test_a_storm_of_1000_occurrences_writes_within_the_budget() -> None:
    clock = FakeClock()
    ledger = EventLedger(clock=clock)  # the defaults: burst 25, a token per 10 s
    counts = {d: 0 for d in Decision}
    writes = 0
    for i in range(1000):  # 1,000 XIDs over 100 s, 40 distinct Events among them
        clock.advance(0.1)
        event = text(f"GPU {i % 8}: XID {1000 + i % 40}")
        decision = ledger.decide(event)
        counts[decision] += 1
        if decision is Decision.CREATE:
            ledger.created(event, f"n.{i}")
            writes += 1
        for series in ledger.due():
            if ledger.take():
                ledger.patched(series, series.count)
                writes += 1
    assert writes <= 25 + 100 / 10
    assert counts[Decision.CREATE] == len(ledger) >= 25
    assert sum(counts.values()) == 1000
    assert counts[Decision.DROP] == 1000 - counts[Decision.CREATE] - counts[Decision.REPEAT] > 0


def test_an_owed_series_past_its_window_is_kept_until_written() -> None:
    clock = FakeClock()
    ledger = EventLedger(burst=3, refill_every=1000, series_window=60, patch_every=1, clock=clock)
    event = text("GPU 1")
    ledger.decide(event)
    old = ledger.created(event, "n.old")
    ledger.decide(event)
    ledger.take(), ledger.take()  # the budget spent elsewhere: the repeat waits
    clock.advance(61)
    assert ledger.decide(event) is Decision.DROP  # a new Event would be due, over budget
    assert ledger.due() == [old]  # the old series still owes its repeat
    clock.advance(1000)
    assert ledger.decide(event) is Decision.CREATE
    new = ledger.created(event, "n.new")
    assert {s.name for s in ledger.due()} == {"n.old"} and new.count == 1


# ---- the clears the tracker marks --------------------------------------------------------


def test_the_tracker_marks_a_clear_by_an_operator_and_by_a_reset() -> None:
    gpus = [GpuIdentity(index=0, uuid="GPU-0"), GpuIdentity(index=1, uuid="GPU-1")]
    tracker = HealthTracker()
    healthy = {g.index: GpuHealthSignals(g.index, g.uuid) for g in gpus}
    tracker.observe(gpus, healthy, {})
    for gpu in gpus:
        [raised] = tracker.record_xid(XidEvent(gpu.index, gpu.uuid, 79, T0))
        assert raised.cleared_by is None
    [cleared] = tracker.clear("0")
    assert (cleared.check, cleared.current.state, cleared.cleared_by) == (
        "xid",
        "healthy",
        "operator",
    )
    tracker.observe(gpus, {0: healthy[0]}, {1: "GPU is lost"})
    by_check = {t.check: t for t in tracker.observe(gpus, healthy, {}) if t.uuid == "GPU-1"}
    assert by_check["xid"].cleared_by == "reset"  # it answers again: a reset
    assert transition_event(by_check["xid"], None).reason == "GpuLatchedCleared"  # type: ignore[union-attr]
    assert transition_event(by_check["lost"], None).reason == "GpuRecovered"  # type: ignore[union-attr]


def test_a_reboot_that_cleared_latched_xids_is_told_once_with_the_first_look() -> None:
    gpus = [GpuIdentity(index=0, uuid="GPU-0")]
    healthy = {0: GpuHealthSignals(0, "GPU-0")}
    before = HealthTracker(boot_id="boot-1")
    before.observe(gpus, healthy, {})
    before.record_xid(XidEvent(0, "GPU-0", 79, T0))  # latched
    saved = before.as_state()
    for boot, told in (("boot-2", "reboot"), ("boot-1", None)):
        after = HealthTracker(boot_id=boot)
        after.restore(saved["gpus"])
        by_check = {t.check: t for t in after.observe(gpus, healthy, {})}
        assert by_check["xid"].cleared_by == told, boot
        assert all(t.cleared_by is None for t in after.observe(gpus, healthy, {}))
    after = HealthTracker(boot_id="boot-2")
    after.restore(saved["gpus"])
    event = transition_event(
        next(t for t in after.observe(gpus, healthy, {}) if t.check == "xid"), None
    )
    assert event is not None and event.reason == "GpuLatchedCleared"
    assert "XIDs cleared by a node reboot" in event.note


# ---- docs --------------------------------------------------------------------------------


def test_docs_list_every_reason_with_its_type_and_action() -> None:
    section = HEALTH_DOC.read_text().split("## Kubernetes Events", 1)[1].split("\n## ", 1)[0]
    after = section.split("| reason | type | action | when |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in after.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip().strip("`") for c in row.strip("|").split("|")]
        table[cells[0]] = (cells[1], cells[2])
    assert table == {name: (r.type, r.action) for name, r in REASONS.items()}
