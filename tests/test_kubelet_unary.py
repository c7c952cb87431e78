"""The agent's own unary gRPC client (`sources/kubelet/unary.py`) against a real grpc.aio server,
against HTTP/2 servers that misbehave on purpose, and what a real node's agent no longer loads."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.runtime.errors import GrpcCallError
from gpuid_agent.sources.kubelet.unary import Status, UnaryChannel
from gpuid_agent.sources.kubelet.v1 import api_pb2
from tests.fakekubelet import FakeKubelet, pod
from tests.test_kube_api_imports import _imported, _ready, _start
from tests.waiting import eventually

LIST = "/v1.PodResourcesLister/List"


def _channel(socket: str, timeout: float = 5.0, limit: int = 1 << 20) -> UnaryChannel:
    return UnaryChannel(socket, timeout=timeout, max_message_bytes=limit)


class Proxy:
    """A unix socket in front of the kubelet's, counting the connections made through it."""

    def __init__(self, path: str, upstream: str) -> None:
        self.path, self.upstream, self.connections = path, upstream, 0
        self._server: asyncio.base_events.Server | None = None

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


async def test_answers_and_server_statuses(kubelet: FakeKubelet) -> None:
    kubelet.pods = [pod("ns", "p", "c", "nvidia.com/gpu", "GPU-1")]
    kubelet.allocatable = None
    channel = _channel(kubelet.socket_path)
    try:
        answer = api_pb2.ListPodResourcesResponse.FromString(await channel.call(LIST, b""))
        assert [p.name for p in answer.pod_resources] == ["p"]
        with pytest.raises(GrpcCallError) as missing:
            await channel.call("/v1.PodResourcesLister/GetAllocatableResources", b"")
        assert missing.value.status == Status.UNIMPLEMENTED
        with pytest.raises(GrpcCallError) as unknown:
            await channel.call("/v1.PodResourcesLister/NoSuchMethod", b"")
        assert unknown.value.status == Status.UNIMPLEMENTED
        kubelet.behaviour.fail["List"] = grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(GrpcCallError) as denied:
            await channel.call(LIST, b"")
        assert (denied.value.name, denied.value.details) == (
            "PERMISSION_DENIED",
            "injected PERMISSION_DENIED",
        )
        kubelet.behaviour.fail.clear()
        assert await channel.call(LIST, b"")  # a server status leaves the channel usable
    finally:
        await channel.close()


