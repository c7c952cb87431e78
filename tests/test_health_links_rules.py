"""The PCIe and NVLink rules on their own: what each reading means over time."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity, NvLink, PcieLink
from gpuid_agent.node.conditions import desired_conditions
from gpuid_agent.sources.nvml.signals import GpuHealthSignals
from gpuid_agent.state.health.links import NvLinkWatch, PcieWatch
from gpuid_agent.state.health.tracker import HealthTracker

FULL = PcieLink(gen=5, max_gen=5, width=16, max_width=16, gpu_max_gen=5)
ZEROS = (0, 0, 0, 0)


def _links(n: int = 4, down: frozenset[int] = frozenset(), crc: dict[int, int] | None = None):
    crc = crc or {}
    return tuple(NvLink(i, i not in down, (0, 0, crc.get(i, 0), 0)) for i in range(n))


def test_a_narrow_link_is_degraded_at_once_busy_or_idle() -> None:
    watch = PcieWatch(60.0, replay_threshold=40)
    verdict = watch.verdict(FULL._replace(width=8), 0, 0.0, now=0.0)
    assert (verdict.state, verdict.action) == ("degraded", "hardware_inspection")
    assert verdict.reason == "PCIe link trained to x8 of x16"
    assert watch.verdict(FULL, 0, 0.0, now=1.0).state == "healthy"


def test_a_lower_generation_counts_only_while_busy_and_holds_until_a_busy_full_read() -> None:
    watch = PcieWatch(60.0, replay_threshold=40)
    idle_gen1 = FULL._replace(gen=1)
    assert watch.verdict(idle_gen1, 0, 0.0, now=0.0).state == "healthy"  # power saving
    assert watch.verdict(idle_gen1, 0, None, now=1.0).state == "healthy"  # no utilization
    for at in (2.0, 3.0):  # not yet: a link still climbing reads low for a moment
        assert watch.verdict(FULL._replace(gen=3), 0, 95.0, now=at).state == "healthy"
    busy = watch.verdict(FULL._replace(gen=3), 0, 95.0, now=4.0)
    assert (busy.state, busy.reason) == (
        "degraded",
        "PCIe link at Gen3 of Gen5 in 3 busy readings in a row",
    )
    # idle again: the link drops further to save power, the busy finding stands
    assert watch.verdict(idle_gen1, 0, 2.0, now=5.0).state == "degraded"
    assert watch.verdict(FULL, 0, 50.0, now=6.0).state == "healthy"


def test_a_link_that_rises_a_moment_after_the_load_is_never_downtrained() -> None:
    """Utilization and link are read at different instants: the load shows before the link
    has climbed, busy after busy, for as long as a GPU goes idle and busy again."""
    watch = PcieWatch(60.0, replay_threshold=40)
    at = 0.0
    for _ in range(50):
        for gen, util in ((1, 0.0), (1, 0.0), (1, 97.0), (2, 97.0), (5, 97.0), (5, 99.0)):
            at += 1.0
            assert watch.verdict(FULL._replace(gen=gen), 0, util, now=at).state == "healthy"


def test_replays_growing_past_the_threshold_degrade_and_clear_after_the_window() -> None:
    watch = PcieWatch(10.0, replay_threshold=40)
    assert watch.verdict(FULL, 100, 50.0, now=0.0).state == "healthy"
    assert watch.verdict(FULL, 139, 50.0, now=1.0).state == "healthy"  # 39 < 40
    grown = watch.verdict(FULL, 140, 50.0, now=2.0)
    assert (grown.state, grown.reason) == ("degraded", "40 PCIe replays in the last 10s")
    assert watch.verdict(FULL, 140, 50.0, now=13.0).state == "healthy"
    off = PcieWatch(10.0, replay_threshold=0)
    off.verdict(FULL, 0, 50.0, now=0.0)
    assert off.verdict(FULL, 10**6, 50.0, now=1.0).state == "healthy"  # 0: never


def test_a_link_with_no_maximum_is_unknown_and_width_zero_is_down() -> None:
    watch = PcieWatch(10.0, replay_threshold=40)
    assert watch.verdict(FULL._replace(max_width=0), None, 50.0, 0.0).state == "unknown"
    down = watch.verdict(FULL._replace(width=0), None, 50.0, 1.0)
    assert (down.state, down.action) == ("unhealthy", "reboot")


def test_an_nvlink_that_was_up_and_went_down_names_the_link() -> None:
    watch = NvLinkWatch(60.0)
    assert watch.verdict(_links(), 0.0).state == "healthy"
    down = watch.verdict(_links(down=frozenset({3})), 1.0)
    assert (down.state, down.action, down.reason) == ("unhealthy", "reboot", "NVLink 3 down")
    two = watch.verdict(_links(down=frozenset({1, 3})), 2.0)
    assert two.reason == "NVLinks 1, 3 down"
    assert watch.verdict(_links(), 3.0).state == "healthy"


def test_links_never_seen_up_are_not_news_unless_their_siblings_are_up() -> None:
    watch = NvLinkWatch(60.0)
    unused = _links(down=frozenset({0, 1, 2, 3}))  # a bridge that is not fitted
    assert watch.verdict(unused, 0.0).state == "healthy"
    assert watch.verdict(unused, 1.0).state == "healthy"
    started_down = NvLinkWatch(60.0).verdict(_links(down=frozenset({2})), 0.0)
    assert (started_down.state, started_down.action) == ("degraded", "hardware_inspection")
    assert started_down.reason == "NVLink 2 inactive while 3 other links are up"


def test_growing_nvlink_errors_degrade_naming_link_and_counter() -> None:
    watch = NvLinkWatch(10.0)
    watch.verdict(_links(), 0.0)
    grown = watch.verdict(_links(crc={2: 7}), 1.0)
    assert grown.state == "degraded" and grown.action == "none"
    assert grown.reason == "NVLink errors growing in the last 10s: link 2: 7 crc flit"
    recovery = tuple(NvLink(i, True, (0, 3 if i == 1 else 0, 0, 0)) for i in range(4))
    assert watch.verdict(recovery, 2.0).action == "hardware_inspection"
    assert watch.verdict(recovery, 20.0).state == "healthy"  # the window moved on
    # a counter that went down was reset (driver reload): not growth
    assert watch.verdict(_links(crc={2: 0}), 21.0).state == "healthy"


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=4, max_size=4),
        ),
        max_size=18,
    ),
    st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4),
)
def test_link_rules_survive_any_values_nvml_can_return(
    raw: list[tuple[bool, list[int | None]]], pcie: list[int]
) -> None:
    links = tuple(NvLink(i, active, tuple(errs)) for i, (active, errs) in enumerate(raw))
    nv = NvLinkWatch(5.0)
    assert nv.verdict(links, 0.0).state in ("healthy", "degraded", "unhealthy")
    watch = PcieWatch(5.0, 40)
    gen, max_gen, width, max_width = pcie
    verdict = watch.verdict(PcieLink(gen, max_gen, width, max_width), gen, float(width % 101), 0.0)
    assert verdict.state in ("healthy", "degraded", "unhealthy", "unknown")


def test_an_nvlink_down_raises_its_node_condition_naming_the_link() -> None:
    now = [0.0]
    tracker = HealthTracker(clock=lambda: now[0], wall=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    gpu = GpuIdentity(index=0, uuid="GPU-0")

    def observe(links: tuple[NvLink, ...], pcie: PcieLink) -> None:
        now[0] += 1.0
        sig = GpuHealthSignals(index=0, uuid="GPU-0", nvlinks=links, pcie=pcie, utilization=50.0)
        tracker.observe([gpu], {0: sig}, {})

    observe(_links(), FULL)
    assert desired_conditions(tracker.snapshot())["GpuNvlinkDown"].status == "False"
    observe(_links(down=frozenset({3})), FULL._replace(width=8))
    wanted = desired_conditions(tracker.snapshot())
    assert wanted["GpuNvlinkDown"].status == "True"
    assert wanted["GpuNvlinkDown"].message == "GPU 0 (GPU-0): NVLink 3 down"
    assert wanted["GpuPcieLinkDown"].status == "False"  # x8 is degraded: no condition


class _RemembersNothing(dict[int, tuple[int | None, ...]]):
    """A quiet-link memory that keeps nothing: every reading goes through the windows."""

    def __setitem__(self, key: int, value: tuple[int | None, ...]) -> None:
        return None


_COUNTER = st.one_of(st.none(), st.integers(0, 6))


@given(
    st.lists(
        st.tuples(
            st.floats(0.5, 8.0),
            st.lists(st.tuples(_COUNTER, _COUNTER, _COUNTER, _COUNTER), min_size=3, max_size=3),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_a_quiet_link_passed_over_judges_as_if_every_reading_was_added(
    readings: list[tuple[float, list[tuple[int | None, ...]]]],
) -> None:
    """Repeated equal readings of links without error growth are skipped; the verdicts (and
    the counts in their reasons) match a watch that adds every reading, through growth,
    resets (a counter going down) and windows moving on."""
    skipping, adding = NvLinkWatch(10.0), NvLinkWatch(10.0)
    adding._quiet = _RemembersNothing()
    now = 0.0
    for step, errors in readings:
        # equal readings are the common case: repeat each one a few times
        for _ in range(3):
            now += step
            links = tuple(NvLink(i, True, errs) for i, errs in enumerate(errors))
            assert skipping.verdict(links, now) == adding.verdict(links, now)
