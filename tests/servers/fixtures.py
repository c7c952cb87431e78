"""pytest fixtures over the servers: session-scoped PostgreSQL and moto, per-test receiver."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from tests.servers.otlp import OtlpReceiver
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver
from tests.servers.s3 import CREDENTIALS, MotoServer


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresCluster]:
    reason = PostgresCluster.unavailable()
    if reason:
        pytest.skip(f"PostgreSQL tests need a local server: {reason}")
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def postgres(postgres_server: PostgresCluster) -> PostgresCluster:
    """The session cluster, started again should a test have left it stopped."""
    if postgres_server.root is not None and not (postgres_server.data / "postmaster.pid").exists():
        postgres_server.start_server()
    return postgres_server


@pytest.fixture
def pg_schema(postgres: PostgresCluster) -> str:
    """A fresh schema name per test, so tests never see each other's tables."""
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def db(postgres: PostgresCluster) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the cluster, to look at what exporters stored."""
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> str:
    name = f"gpuid-{uuid.uuid4().hex[:12]}"
    client = moto_server.client()
    client.create_bucket(Bucket=name)  # type: ignore[attr-defined]
    client.close()  # type: ignore[attr-defined]
    return name


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    server = OtlpReceiver()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
