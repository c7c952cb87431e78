"""Unary gRPC calls over one HTTP/2 connection on a unix socket, without grpcio.

The agent asks the kubelet one or two unary questions every few seconds. grpcio's runtime adds
8.5 MiB and its event-engine threads stay busy for milliseconds after every call (a quarter of
the agent's idle CPU at a 2 s poll); this is one asyncio connection, framed by `http2` (the
client side of HTTP/2 a unary call needs), that does nothing between calls. Calls are
serialised: the poller makes one at a time anyway.

Statuses follow the gRPC HTTP/2 protocol: `grpc-status` in the trailers (or in the headers of a
trailers-only answer), the HTTP status mapped when there is none, connection failures as
UNAVAILABLE. The calls made are reads, so one that failed on a reused connection before any
answer began (the server had closed it, or was going away) is tried once more on a fresh one.
"""

from __future__ import annotations

import asyncio
import errno
import struct
from enum import IntEnum
from urllib.parse import unquote

from gpuid_agent.runtime.errors import GrpcCallError, Http2ProtocolError
from gpuid_agent.sources.kubelet.http2 import REFUSED_STREAM, Answer, ClientConnection, header_block

_READ_CHUNK = 256 * 1024
_MAX_HEADER_LIST = 64 * 1024
_PREFIX = struct.Struct(">BI")  # gRPC message framing: compressed flag, length


