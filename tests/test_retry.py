"""The one retry policy (runtime.retry): the Retry-After parser against hostile headers, and
the full-jitter backoff's bounds."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.runtime.retry import (
    RETRY_AFTER_CAP,
    Backoff,
    backoff_delay,
    parse_retry_after,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
_PADDING = st.sampled_from(["", " ", "\t", "  \t "])
_NON_ASCII_DIGITS = st.text(
    alphabet=st.characters(categories=["Nd", "No"], min_codepoint=0x80), min_size=1, max_size=8
)
_HTTP_DATES = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
)


# ---- parse_retry_after --------------------------------------------------------------------


@given(
    st.one_of(
        st.none(),
        st.text(max_size=80),
        st.integers().map(str),
        st.floats().map(str),
        st.floats().map(repr),
        st.decimals().map(str),
        st.sampled_from(["inf", "-inf", "+inf", "nan", "NaN", "Infinity", "1e999", "0x1f"]),
        _NON_ASCII_DIGITS,
        st.from_regex(r"\s*\d{1,5000}\s*", fullmatch=True),
        _HTTP_DATES.map(lambda d: format_datetime(d, usegmt=True)),
    )
)
def test_any_header_gives_none_or_a_bounded_pause(value: str | None) -> None:
    seconds = parse_retry_after(value, NOW)
    assert seconds is None or (isinstance(seconds, float) and 0.0 <= seconds <= RETRY_AFTER_CAP)


@given(st.integers(min_value=0, max_value=10**40), st.integers(0, 6), _PADDING, _PADDING)
def test_digits_only_are_that_many_seconds_capped(
    n: int, zeros: int, left: str, right: str
) -> None:
    header = f"{left}{'0' * zeros}{n}{right}"
    assert parse_retry_after(header) == min(float(n), RETRY_AFTER_CAP)


@given(
    st.one_of(
        st.integers().map(lambda n: f"{'+' if n >= 0 else ''}{n}"),  # every one carries a sign
        st.floats(allow_nan=True, allow_infinity=True).map(lambda f: f"{f:+}"),
        st.floats(min_value=0, allow_infinity=False).map(repr),  # always has "." or "e"
        st.from_regex(r"[+-]?\d*\.\d*([eE][+-]?\d+)?", fullmatch=True),
        st.sampled_from(["inf", "nan", "Infinity", "1e3", "1E3", ".5", "5.", "-0", "+0"]),
    ),
    _PADDING,
)
def test_signs_decimals_and_float_forms_are_refused(number: str, pad: str) -> None:
    assert parse_retry_after(pad + number + pad) is None


@given(_NON_ASCII_DIGITS)
def test_non_ascii_digits_are_refused(value: str) -> None:
    assert parse_retry_after(value) is None


@given(st.integers(min_value=0, max_value=10**7))
def test_a_future_http_date_is_the_seconds_until_it_capped(ahead: int) -> None:
    header = format_datetime(NOW + timedelta(seconds=ahead), usegmt=True)
    assert parse_retry_after(header, NOW) == min(float(ahead), RETRY_AFTER_CAP)


@given(st.integers(min_value=0, max_value=10**10))
def test_a_past_http_date_means_now(behind: int) -> None:
    header = format_datetime(NOW - timedelta(seconds=behind), usegmt=True)
    assert parse_retry_after(header, NOW) == 0.0


@given(st.integers(min_value=-1000, max_value=1000))
def test_a_date_without_a_zone_is_read_as_utc(offset: int) -> None:
    naive = (NOW + timedelta(seconds=offset)).replace(tzinfo=None)
    header = format_datetime(naive)  # "-0000": no zone information
    assert header.endswith("-0000")
    assert parse_retry_after(header, NOW) == min(max(float(offset), 0.0), RETRY_AFTER_CAP)


@pytest.mark.parametrize(
    "header",
    ["", "   ", "soon", "Mon, 99 Foo 2026 25:61:61 GMT", "Fri, 31 Dec 10000 23:59:59 GMT"],
)
def test_unreadable_headers_are_none(header: str) -> None:
    assert parse_retry_after(header, NOW) is None


def test_absent_header_is_none() -> None:
    assert parse_retry_after(None) is None


# ---- Backoff and backoff_delay ------------------------------------------------------------

_BASES = st.floats(min_value=1e-6, max_value=1e6)
_CAPS = st.floats(min_value=1e-6, max_value=1e7)


@given(_BASES, _CAPS, st.integers(0, 80), st.integers(0, 2**32))
def test_delays_stay_between_zero_and_the_ceiling(
    base: float, cap: float, count: int, seed: int
) -> None:
    backoff = Backoff(base, cap, random.Random(seed))
    for n in range(count):
        ceiling = min(cap, base * 2.0**n)
        assert backoff.ceiling() == ceiling
        assert 0.0 <= backoff.next() <= ceiling


@given(_BASES, _CAPS, st.integers(1, 80))
def test_the_ceiling_doubles_then_holds_at_the_cap(base: float, cap: float, count: int) -> None:
    backoff = Backoff(base, cap)
    ceilings = []
    for _ in range(count):
        ceilings.append(backoff.ceiling())
        backoff.next()
    assert ceilings[0] == min(base, cap)
    for before, after in pairwise(ceilings):
        assert after == min(cap, before * 2)
    assert max(ceilings) <= cap


@given(_BASES, _CAPS, st.integers(1, 50))
def test_reset_starts_over(base: float, cap: float, failures: int) -> None:
    backoff = Backoff(base, cap)
    for _ in range(failures):
        backoff.next()
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.ceiling() == min(base, cap)
    assert backoff.next() <= min(base, cap)


@given(
    _BASES,
    _CAPS,
    st.integers(0, 20),
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_a_floor_is_honoured_but_capped(
    base: float, cap: float, failures: int, floor: float | None
) -> None:
    backoff = Backoff(base, cap)
    for _ in range(failures):
        backoff.next()
    ceiling = backoff.ceiling()
    delay = backoff.next(floor=floor)
    assert not math.isnan(delay)
    assert 0.0 <= delay <= max(ceiling, RETRY_AFTER_CAP if floor is not None else 0.0)
    if floor is not None and floor > 0:
        assert delay >= min(floor, RETRY_AFTER_CAP)
    assert backoff.failures == failures + 1  # a floored pause still counts as a failure


@given(_BASES, _CAPS, st.integers(min_value=63, max_value=10**30))
def test_huge_attempt_counts_do_not_overflow(base: float, cap: float, attempts: int) -> None:
    backoff = Backoff(base, cap)
    backoff.failures = attempts
    assert backoff.ceiling() == min(cap, base * 2.0**62)
    assert 0.0 <= backoff.next() <= cap
    assert 0.0 <= backoff_delay(attempts, base, cap) <= cap


@given(_BASES, _CAPS, st.integers(min_value=-(10**30), max_value=200), st.integers(0, 2**32))
def test_backoff_delay_is_within_the_same_ceiling(
    base: float, cap: float, attempt: int, seed: int
) -> None:
    ceiling = min(cap, base * 2.0 ** min(max(attempt, 0), 62))
    assert 0.0 <= backoff_delay(attempt, base, cap, random.Random(seed)) <= ceiling


def test_delays_are_jittered() -> None:
    rand = random.Random(7)
    backoff = Backoff(1.0, 1.0, rand)
    assert len({backoff.next() for _ in range(20)}) == 20
    assert len({backoff_delay(3, 1.0, 60.0, rand) for _ in range(20)}) == 20


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 5.0)])
def test_backoff_needs_positive_base_and_cap(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Backoff(base, cap)


def test_full_jitter_draws_below_half_the_ceiling() -> None:
    # full jitter, not equal jitter: a fleet's retries spread over the whole range
    rand = random.Random(0)
    draws = [backoff_delay(0, 2.0, 2.0, rand) for _ in range(200)]
    assert min(draws) < 1.0 < max(draws)


@given(
    _BASES,
    _CAPS,
    st.integers(0, 80),
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    st.integers(0, 2**32),
)
def test_backoff_and_backoff_delay_are_one_formula(
    base: float, cap: float, failures: int, floor: float | None, seed: int
) -> None:
    # same draws from the same generator: the counting class adds no formula of its own
    backoff = Backoff(base, cap, random.Random(seed))
    backoff.failures = failures
    expected = backoff_delay(failures, base, cap, random.Random(seed), floor=floor)
    delay = backoff.next(floor=floor)
    assert delay == expected or (math.isnan(delay) and math.isnan(expected))


@given(_BASES, _CAPS, st.integers(0, 80), st.floats(min_value=0.0, max_value=1e9))
def test_backoff_delay_raises_to_a_capped_floor(
    base: float, cap: float, attempt: int, floor: float
) -> None:
    delay = backoff_delay(attempt, base, cap, floor=floor)
    assert delay >= min(floor, RETRY_AFTER_CAP)
    assert delay <= max(min(cap, base * 2.0 ** min(attempt, 62)), min(floor, RETRY_AFTER_CAP))
