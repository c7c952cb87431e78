"""The thread NVML calls run on: a daemon that knows which call it is in and since when.

An NVML call can block in the driver for minutes (a GPU falling off the bus, a wedged kernel
module) and cannot be interrupted. The caller therefore waits with a bound and, past it,
abandons the thread: as a daemon it never delays interpreter exit, and no executor joins it
(`concurrent.futures` joins its workers at exit; `asyncio.run` waits for the default
executor). An abandoned thread finishes the call it is in, if ever, and then exits; calls
queued behind it fail with `NvmlStalledError` instead of waiting.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpuid_agent.runtime.errors import NvmlStalledError
from gpuid_agent.runtime.thread_names import name_os_thread

_ids = itertools.count(1)
_Job = tuple[str, Callable[[], Any], "Future[Any]"]
_local = threading.local()


def note_call(name: str) -> None:
    """Record the NVML call the current NvmlThread is entering (no-op on other threads)."""
    worker = getattr(_local, "worker", None)
    if worker is not None:
        worker._call = (name, time.monotonic())


def _give_up(future: Future[Any], name: str) -> None:
    if not future.done():
        future.set_exception(NvmlStalledError(f"NVML thread given up ({name})"))


class NvmlThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._current: str | None = None  # the job running now
        self._call: tuple[str, float] | None = None  # (NVML call, monotonic start) within it
        self._abandoned = False
        self.thread = threading.Thread(target=self._run, name=f"nvml_{next(_ids)}", daemon=True)
        self.thread.start()

    def submit(self, name: str, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on this thread; `name` is what `busy()` reports while it runs."""
        future: Future[Any] = Future()
        with self._lock:
            if self._abandoned:
                _give_up(future, name)
                return future
            self._jobs.put((name, fn, future))
        return future

    def busy(self) -> tuple[str, float] | None:
        """The NVML call running now (and the job it is part of) and for how many seconds,
        or None when idle."""
        job, call = self._current, self._call
        if job is None or call is None:
            return None
        return f"{call[0]} ({job})", time.monotonic() - call[1]

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def abandon(self) -> None:
        """Give the thread up: it ends after the call it is in; nothing new runs on it."""
        with self._lock:
            self._abandoned = True
            self._jobs.put(None)

    def _run(self) -> None:
        name_os_thread(self.thread.name)
        _local.worker = self
        while True:
            job = self._jobs.get()
            if job is None:
                break
            name, fn, future = job
            if self._abandoned:
                _give_up(future, name)
                continue
            if not future.set_running_or_notify_cancel():
                continue
            self._current, self._call = name, (name, time.monotonic())
            try:
                result = fn()
            except BaseException as exc:  # handed to the waiter, which re-raises it
                self._current = self._call = None  # idle before the waiter wakes
                future.set_exception(exc)
            else:
                self._current = self._call = None
                future.set_result(result)
        self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _give_up(job[2], job[0])
