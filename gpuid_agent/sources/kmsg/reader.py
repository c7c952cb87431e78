"""Reading /dev/kmsg without blocking the event loop.

The device is opened non-blocking and read from its *end*: what the kernel logged before the
agent started is not replayed (the NVML events of that time were not seen either; what the
agent judged before a restart is its state's business, not the log's). Each read returns one
record; EAGAIN means none is waiting, and the loop waits for the descriptor to be readable.
EPIPE means records were overwritten in the ring buffer before they were read: the next read
goes on with the oldest one left, so the reader counts the gap and goes on.

A FIFO or a regular file may stand in for the device (tests, replaying a saved log): a read
may then hold several lines, which are split, and a partial last line waits for its end. A
regular file cannot be waited on, so it is polled; so is a FIFO without a writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable

from gpuid_agent.runtime import log
from gpuid_agent.sources.kmsg.lines import KernelEvent, KernelLogParser

_log = log.get("kernel_log")
READ_SIZE = 8192  # more than a kmsg record can be (the kernel refuses smaller buffers)
POLL_INTERVAL = 0.5  # for a regular file, or a FIFO with no writer


class KernelLogReader:
    def __init__(self, path: str, on_event: Callable[[KernelEvent], None]) -> None:
        self.path = path
        self.on_event = on_event
        self.parser = KernelLogParser()
        self.records = 0
        self.overwritten = 0  # EPIPE: records lost to the ring buffer before they were read
        self._partial = b""

    async def run(self) -> None:
        """Read until cancelled; OSError when the log cannot be opened or read."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):  # a FIFO cannot seek: it starts where it is
                os.lseek(fd, 0, os.SEEK_END)
            loop = asyncio.get_running_loop()
            pollable = _can_wait(loop, fd)
            while True:
                at_end = self._drain(fd)
                if at_end or not pollable:
                    await asyncio.sleep(POLL_INTERVAL)
                else:
                    await _readable(loop, fd)
        finally:
            os.close(fd)

    def _drain(self, fd: int) -> bool:
        """Read what is waiting; True at end of file (no writer on a FIFO)."""
        while True:
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return False
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                self.overwritten += 1
                if self.overwritten == 1:
                    _log.warning("kernel log records were overwritten before they were read")
                continue
            if not chunk:
                return True
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        lines = data.split(b"\n")
        # a kmsg record always ends with a newline; a stand-in's last line may not have yet
        self._partial = lines.pop()[-READ_SIZE:]
        for raw in lines:
            if not raw or raw[:1] == b" ":  # continuation lines carry no message
                continue
            self.records += 1
            event = self.parser.parse(raw.decode("utf-8", "replace"))
            if event is not None:
                self.on_event(event)


def _can_wait(loop: asyncio.AbstractEventLoop, fd: int) -> bool:
    try:
        loop.add_reader(fd, lambda: None)
    except (PermissionError, OSError):  # epoll refuses regular files
        return False
    loop.remove_reader(fd)
    return True


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
