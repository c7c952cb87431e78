"""The fake API server on its own event loop in a thread, so one server can outlive the
per-test event loops (a session-scoped fixture) or serve synchronous code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tests.fakekube.server import FakeKube

T = TypeVar("T")


class ThreadedFakeKube:
    """`with ThreadedFakeKube() as api:` … `api.call(lambda k: k.add_node("n1"))`."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.kube: FakeKube | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def start(self) -> ThreadedFakeKube:
        self._thread.start()

        async def make() -> FakeKube:
            return await FakeKube(**self._kwargs).start()

        self.kube = self._run(make())
        return self

    def stop(self) -> None:
        if self.kube is not None:
            self._run(self.kube.stop())
            self.kube = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> ThreadedFakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.kube is not None
        return self.kube.url

    def call(self, fn: Callable[[FakeKube], T]) -> T:
        """Run `fn(kube)` on the server's loop (store changes notify watches safely there)."""
        assert self.kube is not None
        kube = self.kube

        async def invoke() -> T:
            return fn(kube)

        return self._run(invoke())
