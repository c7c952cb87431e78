"""The agent's HTTP/2 client side (`sources/kubelet/http2.py`) against the `h2` library as the
server, in memory: requests the server decodes as sent, answers in every framing a server may
choose, the protocol's duties (acknowledgements, the receive window), and hostile bytes."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.runtime.errors import Http2ProtocolError
from gpuid_agent.sources.kubelet.http2 import Answer, ClientConnection, header_block

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/v1.PodResourcesLister/List"),
    (b":authority", b"localhost"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
]
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"


def _pair() -> tuple[ClientConnection, h2.connection.H2Connection]:
    """A client and an `h2` server past the preface and both sides' settings."""
    client = ClientConnection(64 * 1024)
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive(server.data_to_send())
    events = server.receive_data(client.data_to_send())
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
    return client, server


def _ask(client: ClientConnection, server: h2.connection.H2Connection) -> tuple[Answer, int]:
    answer = client.request(header_block(REQUEST), EMPTY_MESSAGE)
    events = server.receive_data(client.data_to_send())
    [received] = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    assert received.headers == REQUEST
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    return answer, received.stream_id


def _respond(server: h2.connection.H2Connection, stream: int, body: bytes, **data: int) -> None:
    server.send_headers(stream, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    for at in range(0, len(body), 16_000):  # frames no larger than the client allows
        server.send_data(stream, body[at : at + 16_000], **data)
    server.send_headers(stream, [(b"grpc-status", b"0")], end_stream=True)


def test_an_answer_arrives_whole_with_padding_and_a_reused_header_table() -> None:
    client, server = _pair()
    for turn in range(3):  # the server indexes its headers: later answers refer to its table
        answer, stream = _ask(client, server)
        _respond(server, stream, b"message %d" % turn, pad_length=17)
        client.receive(server.data_to_send())
        assert answer.ended and answer.reset is None
        assert answer.headers == {b":status": b"200", b"content-type": b"application/grpc"}
        assert answer.trailers == {b"grpc-status": b"0"}
        assert bytes(answer.body) == b"message %d" % turn
    assert stream == 5  # odd stream ids, one per call


def test_an_answer_fed_a_byte_at_a_time() -> None:
    client, server = _pair()
    answer, stream = _ask(client, server)
    _respond(server, stream, b"x" * 40_000)  # over one frame: several DATA frames
    for byte in server.data_to_send():
        client.receive(bytes((byte,)))
    assert answer.ended and bytes(answer.body) == b"x" * 40_000


def test_a_header_block_continued_over_frames() -> None:
    client, server = _pair()
    answer, stream = _ask(client, server)
    big = [(b"x-long-%d" % i, b"v" * 3000) for i in range(10)]  # over 16 KiB: CONTINUATION
    server.send_headers(stream, [(b":status", b"200"), *big], end_stream=True)
    client.receive(server.data_to_send())
    assert answer.ended and answer.headers is not None
    assert answer.headers[b"x-long-9"] == b"v" * 3000


def test_pings_and_settings_are_acknowledged() -> None:
    client, server = _pair()
    server.ping(b"12345678")
    server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 10})
    client.receive(server.data_to_send())
    events = server.receive_data(client.data_to_send())
    kinds = {type(e) for e in events}
    assert {h2.events.PingAckReceived, h2.events.SettingsAcknowledged} <= kinds


def test_a_reset_after_the_whole_answer_ends_the_request_only() -> None:
    """Go's gRPC server answers a refused call at once, then resets the stream with NO_ERROR
    (RFC 9113 8.1): the answer stands. A reset before the answer ended is the call's end."""
    client, server = _pair()
    answer, stream = _ask(client, server)
    server.send_headers(stream, [(b":status", b"200"), (b"grpc-status", b"8")], end_stream=True)
    reset = b"\x00\x00\x04\x03\x00" + stream.to_bytes(4, "big") + b"\x00\x00\x00\x00"
    client.receive(server.data_to_send() + reset)
    assert answer.ended and answer.reset is None
    assert answer.headers is not None and answer.headers[b"grpc-status"] == b"8"
    answer, stream = _ask(client, server)
    server.reset_stream(stream, error_code=7)  # REFUSED_STREAM, nothing answered
    client.receive(server.data_to_send())
    assert answer.reset == 7 and not answer.ended


def test_going_away_names_the_last_stream_served() -> None:
    client, server = _pair()
    answer, served = _ask(client, server)
    _respond(server, served, b"first")
    client.receive(server.data_to_send())
    assert answer.ended and client.usable
    answer, stream = _ask(client, server)
    server.close_connection(last_stream_id=served)
    client.receive(server.data_to_send())
    assert client.going_away == served < stream and not client.usable
    assert not answer.ended  # the caller tells this call it was never served


def test_the_connection_window_is_kept_open() -> None:
    """A long-lived connection receives far more than one window over its life: past half of
    it, the client gives the server the bytes back (a stalled kubelet connection otherwise)."""
    client, _ = _pair()
    chunk = b"\x00\x40\x00\x00\x00\x00\x00\x00\x63" + bytes(16_384)  # DATA on stream 99
    frames = chunk * 1024  # 16 MiB
    for _ in range(2**30 // len(frames) + 1):  # just past half the window
        client.receive(frames)
    sent = client.data_to_send()
    assert sent[3] == 8 and sent[5:9] == b"\x00\x00\x00\x00"  # WINDOW_UPDATE, connection
    assert int.from_bytes(sent[9:13], "big") == 2**30  # every byte received, given back


@pytest.mark.parametrize(
    "frames",
    [
        b"\x00\x00\x00\x01\x04\x00\x00\x00\x01",  # HEADERS before the server's SETTINGS
        b"HTTP/1.1 400 Bad Request\r\n\r\n",
    ],
)
def test_a_server_that_does_not_speak_http2_first_is_refused(frames: bytes) -> None:
    with pytest.raises(Http2ProtocolError):
        ClientConnection(1024).receive(frames)


@given(
    st.lists(st.tuples(st.binary(min_size=1, max_size=300), st.binary(max_size=300)), max_size=12)
)
def test_any_headers_encode_to_a_block_a_real_decoder_reads_back(
    headers: list[tuple[bytes, bytes]],
) -> None:
    decoder = hpack.Decoder()
    for _ in range(2):  # and the block leaves the decoder's table as it was
        assert decoder.decode(header_block(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0


@given(st.binary(max_size=600), st.integers(1, 64))
def test_any_bytes_after_the_handshake_are_survived_or_refused(junk: bytes, step: int) -> None:
    client, server = _pair()
    answer, _ = _ask(client, server)
    try:
        for at in range(0, len(junk), step):
            client.receive(junk[at : at + step])
            client.data_to_send()
    except Http2ProtocolError:
        return
    assert isinstance(answer.body, bytearray)
