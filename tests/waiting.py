"""The one way the tests wait: poll a condition until it holds, never sleep a fixed time and
then assert. A passing wait returns as soon as its condition holds, so the bound is generous:
it only decides how long a failing test takes to say so."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from typing import Any

WITHIN = 20.0
STEP = 0.02

Errors = tuple[type[BaseException], ...]


async def eventually(
    check: Callable[[], Any],
    *,
    within: float = WITHIN,
    step: float = STEP,
    ignoring: Errors = (),
    what: str | None = None,
) -> Any:
    """Call `check` (plain or async) every `step` seconds until it returns something truthy,
    and return that. Exceptions of the types in `ignoring` count as "not yet" (a server still
    starting); any other exception fails the wait at once, as it would in the test itself.
    After `within` seconds it fails naming `what` (or the check's source) and what the last
    attempt returned or raised."""
    deadline = _Deadline(check, within, what)
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as exc:
            if deadline.passed():
                raise deadline.failure(f"last error {exc!r}") from exc
        else:
            if value:
                return value
            if deadline.passed():
                raise deadline.failure(f"last value {value!r}")
        await asyncio.sleep(step)


def eventually_blocking(
    check: Callable[[], Any],
    *,
    within: float = WITHIN,
    step: float = STEP,
    ignoring: Errors = (),
    what: str | None = None,
) -> Any:
    """`eventually` for code that runs outside an event loop (starting a server or a
    subprocess, a test with threads): the same contract, blocking the calling thread."""
    deadline = _Deadline(check, within, what)
    while True:
        try:
            value = check()
        except ignoring as exc:
            if deadline.passed():
                raise deadline.failure(f"last error {exc!r}") from exc
        else:
            if inspect.isawaitable(value):  # always truthy: the wait could never fail
                if inspect.iscoroutine(value):
                    value.close()
                raise TypeError(f"{deadline.what}: an async check needs `await eventually()`")
            if value:
                return value
            if deadline.passed():
                raise deadline.failure(f"last value {value!r}")
        time.sleep(step)


class _Deadline:
    """When one wait gives up, and what it says then. Only the last attempt is reported:
    an exception kept from one attempt to the next would hold its frames (and the sockets
    in them) alive."""

    def __init__(self, check: Callable[[], Any], within: float, what: str | None) -> None:
        self.what = what or _describe(check)
        self.within = within
        self.at = time.monotonic() + within

    def passed(self) -> bool:
        return time.monotonic() > self.at

    def failure(self, last: str) -> AssertionError:
        return AssertionError(f"not met within {self.within}s: {self.what} ({last})")


def _describe(check: Callable[[], Any]) -> str:
    """A lambda by its source line(s), anything else by its qualified name."""
    name = getattr(check, "__qualname__", repr(check))
    if name.endswith("<lambda>"):
        with contextlib.suppress(OSError, TypeError):
            return " ".join(inspect.getsource(check).split())[:300]
    return str(name)
