"""NvmlSource: the agent's NVML, on a thread of its own, with every wait bounded.

Calls run one at a time on an `NvmlThread`. A call still running after `call_timeout`
seconds raises `NvmlStalledError` to its waiter: the thread is given up (it may never come
back from the driver) and later calls run on a fresh one, which initialises NVML again. While
a call is hung, `stalled()` names it so liveness can fail and the kubelet restart the agent;
`close()` gives nvmlShutdown a bounded time and then leaves, so a hung driver cannot hold up
shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pynvml

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import NvmlStalledError, NvmlUnavailableError
from gpuid_agent.runtime.status import Reason
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.reader import NvmlReader, NvmlReading
from gpuid_agent.sources.nvml.thread import NvmlThread, note_call

T = TypeVar("T")
_log = log.get("nvml")
# Hung threads kept before calls fail at once: each holds a driver call that may never return,
# so a driver that hangs every call costs a few threads, not one per collection.
MAX_HUNG_THREADS = 3
DEFAULT_CALL_TIMEOUT = 30.0


class _Traced:
    """An NvmlApi whose calls tell the NVML thread which call it is in (for `stalled()`)."""

    def __init__(self, api: NvmlApi) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        api = self._api
        if not callable(getattr(api, name)):
            return getattr(api, name)

        def traced(*args: Any) -> Any:
            note_call(name)
            return getattr(api, name)(*args)

        setattr(self, name, traced)  # kept: later lookups find it without coming here
        return traced


class NvmlSource:
    """Owns the NVML thread and the init state; `reader.api` is for the other readers that
    run through `run` (health) or on threads of their own (XID)."""

    def __init__(self, api: NvmlApi, *, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.reader = NvmlReader(cast(NvmlApi, _Traced(api)))
        self.call_timeout = call_timeout
        self.initialised = False
        self.last_error: str | None = None
        self._thread = NvmlThread()
        self._hung: list[NvmlThread] = []
        self._inits = 0  # successful nvmlInit calls, each owed one nvmlShutdown
        self._previous: dict[int, GpuIdentity] = {}

    # ---- the bounded call ------------------------------------------------------------------

    async def _call(
        self, job: str, fn: Callable[[], T], *, within: float | None = None, replace: bool = True
    ) -> T:
        bound = self.call_timeout if within is None else within
        self._forget_finished()
        if len(self._hung) >= MAX_HUNG_THREADS:
            raise self._stalled_error()
        worker = self._thread
        waiter = asyncio.wrap_future(worker.submit(job, fn))
        # asyncio.wait, not wait_for: wait_for (3.11) can swallow a cancellation that races
        # the result, and a collector that ignores its cancel would hold shutdown forever.
        try:
            await asyncio.wait({waiter}, timeout=bound)
        finally:
            if not waiter.done():
                waiter.cancel()
        if not waiter.cancelled():
            return cast(T, waiter.result())
        busy = worker.busy()
        what = busy[0] if busy else job
        self._give_up(worker, replace)
        error = self._stalled_error()
        self.last_error = str(error)
        _log.error("NVML call hung: giving its thread up", extra={"call": what, "bound_s": bound})
        raise error

    def _give_up(self, worker: NvmlThread, replace: bool) -> None:
        worker.abandon()
        if worker.alive:
            self._hung.append(worker)
        if replace and worker is self._thread:
            self._thread = NvmlThread()
            self.initialised = False  # initialise again, on the fresh thread

    def _forget_finished(self) -> None:
        if any(not t.alive for t in self._hung):
            self._hung = [t for t in self._hung if t.alive]

    def _stalled_error(self) -> NvmlStalledError:
        hung = self._hung_reason()
        figures = {**hung.figures, "calls_given_up": len(self._hung)}
        return NvmlStalledError(f"NVML call hung: {hung.text}", figures)

    def _hung_reason(self, *running: tuple[str, float]) -> Reason:
        """The calls hung (given up on, and any `running` past the bound), each named once so
        the words stay while they hang, and the longest's seconds as a figure."""
        busy = [*running, *(b for t in self._hung if (b := t.busy()) is not None)]
        if not busy:
            return Reason("returning")
        return Reason(
            ", ".join(sorted({call for call, _ in busy})),
            {"running_s": round(max(seconds for _, seconds in busy))},
        )

    def stalled(self, bound: float | None = None) -> Reason | None:
        """Why NVML counts as stalled: a call running past `bound` (`call_timeout` unless
        given), or a call given up on that has not returned yet. None when neither."""
        self._forget_finished()
        busy = self._thread.busy()
        bound = self.call_timeout if bound is None else bound
        running = [busy] if busy is not None and busy[1] > bound else []
        if not running and not self._hung:
            return None
        hung = self._hung_reason(*running)
        return Reason(f"NVML call hung: {hung.text}", hung.figures)

    # ---- the calls -------------------------------------------------------------------------

    async def run(self, fn: Callable[[], T], job: str = "call") -> T:
        """Run `fn` on the NVML thread, bounded like every call (health reads use this)."""
        return await self._call(job, fn)

    async def init(self) -> None:
        """Initialise NVML; raises NvmlUnavailableError with the reason (NvmlStalledError
        when nvmlInit hangs)."""
        try:
            await self._call("init", self.reader.api.init)
        except NvmlUnavailableError as exc:
            self.last_error = str(exc)
            raise
        self._inits += 1
        self.initialised = True
        self.last_error = None

    async def read(self) -> NvmlReading:
        try:
            reading = await self._call("read", lambda: self.reader.read(self._previous))
        except pynvml.NVMLError as exc:
            # Whole-library failure (driver unloaded, uninitialised): re-init next time.
            self.initialised = False
            self.last_error = f"NVML read failed: {exc}"
            raise NvmlUnavailableError(self.last_error) from exc
        self._previous = {gpu.index: gpu for gpu in reading.gpus}
        return reading

    async def close(self, within: float = 5.0) -> None:
        """nvmlShutdown with at most `within` seconds for it, then end the thread (or leave
        it, hung, to the interpreter's exit: it is a daemon)."""
        inits, self._inits = self._inits, 0
        self.initialised = False

        def shutdown() -> None:
            for _ in range(inits):
                self.reader.api.shutdown()

        if inits:
            try:
                await self._call("shutdown", shutdown, within=within, replace=False)
            except NvmlStalledError as exc:
                _log.warning("NVML shutdown left unfinished", extra={"reason": str(exc)})
            except pynvml.NVMLError as exc:
                _log.debug("nvmlShutdown failed", extra={"error": str(exc)})
        self._thread.abandon()
