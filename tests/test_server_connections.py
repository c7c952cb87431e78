"""The HTTP server under idle sockets, slow requests, too many connections and a process out of
file descriptors: a real agent process on a simulated node, real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server_agent import AgentProcess, Conn, agent_env
from tests.waiting import eventually

Start = Callable[..., AgentProcess]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    agents: list[AgentProcess] = []

    def make(nofile: int | None = None, **settings: str) -> AgentProcess:
        agent = AgentProcess(tmp_path / f"agent{len(agents)}.log", agent_env(**settings), nofile)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.stop()


async def idle(agent: AgentProcess, count: int) -> list[Conn]:
    return [await agent.connect() for _ in range(count)]


async def all_closed(conns: list[Conn]) -> bool:
    return all([await c.closed_by_server() for c in conns])


def close_all(conns: list[Conn]) -> None:
    for conn in conns:
        conn.close()


def quiet_log(agent: AgentProcess) -> None:
    """No traceback from the server and no line from asyncio's own accept loop. (A /gpu/metrics
    render may fail while the process has no descriptor left, and says so; what this checks
    is that accepting connections does not flood the log.)"""
    lines = agent.lines()
    tracebacks = [x for x in lines if "exc" in x and x.get("component") != "renderer"]
    assert not tracebacks, tracebacks[:3]
    assert not [x for x in lines if "out of system resource" in x.get("msg", "")]


async def test_idle_and_slow_connections_are_closed_after_the_idle_timeout(start: Start) -> None:
    agent = await start(SERVER_IDLE_TIMEOUT="1s").started()
    idle_ones = await idle(agent, 20)
    kept_alive = await agent.connect()
    assert (await kept_alive.request("/healthz"))[0] == 200

    # slowloris: a request line, then one header byte every 50 ms, never finished
    trickler = await agent.connect()
    trickler.writer.write(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    cut_off = asyncio.Event()

    async def trickle() -> None:
        with contextlib.suppress(OSError):
            while not cut_off.is_set():
                trickler.writer.write(b"a")
                await trickler.writer.drain()
                await asyncio.sleep(0.05)

    trickling = asyncio.create_task(trickle())
    # a body trickled after its headers: answered, then cut off (bodies are never read)
    body = await agent.connect()
    body.writer.write(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nab")
    assert (await body.response())[0] == 405

    await eventually(lambda: all_closed([*idle_ones, kept_alive, body]), within=30)
    assert await eventually(trickler.closed_by_server, within=30)
    cut_off.set()
    await trickling
    assert await agent.metric("gpuid_http_connections") <= 1  # the /metrics request itself
    close_all([*idle_ones, kept_alive, trickler, body])
    quiet_log(agent)


async def test_over_the_limit_the_quietest_connection_closes_and_probes_answer(
    start: Start,
) -> None:
    agent = await start(SERVER_MAX_CONNECTIONS="8", SERVER_IDLE_TIMEOUT="5m").started()
    first = await idle(agent, 7)
    active = await agent.connect()
    assert (await active.request("/healthz"))[0] == 200  # 8 open now
    second = await idle(agent, 5)  # closes first[0:5], the quietest
    await eventually(lambda: all_closed(first[:5]))
    assert (await active.request("/healthz"))[0] == 200  # `active` is now the latest
    third = await idle(agent, 3)  # closes first[5:7] and second[0]
    await eventually(lambda: all_closed([*first[5:], second[0]]))

    survivors = [active, *second[1:], *third]
    assert len(survivors) == 8
    for conn in survivors:  # each still answers on its own connection
        assert (await conn.request("/healthz"))[0] == 200
    # a probe on a fresh connection is answered: the quietest idle one made room
    assert (await agent.get("/healthz"))[0] == 200
    await eventually(survivors[0].closed_by_server)
    closed = await agent.metric('gpuid_http_connections_closed_total{reason="limit"}')
    assert closed >= 9  # 5 + 3 + the probe's
    assert await agent.metric("gpuid_http_connections") <= 8

    warnings = [x for x in agent.lines() if x["level"] == "warning" and x["component"] == "http"]
    assert len(warnings) == 1 and warnings[0]["closed"]["limit"] >= 1  # once a minute at most
    close_all([*first, *second, *third, active])
    quiet_log(agent)


async def healthz_answers(agent: AgentProcess) -> bool:
    """One probe: 200, or a connection the server closed to make room (a probe that failed
    fast; the kubelet's next one, like this helper's next try, gets an answer)."""
    try:
        return (await agent.get("/healthz"))[0] == 200
    except (ConnectionError, asyncio.IncompleteReadError):
        return False


async def test_a_flood_of_idle_sockets_at_a_low_descriptor_limit(start: Start) -> None:
    agent = await start(nofile=256).started()
    flood: list[Conn] = []
    try:
        for _ in range(4):
            flood += await idle(agent, 150)
            await eventually(lambda: healthz_answers(agent), within=10)
            assert agent.fds() < 256
        await eventually(lambda: healthz_answers(agent), within=10)
        assert await agent.metric("gpuid_http_connections") <= 128  # half the descriptor limit
        lines = agent.lines()
        assert any("half the file-descriptor limit" in x["msg"] for x in lines)
        assert len([x for x in lines if x["level"] in ("warning", "error")]) <= 3
    finally:
        close_all(flood)
    quiet_log(agent)


async def open_connections(agent: AgentProcess, at_least: int = 0, at_most: int = 10**6) -> bool:
    """Whether the agent's open connections (the /metrics request's included) are in range."""
    return at_least <= await agent.metric("gpuid_http_connections") <= at_most


async def settled_fds(agent: AgentProcess) -> bool:
    """Whether the agent's descriptors stayed the same over 0.2 s (the last one closed)."""
    before = agent.fds()
    await asyncio.sleep(0.2)  # a hold: nothing opens or closes meanwhile
    return agent.fds() == before


async def test_out_of_descriptors_the_server_makes_room_or_fails_fast(start: Start) -> None:
    agent = await start().started()
    held = await idle(agent, 30)
    await eventually(lambda: open_connections(agent, at_least=31))
    agent.set_nofile(agent.lowest_free_fd())  # not one descriptor left
    more = await idle(agent, 30)  # each closes the quietest of `held` to get one
    assert (await agent.get("/healthz"))[0] == 200
    await eventually(lambda: all_closed(held))
    out_of_fds = await agent.metric('gpuid_http_connections_closed_total{reason="out_of_fds"}')
    assert out_of_fds >= 31

    close_all([*held, *more])
    agent.set_nofile(4096)
    await eventually(lambda: open_connections(agent, at_most=1))
    await eventually(lambda: settled_fds(agent))
    agent.set_nofile(agent.lowest_free_fd())  # and no connection left to close
    refused = await agent.connect()
    refused.writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await eventually(refused.closed_by_server, within=10)  # fails fast, never hangs
    refused.close()

    agent.set_nofile(4096)
    assert (await agent.get("/healthz"))[0] == 200
    assert await agent.metric('gpuid_http_connections_closed_total{reason="refused"}') >= 1
    quiet_log(agent)