class Status(IntEnum):
    """gRPC status codes the agent tells apart (the rest keep their number)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


def _call_error(status: int, details: str, *, unsent: bool = False) -> GrpcCallError:
    """The error of a call that did not end with status OK."""
    name = Status(status).name if status in Status._value2member_map_ else f"STATUS_{status}"
    return GrpcCallError(status, name, details, unsent)


# The gRPC spec's mapping for answers that carry no grpc-status of their own.
_HTTP_STATUS = {
    400: Status.INTERNAL,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.UNIMPLEMENTED,
    429: Status.UNAVAILABLE,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.UNAVAILABLE,
}


class UnaryChannel:
    """One HTTP/2 connection to a gRPC server listening on `socket_path`, dialled on first use
    and again after any failure of the connection itself."""

    def __init__(self, socket_path: str, *, timeout: float, max_message_bytes: int) -> None:
        self.socket_path = socket_path
        self.timeout = timeout  # seconds for each call, from dialling to the last byte
        self.max_message_bytes = max_message_bytes
        self._lock = asyncio.Lock()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: ClientConnection | None = None
        self._reused = False  # the open connection has answered a call before
        self._blocks: dict[str, bytes] = {}  # each method's request headers, encoded once

    async def call(self, method: str, request: bytes) -> bytes:
        """The serialized answer of unary `method` ("/package.Service/Method")."""
        timeout = self.timeout
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    reused = self._reused
                    try:
                        return await self._attempt(method, request)
                    except GrpcCallError as exc:
                        if not (exc.unsent and reused):
                            raise
                    return await self._attempt(method, request)
            except TimeoutError:
                await self._drop()
                raise _call_error(
                    Status.DEADLINE_EXCEEDED, f"no answer within {timeout:g}s"
                ) from None

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    # ---- one attempt -----------------------------------------------------------------------

    async def _attempt(self, method: str, request: bytes) -> bytes:
        answer: Answer | None = None
        try:
            conn = await self._connection()
            answer = conn.request(self._block(method), _PREFIX.pack(0, len(request)) + request)
            self._flush()
            await self._receive(conn, answer)
        except GrpcCallError:
            await self._drop()  # the connection's own failure: the next call dials afresh
            raise
        except (OSError, Http2ProtocolError) as exc:
            await self._drop()
            unsent = answer is None or answer.headers is None
            raise _call_error(
                Status.UNAVAILABLE, f"connection failed: {exc}", unsent=unsent
            ) from exc
        if conn.usable:
            self._reused = True
        else:  # the server is going away, or the stream ids are used up: dial afresh next
            await self._drop()
        return self._message(answer)  # a status of the server's: the connection stays

    async def _connection(self) -> ClientConnection:
        if self._conn is not None and self._reader is not None and not self._reader.at_eof():
            return self._conn
        await self._drop()
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                self.socket_path, limit=_READ_CHUNK
            )
        except PermissionError as exc:
            raise _call_error(Status.PERMISSION_DENIED, f"cannot connect: {exc.strerror}") from exc
        except OSError as exc:
            raise _call_error(Status.UNAVAILABLE, f"cannot connect: {exc.strerror or exc}") from exc
        self._conn = ClientConnection(_MAX_HEADER_LIST)
        self._reused = False
        self._flush()  # the preface and settings
        return self._conn

    def _block(self, method: str) -> bytes:
        block = self._blocks.get(method)
        if block is None:
            block = self._blocks[method] = header_block(
                [
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":path", method.encode()),
                    (b":authority", b"localhost"),
                    (b"te", b"trailers"),
                    (b"content-type", b"application/grpc"),
                    (b"grpc-timeout", f"{max(1, int(self.timeout * 1000))}m".encode()),
                    (b"user-agent", b"gpuid-agent"),
                ]
            )
        return block

    async def _receive(self, conn: ClientConnection, answer: Answer) -> None:
        assert self._reader is not None
        limit = self.max_message_bytes + _PREFIX.size
        while not answer.ended:
            data = await self._reader.read(_READ_CHUNK)
            if not data:
                raise _call_error(
                    Status.UNAVAILABLE, "connection closed", unsent=answer.headers is None
                )
            conn.receive(data)
            self._flush()  # settings and pings acknowledged, the window kept open
            if answer.reset is not None:
                refused = answer.reset == REFUSED_STREAM
                status = Status.UNAVAILABLE if refused else Status.INTERNAL
                raise _call_error(
                    status,
                    f"stream reset by the server (error code {answer.reset})",
                    unsent=refused,
                )
            if conn.going_away is not None and conn.going_away < conn.stream:
                raise _call_error(Status.UNAVAILABLE, "server closed the connection", unsent=True)
            if len(answer.body) > limit:
                raise _call_error(
                    Status.RESOURCE_EXHAUSTED,
                    f"answer larger than {self.max_message_bytes} bytes",
                )

    def _message(self, answer: Answer) -> bytes:
        """The one message of a finished answer, or the call's error."""
        headers = answer.headers or {}
        found = answer.trailers.get(b"grpc-status", headers.get(b"grpc-status"))
        http = headers.get(b":status", b"")
        if found is None:
            code = int(http) if http.isdigit() else 0
            mapped = Status.INTERNAL if code == 200 else _HTTP_STATUS.get(code, Status.UNKNOWN)
            raise _call_error(mapped, f"answer without a gRPC status (HTTP {code})")
        if not found.isdigit():
            raise _call_error(Status.INTERNAL, "malformed grpc-status")
        status = int(found)
        if status != Status.OK:
            text = answer.trailers.get(b"grpc-message", headers.get(b"grpc-message", b""))
            raise _call_error(status, unquote(text.decode("utf-8", "replace")))
        body = answer.body
        if len(body) < _PREFIX.size:
            raise _call_error(Status.INTERNAL, "status OK without a message")
        compressed, length = _PREFIX.unpack_from(body)
        if compressed:
            raise _call_error(Status.INTERNAL, "compressed message (none was asked for)")
        if len(body) != _PREFIX.size + length:
            raise _call_error(Status.INTERNAL, "message length does not match its frame")
        return bytes(body[_PREFIX.size :])

    def _flush(self) -> None:
        if self._conn is not None and self._writer is not None:
            out = self._conn.data_to_send()
            if out:
                self._writer.write(out)

    async def _drop(self) -> None:
        writer, self._writer, self._reader, self._conn = self._writer, None, None, None
        self._reused = False
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
