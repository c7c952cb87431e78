"""The HTTP server's listening sockets and the loop that accepts its connections.

asyncio's own accept loop holds every connection it is given, and on running out of file
descriptors it logs each failed accept with a traceback and retries the rest of the backlog at
once (on Linux a flood of "socket.accept() out of system resource" lines). This one:

- keeps at most `limit` connections open: one more closes the connection quiet the longest that
  is not serving a request (idle keep-alives, headers trickled in), so a probe on a fresh
  connection is answered during a flood of idle ones; with every connection busy the new one is
  closed at once;
- on EMFILE and its kin closes the quietest connection the same way, or, with none to close,
  accepts on a spare descriptor kept for this and closes at once: the client fails fast instead
  of waiting in the backlog, and the kernel stops reporting the socket readable in a loop;
- counts what it closed (`gpuid_http_connections_closed_total`) and logs it at most once a
  minute with the counts.

A connection that sends nothing for the idle timeout is closed by the listener's sweep; aiohttp's
keep-alive timer (the same timeout, see agent.py) cuts off a request whose bytes trickle in.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import resource
import socket
import sys
import termios
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web

from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import ServerMetrics

_log = log.get("http")
BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
_ACCEPTS_PER_PASS = 128
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept(2) on Linux also passes on network errors of a connection already gone: skip it
_GONE = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTDOWN,
     errno.EHOSTUNREACH, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EPERM, errno.ENONET}
)  # fmt: skip
_RETRY_WITHOUT_SPARE = 0.5  # seconds between accepts when not even the spare fd came back
LOG_EVERY = 60.0


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (all of them for "")."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def connection_limit(wanted: int) -> int:
    """`wanted`, but at most half the process's descriptor limit: the rest of the agent (spool,
    kubelet, API, NVML) keeps descriptors however many clients connect."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 2))


class Connection(asyncio.Protocol):
    """One connection. aiohttp's protocol for it is made on its first byte: one that never
    sends any costs no parser, task or timer, and is closed by the listener's sweep. Keeps what
    the listener needs to choose a connection to close: when it last received bytes (its place
    in the listener's order) and whether a request handler runs on it (`busy`, see
    `mark_busy`)."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.busy = 0
        self.last_active = 0.0

    def unread(self) -> bool:
        """Whether bytes wait in the kernel for this connection."""
        try:
            waiting = fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return False
        return int.from_bytes(waiting, sys.byteorder) > 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.fd = transport.get_extra_info("socket").fileno()
        self.listener.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.closed(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.listener.touched(self)
        if self.inner is None:
            self.inner = self.listener.factory()
            self.inner.connection_made(self.transport)  # type: ignore[arg-type]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


@web.middleware
async def mark_busy(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Marks the connection busy while its request is handled, so it is never the one closed."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    if not isinstance(connection, Connection):
        return await handler(request)
    connection.busy += 1
    try:
        return await handler(request)
    finally:
        connection.busy -= 1


class _Tally:
    """What the listener closed, logged at most once per LOG_EVERY seconds with the counts."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.counts: dict[str, int] = {}
        self.last_logged = -LOG_EVERY
        self.flush_at: asyncio.TimerHandle | None = None

    def add(self, reason: str, open_now: int, limit: int) -> None:
        self.metrics.closed.labels(reason).inc()
        self.counts[reason] = self.counts.get(reason, 0) + 1
        loop = asyncio.get_running_loop()
        due = self.last_logged + LOG_EVERY
        if loop.time() >= due:
            self.flush(open_now, limit)
        elif self.flush_at is None:
            self.flush_at = loop.call_at(due, self.flush, open_now, limit)

    def flush(self, open_now: int, limit: int) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        if self.counts:
            _log.warning(
                "HTTP connections closed: too many open, or out of file descriptors",
                extra={"closed": dict(self.counts), "open": open_now, "limit": limit},
            )
            self.counts = {}
        self.last_logged = asyncio.get_running_loop().time()


