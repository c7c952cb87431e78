"""The suite's one wait helper: what it returns, and what it says when the wait fails."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import eventually, eventually_blocking


async def test_returns_the_first_truthy_value_of_a_plain_or_async_check() -> None:
    counter = itertools.count()
    assert await eventually(lambda: next(counter) >= 3 and "done", step=0) == "done"

    calls = itertools.count()

    async def third() -> int | None:
        n = next(calls)
        return n if n == 3 else None

    assert await eventually(third, step=0) == 3


async def test_failure_names_the_check_and_its_last_value() -> None:
    values = iter(range(1_000_000))
    with pytest.raises(AssertionError) as info:
        await eventually(lambda: next(values) < 0, within=0.05, step=0.01)
    message = str(info.value)
    assert "not met within 0.05s" in message
    assert "lambda: next(values) < 0" in message
    assert "last value False" in message


async def test_ignored_errors_mean_not_yet_and_the_last_one_is_reported() -> None:
    attempts = itertools.count()

    def flaky() -> bool:
        if next(attempts) < 3:
            raise ConnectionRefusedError("still starting")
        return True

    assert await eventually(flaky, ignoring=(OSError,), step=0)

    def down() -> bool:
        raise ConnectionRefusedError("never up")

    with pytest.raises(AssertionError, match=r"server up.*last error ConnectionRefused") as info:
        await eventually(down, within=0.05, step=0.01, ignoring=(OSError,), what="server up")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


async def test_other_errors_fail_at_once() -> None:
    attempts = itertools.count()

    def broken() -> bool:
        next(attempts)
        raise KeyError("gpu")

    with pytest.raises(KeyError):
        await eventually(broken, within=5)
    assert next(attempts) == 1


def test_blocking_twin_keeps_the_contract_and_refuses_an_async_check() -> None:
    counter = itertools.count()
    assert eventually_blocking(lambda: next(counter) == 2, step=0) is True
    with pytest.raises(AssertionError, match="nothing ready"):
        eventually_blocking(lambda: None, within=0.05, step=0.01, what="nothing ready")

    async def check() -> bool:
        return False

    with pytest.raises(TypeError, match="await eventually"):
        eventually_blocking(check)
