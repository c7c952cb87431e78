"""XID events: an NVML event set waited on in a thread of its own.

`nvmlEventSetWait_v2` blocks for up to its timeout, so it cannot share the NVML reader thread
(reads would stall behind it) and must never run on the event loop. The thread waits in
slices so that stopping it takes at most one slice, registers GPUs as they become readable, and
hands each XID to `deliver` (called from this thread: it must be thread safe, e.g. a
`loop.call_soon_threadsafe` wrapper).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import pynvml

from gpuid_agent.runtime import log
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.runtime.thread_names import name_os_thread
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.errors import UNOFFERED, NvmlFault, error_code, fault
from gpuid_agent.sources.nvml.signals import NvmlEvent, XidEvent

_log = log.get("health.xid")
_INVALID_INSTANCE = 0xFFFFFFFF
_MAX_PAUSE = 60.0


class XidWatcher:
    def __init__(
        self,
        api: NvmlApi,
        deliver: Callable[[XidEvent], None],
        *,
        wait_ms: int = 1000,
        retry_after: float = 5.0,
    ) -> None:
        self._api = api
        self._deliver = deliver
        self._wait_ms = max(1, int(wait_ms))
        self._retry_after = retry_after
        self._targets: dict[int, str] = {}
        self._targets_version = 0  # moves when the targets change: registering again is due
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_exit: Callable[[], None] | None = None
        self._warned: set[str] = set()
        # Read from the event loop; replaced whole, never mutated in place.
        self.unsupported: Mapping[int, str] = MappingProxyType({})
        self.unavailable: str | None = None
        self.events = 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watch(self, targets: Mapping[int, str]) -> None:
        """Watch these GPUs ({index: uuid}); starts the thread on first use, and again should
        it have died (each call is one collection later, so a broken thread cannot spin)."""
        with self._lock:
            if targets != self._targets:
                self._targets = dict(targets)
                self._targets_version += 1
        if self.alive or self.unavailable is not None or self._stop.is_set():
            return
        if self._thread is not None:
            _log.warning("restarting the XID thread")
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to finish after its current wait, without waiting for it."""
        self._stop.set()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to finish; True when it did within `timeout` seconds."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def stop_within(self, within: float) -> bool:
        """`stop`, waiting on the event loop rather than on a thread of the default executor
        (which `asyncio.run` would join at exit); True when the thread ended in time."""
        self._stop.set()
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()

        def on_exit() -> None:
            loop.call_soon_threadsafe(ended.set)

        self._on_exit = on_exit
        if thread.is_alive():
            waiter = asyncio.ensure_future(ended.wait())
            try:
                await asyncio.wait({waiter}, timeout=within)
            finally:
                waiter.cancel()
        return not thread.is_alive()

    # ---- the thread --------------------------------------------------------------------

    def _warn_once(self, key: str, message: str, **extra: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(message, extra=extra)

    def _run(self) -> None:
        name_os_thread(threading.current_thread().name)
        try:
            self._loop()
        except Exception:  # a bug here must not end XID watching for good
            _log.exception("the XID thread failed")
        finally:
            if (on_exit := self._on_exit) is not None:
                with contextlib.suppress(RuntimeError):  # the loop may be closed
                    on_exit()

    def _loop(self) -> None:
        event_set: Any = None
        registered: dict[Hashable, tuple[int, str]] = {}
        retry_at: dict[int, float] = {}
        done_version = -1  # the targets version registered on this set
        backoff = Backoff(self._retry_after, max(self._retry_after, _MAX_PAUSE))
        try:
            while not self._stop.is_set():
                try:
                    if event_set is None:
                        event_set = self._api.event_set_create()
                        registered.clear()
                        retry_at.clear()
                        done_version = -1
                    # Most wakes are empty timeouts: register only when there is news.
                    if done_version != self._targets_version or retry_at:
                        done_version = self._register(event_set, registered, retry_at)
                    event = self._api.event_set_wait(event_set, self._wait_ms)
                except pynvml.NVMLError as exc:
                    found = fault(exc)
                    if found is NvmlFault.TIMEOUT:
                        backoff.reset()
                        continue
                    if found is NvmlFault.NO_CALL or (event_set is None and found in UNOFFERED):
                        # No event API on this driver: the XID check says so; nothing to retry.
                        self.unavailable = f"XID events not available: {exc}"
                        _log.warning(self.unavailable)
                        return
                    self._warn_once(f"wait:{error_code(exc)}", f"XID event wait failed: {exc}")
                    if found is not NvmlFault.LOST:
                        # The set may be gone with an NVML re-initialisation: start afresh.
                        self._free(event_set)
                        event_set = None
                    self._stop.wait(backoff.next())
                    continue
                backoff.reset()
                self._handle(event, registered)
        finally:
            self._free(event_set)

    def _free(self, event_set: Any) -> None:
        if event_set is None:
            return
        try:
            self._api.event_set_free(event_set)
        except pynvml.NVMLError as exc:
            _log.debug("freeing the XID event set failed", extra={"error": str(exc)})

    def _register(
        self,
        event_set: Any,
        registered: dict[Hashable, tuple[int, str]],
        retry_at: dict[int, float],
    ) -> int:
        """Register the targets not yet on the set; the targets version they were."""
        with self._lock:
            targets, version = dict(self._targets), self._targets_version
        done = {index: uuid for index, uuid in registered.values()}
        unsupported = dict(self.unsupported)
        now = time.monotonic()
        for index, uuid in sorted(targets.items()):
            if done.get(index) == uuid or index in unsupported:
                continue
            if retry_at.get(index, 0.0) > now:
                continue
            try:
                handle = self._api.handle_by_index(index)
                self._api.register_xid_events(handle, event_set)
                key = self._api.device_key(handle)
            except pynvml.NVMLError as exc:
                if fault(exc) in UNOFFERED:
                    unsupported[index] = f"XID events not supported on this GPU: {exc}"
                else:  # lost or busy: try again later, without spinning
                    retry_at[index] = now + self._retry_after
                    self._warn_once(
                        f"register:{index}", f"cannot watch XIDs of GPU {index}: {exc}", gpu=index
                    )
                continue
            registered[key] = (index, uuid)
            retry_at.pop(index, None)
        if unsupported != self.unsupported:
            self.unsupported = MappingProxyType(unsupported)
        return version

    def _handle(self, event: NvmlEvent, registered: Mapping[Hashable, tuple[int, str]]) -> None:
        if event.event_type != pynvml.nvmlEventTypeXidCriticalError:
            return
        target = registered.get(event.device)
        if target is None:
            self._warn_once("unknown-device", "XID from a device not being watched")
            return
        index, uuid = target
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        self.events += 1
        self._deliver(
            XidEvent(
                index=index,
                uuid=uuid,
                code=int(event.data),
                at=datetime.now(UTC),
                gpu_instance_id=None if gi == _INVALID_INSTANCE else gi,
                compute_instance_id=None if ci == _INVALID_INSTANCE else ci,
            )
        )
