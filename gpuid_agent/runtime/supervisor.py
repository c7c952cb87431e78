"""Supervised background tasks: a task that dies is logged and fails liveness."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gpuid_agent.runtime import log

_log = log.get("supervisor")


class Supervisor:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.dead: dict[str, str] = {}
        self._stopping = False

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        name = task.get_name()
        if task.cancelled():
            if not self._stopping:
                self.dead[name] = "cancelled"
                _log.error("task cancelled unexpectedly", extra={"task": name})
            return
        exc = task.exception()
        if exc is not None:
            self.dead[name] = f"{type(exc).__name__}: {exc}"
            _log.error("task died", extra={"task": name}, exc_info=exc)
        elif not self._stopping:
            self.dead[name] = "exited"
            _log.error("task exited unexpectedly", extra={"task": name})

    def task(self, name: str) -> asyncio.Task[Any] | None:
        return self._tasks.get(name)

    def problems(self) -> list[str]:
        return [f"task {name} {why}" for name, why in sorted(self.dead.items())]

    async def stop(self, *names: str, within: float | None = None) -> None:
        """Cancel the named tasks (all when none named) and wait for them."""
        self._stopping = True
        targets = (
            [self._tasks[n] for n in names if n in self._tasks]
            if names
            else list(self._tasks.values())
        )
        for task in targets:
            task.cancel()
        if targets:
            await asyncio.wait(targets, timeout=within)

    async def wait(self, name: str, within: float) -> bool:
        """Let a task finish on its own; True when it did within the timeout."""
        task = self._tasks.get(name)
        if task is None:
            return True
        self._stopping = True
        done, _ = await asyncio.wait([task], timeout=within)
        return bool(done)
