"""Unary gRPC calls over one HTTP/2 connection on a unix socket, without grpcio.

The agent asks the kubelet one or two unary questions every few seconds. grpcio's runtime adds
8.5 MiB and its event-engine threads stay busy for milliseconds after every call (a quarter of
the agent's idle CPU at a 2 s poll); this is one asyncio connection, framed by `h2`, that does
nothing between calls. Calls are serialised: the poller makes one at a time anyway.

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

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from gpuid_agent.runtime.errors import GrpcCallError

_READ_CHUNK = 256 * 1024
_WINDOW = 2**31 - 1  # the largest flow-control window: never stall a large answer
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


class _Answer:
    """What has arrived for one stream."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] | None = None
        self.trailers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.ended = False


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
        self._h2: h2.connection.H2Connection | None = None
        self._reused = False  # the open connection has answered a call before

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
        answer = _Answer()
        try:
            conn = await self._connection()
            stream = self._send(conn, method, request)
            await self._receive(conn, stream, answer)
        except GrpcCallError:
            await self._drop()  # the connection's own failure: the next call dials afresh
            raise
        except (OSError, h2.exceptions.H2Error) as exc:
            await self._drop()
            raise _call_error(
                Status.UNAVAILABLE, f"connection failed: {exc}", unsent=answer.headers is None
            ) from exc
        self._reused = True
        return self._message(answer)  # a status of the server's: the connection stays

    async def _connection(self) -> h2.connection.H2Connection:
        if self._h2 is not None and self._reader is not None and not self._reader.at_eof():
            return self._h2
        await self._drop()
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                self.socket_path, limit=_READ_CHUNK
            )
        except PermissionError as exc:
            raise _call_error(Status.PERMISSION_DENIED, f"cannot connect: {exc.strerror}") from exc
        except OSError as exc:
            raise _call_error(Status.UNAVAILABLE, f"cannot connect: {exc.strerror or exc}") from exc
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                header_encoding=None,
                # our own headers are constant and known good; the answer's are read only
                # for what gRPC defines, each checked where it is read
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
            )
        )
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 64 * 1024,
            },
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(_WINDOW - 65535)
        self._h2 = conn
        self._reused = False
        self._flush()
        return conn

    def _send(self, conn: h2.connection.H2Connection, method: str, request: bytes) -> int:
        stream = conn.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", method.encode()),
            (b":authority", b"localhost"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"grpc-timeout", f"{max(1, int(self.timeout * 1000))}m".encode()),
            (b"user-agent", b"gpuid-agent"),
        ]
        conn.send_headers(stream, headers)
        conn.send_data(stream, _PREFIX.pack(0, len(request)) + request, end_stream=True)
        self._flush()
        return stream

    async def _receive(
        self, conn: h2.connection.H2Connection, stream: int, answer: _Answer
    ) -> None:
        assert self._reader is not None
        limit = self.max_message_bytes + _PREFIX.size
        while not answer.ended:
            data = await self._reader.read(_READ_CHUNK)
            if not data:
                raise _call_error(
                    Status.UNAVAILABLE, "connection closed", unsent=answer.headers is None
                )
            for event in conn.receive_data(data):
                self._handle(conn, event, stream, answer)
            if len(answer.body) > limit:
                raise _call_error(
                    Status.RESOURCE_EXHAUSTED,
                    f"answer larger than {self.max_message_bytes} bytes",
                )
            self._flush()

    def _handle(
        self, conn: h2.connection.H2Connection, event: object, stream: int, answer: _Answer
    ) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            unsent = answer.headers is None
            raise _call_error(Status.UNAVAILABLE, "server closed the connection", unsent=unsent)
        if getattr(event, "stream_id", stream) != stream:
            return
        if isinstance(event, h2.events.ResponseReceived):
            answer.headers = dict(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            answer.body += event.data
            conn.acknowledge_received_data(event.flow_controlled_length, stream)
        elif isinstance(event, h2.events.TrailersReceived):
            answer.trailers = dict(event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            answer.ended = True
        elif isinstance(event, h2.events.StreamReset):
            code = event.error_code
            refused = code == h2.errors.ErrorCodes.REFUSED_STREAM
            status = Status.UNAVAILABLE if refused else Status.INTERNAL
            raise _call_error(status, f"stream reset by the server ({code!s})", unsent=refused)

    def _message(self, answer: _Answer) -> bytes:
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
        if self._h2 is not None and self._writer is not None:
            out = self._h2.data_to_send()
            if out:
                self._writer.write(out)

    async def _drop(self) -> None:
        writer, self._writer, self._reader, self._h2 = self._writer, None, None, None
        self._reused = False
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
