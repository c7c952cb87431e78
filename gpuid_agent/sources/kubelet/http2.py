"""The client side of one HTTP/2 connection, as much of it as unary calls made one at a time
need, without I/O: bytes in, bytes out, and what arrived for the stream open now.

A general HTTP/2 library spent most of each kubelet poll in its state machine, for a call whose
request never changes. Here a request is two frames built from bytes prepared once, and an
answer is a handful of frames parsed in one pass. The connection still does what the protocol
asks of a client: it starts with the preface and its settings, acknowledges the server's
settings and pings, keeps the connection's receive window open, decodes every header block in
order (the server's HPACK table depends on it), refuses pushes, and treats a frame it cannot
parse as the end of the connection (`Http2ProtocolError`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import hpack

from gpuid_agent.runtime.errors import Http2ProtocolError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
REFUSED_STREAM = 0x7
MAX_FRAME = 16_384  # SETTINGS_MAX_FRAME_SIZE left at its default: no frame may be larger
WINDOW = 2**31 - 1  # the largest window, for each stream and the connection
MAX_STREAM = 2**31 - 1
_SETTING = struct.Struct(">HI")
_ENABLE_PUSH, _INITIAL_WINDOW_SIZE, _MAX_HEADER_LIST_SIZE = 0x2, 0x4, 0x6


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


def _integer(value: int, prefix_bits: int) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541 5.1), the prefix's other bits zero."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((value,))
    out, value = bytearray((top,)), value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def header_block(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """Headers as literals without indexing (RFC 7541 6.2.2), strings not Huffman coded: the
    block leaves the server's table alone, so the same bytes serve every request."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value
    return bytes(out)


class Answer:
    """What has arrived for one stream."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] | None = None
        self.trailers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.ended = False
        self.reset: int | None = None  # the RST_STREAM error code, if the server reset it


class ClientConnection:
    def __init__(self, max_header_list: int) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = max_header_list
        self._max_block = max_header_list + MAX_FRAME  # HPACK's bytes never exceed this
        self._buffer = bytearray()
        self._block: tuple[int, int, bytearray] | None = None  # a header block being continued
        self._settled = False  # the server's first frame, its SETTINGS, has come
        self._unacknowledged = 0  # connection window used since the last WINDOW_UPDATE
        self._next_stream = 1
        self.stream = 0
        self.answer = Answer()
        self.going_away: int | None = None  # GOAWAY's last stream id: no new streams after it
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (_ENABLE_PUSH, 0),
                (_INITIAL_WINDOW_SIZE, WINDOW),
                (_MAX_HEADER_LIST_SIZE, max_header_list),
            )
        )
        self._out = bytearray(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (WINDOW - 65_535).to_bytes(4, "big"))
        )

    @property
    def usable(self) -> bool:
        """Whether a new stream may be opened on this connection."""
        return self.going_away is None and self._next_stream <= MAX_STREAM

    def request(self, block: bytes, body: bytes) -> Answer:
        """Open the next stream with this header block and body (one frame: the caller's
        bodies are small), and return what will arrive for it."""
        if len(body) > MAX_FRAME:
            raise ValueError("request body larger than one frame")
        self.stream, self._next_stream = self._next_stream, self._next_stream + 2
        self.answer = Answer()
        self._out += frame(HEADERS, END_HEADERS, self.stream, block)
        self._out += frame(DATA, END_STREAM, self.stream, body)
        return self.answer

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive(self, data: bytes) -> None:
        """Take bytes from the server; raises Http2ProtocolError when they are not HTTP/2."""
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 9:
            length = int.from_bytes(buffer[at : at + 3], "big")
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = int.from_bytes(buffer[at + 5 : at + 9], "big") & MAX_STREAM
            if length > MAX_FRAME:
                raise Http2ProtocolError(f"a frame of {length} bytes, over the {MAX_FRAME} allowed")
            if not self._settled and kind != SETTINGS:
                raise Http2ProtocolError("the server did not begin with its SETTINGS")
            if len(buffer) - at < 9 + length:
                break
            payload = bytes(buffer[at + 9 : at + 9 + length])
            at += 9 + length
            self._frame(kind, flags, stream, payload)
        del buffer[:at]
        if self._unacknowledged > WINDOW // 2:
            self._out += frame(WINDOW_UPDATE, 0, 0, self._unacknowledged.to_bytes(4, "big"))
            self._unacknowledged = 0

    # ---- one frame -------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise Http2ProtocolError("a header block interrupted by another frame")
        if kind in (DATA, HEADERS, RST_STREAM, CONTINUATION) and stream == 0:
            raise Http2ProtocolError(f"frame type {kind} on stream 0")
        if kind in (SETTINGS, PING, GOAWAY) and stream != 0:
            raise Http2ProtocolError(f"frame type {kind} on a stream")
        if kind == DATA:
            self._unacknowledged += len(payload)
            if stream == self.stream:
                self.answer.body += _unpadded(flags, payload)
                self.answer.ended = self.answer.ended or bool(flags & END_STREAM)
        elif kind == HEADERS:
            fragment = _unpadded(flags, payload)
            if flags & PRIORITY_FLAG:
                fragment = fragment[5:]
            self._block = (stream, flags, bytearray(fragment))
            self._continued(flags)
        elif kind == CONTINUATION:
            if self._block is None or self._block[0] != stream:
                raise Http2ProtocolError("CONTINUATION without the HEADERS it continues")
            self._block[2].extend(payload)
            self._continued(flags)
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise Http2ProtocolError("RST_STREAM of the wrong size")
            # After a complete answer a reset (NO_ERROR) only ends the request's sending side
            if stream == self.stream and not self.answer.ended:
                self.answer.reset = int.from_bytes(payload, "big")
        elif kind == SETTINGS:
            self._settings(flags, payload)
        elif kind == PUSH_PROMISE:
            raise Http2ProtocolError("a push promised, though pushes were disabled")
        elif kind == PING:
            if len(payload) != 8:
                raise Http2ProtocolError("PING of the wrong size")
            if not flags & ACK:
                self._out += frame(PING, ACK, 0, payload)
        elif kind == GOAWAY:
            if len(payload) < 8:
                raise Http2ProtocolError("GOAWAY too short")
            self.going_away = int.from_bytes(payload[:4], "big") & MAX_STREAM
        elif kind == WINDOW_UPDATE and len(payload) != 4:
            raise Http2ProtocolError("WINDOW_UPDATE of the wrong size")
        # PRIORITY, WINDOW_UPDATE (requests fit any window) and unknown types: nothing to do

    def _settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            if payload:
                raise Http2ProtocolError("a SETTINGS acknowledgement with settings")
            return
        if len(payload) % _SETTING.size:
            raise Http2ProtocolError("SETTINGS of the wrong size")
        self._settled = True  # nothing the server may set changes what this client sends
        self._out += frame(SETTINGS, ACK, 0)

    def _continued(self, flags: int) -> None:
        assert self._block is not None
        stream, first_flags, block = self._block
        if len(block) > self._max_block:
            raise Http2ProtocolError("a header block over the header list limit")
        if not flags & END_HEADERS:
            return
        self._block = None
        try:  # every block, whichever stream: the decoder's table must follow the server's
            headers = dict(self._decoder.decode(bytes(block), raw=True))
        except hpack.HPACKError as exc:
            raise Http2ProtocolError(f"a header block that does not decode: {exc}") from exc
        if stream != self.stream:
            return
        answer = self.answer
        if answer.headers is None:
            answer.headers = headers
        else:
            answer.trailers = headers
        answer.ended = answer.ended or bool(first_flags & END_STREAM)


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise Http2ProtocolError("padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]