async def test_one_connection_kept_across_calls_and_redialled_after_a_restart(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    front = str(Path(kubelet.socket_path).with_name("front.sock"))
    async with Proxy(front, kubelet.socket_path) as proxy:
        channel = _channel(front)
        try:
            for _ in range(20):
                await channel.call(LIST, b"")
            assert proxy.connections == 1
            # the kubelet goes away and comes back: the old connection is dead, the call
            # is tried once more on a fresh one and answers
            await kubelet.restart()
            await channel.call(LIST, b"")
            assert proxy.connections == 2
        finally:
            await channel.close()


async def test_deadline_then_the_next_call_answers(kubelet: FakeKubelet) -> None:
    kubelet.behaviour.delay["List"] = 3.0
    channel = _channel(kubelet.socket_path, timeout=0.3)
    try:
        with pytest.raises(GrpcCallError) as late:
            await channel.call(LIST, b"")
        assert late.value.status == Status.DEADLINE_EXCEEDED
        kubelet.behaviour.delay.clear()
        assert await channel.call(LIST, b"") is not None
    finally:
        await channel.close()


async def test_an_answer_over_the_limit_is_refused(kubelet: FakeKubelet) -> None:
    kubelet.pods = [pod("ns", f"p{i}", "c", "nvidia.com/gpu", f"GPU-{i}") for i in range(3000)]
    small, large = _channel(kubelet.socket_path, limit=10_000), _channel(kubelet.socket_path)
    try:
        with pytest.raises(GrpcCallError) as refused:
            await small.call(LIST, b"")
        assert refused.value.status == Status.RESOURCE_EXHAUSTED
        answer = api_pb2.ListPodResourcesResponse.FromString(await large.call(LIST, b""))
        assert len(answer.pod_resources) == 3000
    finally:
        await small.close()
        await large.close()


async def test_no_socket_is_unavailable(tmp_path: Path) -> None:
    channel = _channel(str(tmp_path / "absent.sock"))
    with pytest.raises(GrpcCallError) as absent:
        await channel.call(LIST, b"")
    assert absent.value.status == Status.UNAVAILABLE


# ---- servers that misbehave --------------------------------------------------------------

Respond = Callable[[h2.connection.H2Connection, int], None]


def _grpc_frame(message: bytes, compressed: int = 0, length: int | None = None) -> bytes:
    return struct.pack(">BI", compressed, len(message) if length is None else length) + message


def _answer(
    status: bytes, *body: bytes, trailers: list[tuple[bytes, bytes]] | None = None
) -> Respond:
    def respond(conn: h2.connection.H2Connection, stream: int) -> None:
        conn.send_headers(stream, [(b":status", status), (b"content-type", b"application/grpc")])
        for chunk in body:
            conn.send_data(stream, chunk)
        conn.send_headers(stream, trailers or [(b"grpc-status", b"0")], end_stream=True)

    return respond


@contextlib.asynccontextmanager
async def h2_server(path: str, respond: Respond | bytes | None) -> AsyncIterator[None]:
    """An HTTP/2 server answering each request with `respond` (raw bytes: written instead of
    any HTTP/2; None: never answers)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamEnded):
                        if isinstance(respond, bytes):
                            writer.write(respond)
                            writer.close()
                            return
                        if respond is not None:
                            respond(conn, event.stream_id)
                writer.write(conn.data_to_send())
        writer.close()

    server = await asyncio.start_unix_server(serve, path)
    try:
        yield
    finally:
        server.close()


CASES: dict[str, tuple[Respond | bytes | None, int, str]] = {
    "HTTP 503 without a gRPC status": (
        _answer(b"503", trailers=[(b"x", b"y")]),
        Status.UNAVAILABLE,
        "HTTP 503",
    ),
    "status OK without a message": (_answer(b"200"), Status.INTERNAL, "without a message"),
    "compressed message": (
        _answer(b"200", _grpc_frame(b"\x0a\x00", compressed=1)),
        Status.INTERNAL,
        "compressed",
    ),
    "frame length lies": (
        _answer(b"200", _grpc_frame(b"\x0a\x00", length=9)),
        Status.INTERNAL,
        "length",
    ),
    "non-numeric grpc-status": (
        _answer(b"200", _grpc_frame(b""), trailers=[(b"grpc-status", b"ok")]),
        Status.INTERNAL,
        "malformed",
    ),
    "percent-encoded message": (
        _answer(b"200", trailers=[(b"grpc-status", b"9"), (b"grpc-message", b"caf%C3%A9 100%25")]),
        9,
        "café 100%",
    ),
    "going away before answering": (
        lambda conn, stream: conn.close_connection(last_stream_id=0),
        Status.UNAVAILABLE,
        "server closed the connection",
    ),
    "reset before answering": (
        lambda conn, stream: conn.reset_stream(stream, error_code=2),
        Status.INTERNAL,
        "stream reset by the server (error code 2)",
    ),
    "garbage instead of HTTP/2": (b"HTTP/1.1 400 Bad Request\r\n\r\n", Status.UNAVAILABLE, ""),
    "connection closed": (b"", Status.UNAVAILABLE, ""),
    "never answers": (None, Status.DEADLINE_EXCEEDED, "within"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_misbehaving_server_is_a_clear_error(tmp_path: Path, case: str) -> None:
    respond, status, details = CASES[case]
    path = str(tmp_path / "s.sock")
    async with h2_server(path, respond):
        channel = _channel(path, timeout=1.0)
        try:
            with pytest.raises(GrpcCallError) as failed:
                await channel.call(LIST, b"")
        finally:
            await channel.close()
    assert failed.value.status == status
    assert details in failed.value.details


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(junk=st.binary(max_size=300))
def test_any_bytes_from_the_server_are_survived(tmp_path: Path, junk: bytes) -> None:
    async def attempt() -> None:
        path = str(tmp_path / "junk.sock")
        async with h2_server(path, junk):
            channel = _channel(path, timeout=1.0)
            try:
                with pytest.raises(GrpcCallError):
                    await channel.call(LIST, b"")
            finally:
                await channel.close()

    asyncio.run(attempt())


# ---- what a real node's agent loads -------------------------------------------------------


async def test_a_node_agent_loads_protobuf_but_not_grpcio(
    tmp_path: Path, subprocess_env: dict[str, str], kubelet: FakeKubelet
) -> None:
    """With the kubelet outside the agent (a real node), the agent attributes its pods with
    protobuf's parser but without importing grpcio; the simulation serving its own kubelet
    imports grpcio, which shows the import log would catch it."""
    kubelet.pods = [pod("ml", "train", "c", "nvidia.com/gpu", "GPU-1")]
    base = subprocess_env | {"HOME": str(tmp_path), "KUBE_API": "off"}
    external = _start(base | {"POD_RESOURCES_SOCKET": kubelet.socket_path}, tmp_path / "a.log")
    inside = _start(base, tmp_path / "b.log")
    for _, port in (external, inside):
        await eventually(lambda p=port: _ready(p), within=60, ignoring=(Exception,))
    await eventually(lambda: kubelet.calls["List"] >= 2, within=30)
    node = await asyncio.to_thread(_imported, external[0], tmp_path / "a.log")
    simulated = await asyncio.to_thread(_imported, inside[0], tmp_path / "b.log")
    assert "gpuid_agent.sources.kubelet.unary" in node
    assert "gpuid_agent.sources.kubelet.v1.api_pb2" in node
    assert not {m for m in node if m.split(".")[0] == "grpc" or m.endswith("_pb2_grpc")}
    assert "hpack" in node and "h2" not in node  # HTTP/2 framed by the agent itself
    assert "grpc" in simulated
