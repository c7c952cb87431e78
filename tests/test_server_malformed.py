"""Requests the HTTP parser rejects, sent to a real agent process: each is answered 400 and
logged as one debug line naming the client and the reason, never as an error with a
traceback; arbitrary bytes leave the server answering."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.server_agent import HOST, AgentProcess, agent_env
from tests.waiting import eventually

MALFORMED = {
    "oversized header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * 20_000
    + b"\r\n\r\n",
    "oversized request line": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad request line": b"HELLO\r\n\r\n",
    "bad method": b"G@T /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad header": b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
    "bad content length": b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
}

BAD_REQUEST = (b"HTTP/1.0 400 Bad Request", b"HTTP/1.1 400 Bad Request")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    log: Path = tmp_path_factory.mktemp("malformed") / "agent.log"
    agent = AgentProcess(log, agent_env(LOG_LEVEL="debug", SERVER_IDLE_TIMEOUT="2s"))
    try:
        yield asyncio.run(agent.started())
    finally:
        agent.stop()


def exchange(port: int, data: bytes, half_close: bool = False) -> bytes:
    """Send `data` (then half-close: the server drops an unfinished request at once) and read
    what comes back until the server closes."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may answer and close before reading everything
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def malformed_lines(agent: AgentProcess) -> list[dict[str, object]]:
    return [x for x in agent.lines() if x["msg"] == "malformed HTTP request"]


def no_error_or_traceback(agent: AgentProcess) -> None:
    lines = agent.lines()
    assert not [x for x in lines if x["level"] == "error" or "exc" in x]


async def test_each_malformed_request_is_answered_400_and_logged_once(
    agent: AgentProcess,
) -> None:
    before = len(malformed_lines(agent))
    answers = [exchange(agent.port, data) for data in MALFORMED.values()]
    # the server answers 400 and closes with the rest of the request unread: the client's
    # kernel may then see the reset before the answer
    assert all(a == b"" or a.split(b"\r\n")[0] in BAD_REQUEST for a in answers), answers
    assert any(answers)
    lines = await eventually(
        lambda: (
            (found := malformed_lines(agent)[before:]) and len(found) >= len(MALFORMED) and found
        )
    )
    assert len(lines) == len(MALFORMED)
    assert all(x["level"] == "debug" and x["component"] == "http" for x in lines)
    assert all(x["remote"] == HOST and x["status"] == 400 and x["reason"] for x in lines)
    assert all(len(str(x["reason"])) <= 200 for x in lines)
    no_error_or_traceback(agent)


requests = st.builds(
    lambda method, path, headers, tail: method + b" " + path + b" HTTP/1.1\r\n" + headers + tail,
    st.sampled_from([b"GET", b"POST", b"G ET", b"", b"\x00"]),
    st.binary(max_size=64),
    st.lists(
        st.builds(
            lambda k, v: k + b": " + v + b"\r\n", st.binary(max_size=16), st.binary(max_size=32)
        ),
        max_size=4,
    ).map(b"".join),
    st.sampled_from([b"\r\n", b"", b"\r\n\r\n", b"\n\n"]),
)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.binary(min_size=1, max_size=512), requests))
def test_arbitrary_bytes_never_log_an_error_and_the_server_keeps_answering(
    agent: AgentProcess, data: bytes
) -> None:
    answer = exchange(agent.port, data, half_close=True)
    assert answer == b"" or answer.startswith(b"HTTP/1.")
    no_error_or_traceback(agent)


async def test_the_server_still_answers_after_the_garbage(agent: AgentProcess) -> None:
    assert (await agent.get("/healthz"))[0] == 200
    no_error_or_traceback(agent)