class Listener:
    """Accepts connections on `sockets` for the protocol `factory` (an aiohttp server)."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        sockets: list[socket.socket],
        *,
        limit: int,
        idle_timeout: float,
        metrics: ServerMetrics,
    ) -> None:
        self.factory, self.sockets, self.limit = factory, sockets, limit
        self.idle_timeout, self.metrics = idle_timeout, metrics
        self._loop = asyncio.get_running_loop()
        # least recently active first; insertion order is the order of last activity
        self._open: OrderedDict[Connection, None] = OrderedDict()
        self._starting: dict[asyncio.Task[None], socket.socket] = {}
        self._tally = _Tally(metrics)
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY)
        for sock in sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)
        self._sweep_every = min(1.0, idle_timeout / 4)
        self._sweeping: asyncio.TimerHandle | None = None  # only while connections are open

    @property
    def open_connections(self) -> int:
        return len(self._open) + len(self._starting)

    # the connections' events
    def opened(self, connection: Connection) -> None:
        connection.last_active = self._loop.time()
        self._open[connection] = None
        if self._sweeping is None:
            self._sweeping = self._loop.call_later(self._sweep_every, self._sweep)
        self.metrics.connections.set(len(self._open))

    def closed(self, connection: Connection) -> None:
        self._open.pop(connection, None)
        self.metrics.connections.set(len(self._open))

    def touched(self, connection: Connection) -> None:
        connection.last_active = self._loop.time()
        if connection in self._open:
            self._open.move_to_end(connection)

    # accepting
    def _accept(self, sock: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                if exc.errno not in _OUT_OF_FDS:
                    raise
                if not self._out_of_descriptors(sock):
                    return
                continue
            conn.setblocking(False)
            if self.open_connections >= self.limit and not self._close_quietest("limit"):
                conn.close()
                self._tally.add("refused", self.open_connections, self.limit)
                continue
            task = self._loop.create_task(self._adopt(conn))
            self._starting[task] = conn
            task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        self._starting.pop(task, None)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: Connection(self), conn)
        except OSError:
            conn.close()

    def _out_of_descriptors(self, sock: socket.socket) -> bool:
        """Make room after EMFILE; True when accepting may go on in this pass."""
        if self._close_quietest("out_of_fds"):
            # the descriptor is released on the loop's next pass: accept again after it
            self._pause(sock, 0.0)
            return False
        if self._spare is None:
            self._spare = self._reopen_spare()
            self._pause(sock, _RETRY_WITHOUT_SPARE)
            return False
        os.close(self._spare)
        try:
            conn, _ = sock.accept()
        except OSError:
            pass
        else:
            conn.close()
            self._tally.add("refused", self.open_connections, self.limit)
        self._spare = self._reopen_spare()
        return self._spare is not None

    @staticmethod
    def _reopen_spare() -> int | None:
        try:
            return os.open(os.devnull, os.O_RDONLY)
        except OSError:
            return None

    def _pause(self, sock: socket.socket, seconds: float) -> None:
        fd = sock.fileno()
        self._loop.remove_reader(fd)
        self._loop.call_later(seconds, self._resume, sock)

    def _resume(self, sock: socket.socket) -> None:
        if sock.fileno() >= 0:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _close_quietest(self, reason: str) -> bool:
        """Close the connection quiet the longest that is neither serving a request nor holding
        bytes not yet read (a probe whose request arrived while this loop was busy accepting)."""
        for _ in range(len(self._open)):
            connection = next(iter(self._open))
            if connection.busy or connection.unread():
                self._open.move_to_end(connection)
                continue
            self._open.pop(connection)
            if connection.transport is not None:
                connection.transport.abort()
            self._tally.add(reason, self.open_connections, self.limit)
            return True
        return False

    def _sweep(self) -> None:
        """Close the connections that received nothing for the idle timeout (aiohttp's own
        timer bounds a request whose bytes trickle in)."""
        now = self._loop.time()
        while self._open:
            connection = next(iter(self._open))
            if connection.last_active > now - self.idle_timeout:
                break
            if connection.busy:  # a long answer to a slow reader: not idle
                self.touched(connection)
                continue
            self._open.pop(connection)
            if connection.transport is not None:
                connection.transport.abort()
        self.metrics.connections.set(len(self._open))
        self._sweeping = None
        if self._open:
            self._sweeping = self._loop.call_later(self._sweep_every, self._sweep)

    def close(self) -> None:
        """Stop accepting, close the connections that never sent a byte; aiohttp's runner
        closes the others."""
        if self._sweeping is not None:
            self._sweeping.cancel()
        for connection in list(self._open):
            if connection.inner is None and connection.transport is not None:
                connection.transport.abort()
        for sock in self.sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        for task, conn in self._starting.items():
            task.cancel()
            conn.close()
        self._tally.flush(self.open_connections, self.limit)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
