"""When the next /gpu/metrics scrape is due: learned from each scraper's own cadence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.serving.scrape_cadence import MISSED, SCRAPERS, Due, ScrapeCadence


def cadence(*scrapes: tuple[str, float]) -> ScrapeCadence:
    learned = ScrapeCadence()
    for scraper, at in scrapes:
        learned.scraped(scraper, "text", at)
    return learned


def test_two_gaps_alike_make_a_period() -> None:
    assert cadence(("p", 0.0), ("p", 30.0)).next_due(31.0) is None  # one gap: no period yet
    steady = cadence(("p", 0.0), ("p", 30.0), ("p", 60.0))
    assert steady.next_due(61.0) == Due(90.0, "text")
    assert steady.next_due(60.0) == Due(90.0, "text")
    assert cadence(("p", 0.0), ("p", 30.0), ("p", 60.4)).next_due(61.0) == Due(90.8, "text")


def test_an_irregular_scraper_has_no_period_until_two_gaps_agree() -> None:
    learned = cadence(("p", 0.0), ("p", 30.0), ("p", 45.0))  # 30 s, then 15 s
    assert learned.next_due(46.0) is None
    learned.scraped("p", "text", 60.0)  # 15 s again
    assert learned.next_due(61.0) == Due(75.0, "text")
    learned.scraped("p", "text", 100.0)  # 40 s: the period is gone again
    assert learned.next_due(101.0) is None


def test_a_burst_leaves_the_cadence_as_it_was() -> None:
    learned = cadence(("p", 0.0), ("p", 30.0), ("p", 30.2), ("p", 30.9), ("p", 60.0))
    assert learned.next_due(61.0) == Due(90.0, "text")


def test_a_missed_scrape_is_waited_for_once_more_then_the_scraper_is_not_expected() -> None:
    learned = cadence(("p", 0.0), ("p", 30.0), ("p", 60.0))
    assert learned.next_due(95.0) == Due(120.0, "text")  # 90 s came and went
    assert MISSED == 2
    assert learned.next_due(121.0) is None


def test_the_first_of_several_scrapers_is_due_with_its_format() -> None:
    learned = ScrapeCadence()
    for at in (0.0, 30.0, 60.0):  # an HA pair, 10 s apart
        learned.scraped("prometheus-1", "text", at)
        learned.scraped("prometheus-0", "openmetrics", at + 10.0)
    assert learned.next_due(71.0) == Due(90.0, "text")
    assert learned.next_due(91.0) == Due(100.0, "openmetrics")


def test_only_the_scrapers_heard_from_last_are_followed() -> None:
    learned = ScrapeCadence()
    for at in (0.0, 30.0, 60.0):
        learned.scraped("first", "text", at)
    for n in range(SCRAPERS):  # each once: no period, but each pushes the oldest out
        learned.scraped(f"other-{n}", "text", 61.0)
    assert learned.next_due(62.0) is None


scrapes = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"] + [f"s{n}" for n in range(SCRAPERS + 2)]),
        st.sampled_from(["text", "openmetrics"]),
        st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    ),
    max_size=60,
)


@given(scrapes, st.floats(min_value=0.0, max_value=1e6, allow_nan=False))
def test_a_due_scrape_is_always_ahead_and_within_the_missed_periods(
    steps: list[tuple[str, str, float]], wait: float
) -> None:
    learned = ScrapeCadence()
    now = 0.0
    periods: dict[str, float] = {}
    last: dict[str, float] = {}
    for scraper, fmt, step in steps:
        now += step  # loop time only moves forward
        learned.scraped(scraper, fmt, now)  # type: ignore[arg-type]
        if scraper in last and now - last[scraper] >= 1.0:
            periods[scraper] = max(periods.get(scraper, 0.0), now - last[scraper])
        if scraper not in last or now - last[scraper] >= 1.0:
            last[scraper] = now
    later = now + wait
    due = learned.next_due(later)
    assert len(learned._scrapers) <= SCRAPERS
    if due is not None:
        assert due.at > later
        assert due.format in ("text", "openmetrics")
        assert due.at <= later + (MISSED + 1) * max(periods.values())
