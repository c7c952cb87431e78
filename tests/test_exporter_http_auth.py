"""HTTP 401/403 hold the batch (degraded: authentication) and never set it aside; the
endpoint's credentials and the token never reach logs, errors or /status, even when a real
receiver echoes them back in its error body."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.log import JsonFormatter
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.conftest import settings
from tests.exporter_support import readings, wire_id
from tests.servers.receiver import Received, Receiver, Reply
from tests.waiting import eventually

FAST = BatchPolicy(
    batch_size=4, flush_interval=0.02, retry_count=1, backoff_base=0.01, backoff_max=0.05
)
USER, PASSWORD, API_KEY, TOKEN = "ingest-user", "pa55-w0rd-7", "k3y-9f8e7d6c", "tok-b3arer-42"


def _with_credentials(url: str, *, userinfo: bool = True) -> str:
    scheme, rest = url.split("://", 1)
    auth = f"{USER}:{PASSWORD}@" if userinfo else ""
    return f"{scheme}://{auth}{rest}?api_key={API_KEY}&region=eu"


def _echo(status: int) -> Any:
    """A receiver that refuses and quotes back what it was sent."""

    def decide(request: Received) -> Reply:
        return Reply(
            status,
            body=f"denied {request.path_qs} with {request.headers.get('Authorization')!r}\n"
            f"hint: api_key={API_KEY} is revoked",
        )

    return decide


def _secrets() -> list[str]:
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    return [PASSWORD, API_KEY, TOKEN, basic, USER]


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured line as the agent writes it (JSON with all extra fields)."""
    return "\n".join(JsonFormatter().format(r) for r in caplog.records)


def _assert_clean(*texts: str) -> None:
    for text in texts:
        for secret in _secrets():
            assert secret not in text, f"{secret!r} leaked into {text[:300]!r}"


@pytest.mark.parametrize("status", [401, 403])
async def test_auth_refusal_is_retryable_and_scrubbed(receiver: Receiver, status: int) -> None:
    receiver.decide = _echo(status)
    exporter = HttpExporter(_with_credentials(receiver.url), timeout=5)
    try:
        with pytest.raises(ExportError) as info:
            await exporter.export(readings(1))
    finally:
        await exporter.close()
    assert info.value.retryable
    assert info.value.error_type == f"http_{status}"
    assert str(info.value).startswith("authentication refused")
    # the receiver got the credentials (Basic from the URL, the key in the query) ...
    (got,) = receiver.requests
    assert got.headers["Authorization"].startswith("Basic ")
    assert f"api_key={API_KEY}" in got.path_qs
    # ... and what it echoed of them is gone from the error
    _assert_clean(str(info.value))
    assert "<redacted>" in str(info.value)


async def test_bearer_token_and_query_key_are_scrubbed_from_a_rejection(
    receiver: Receiver,
) -> None:
    receiver.decide = _echo(400)
    exporter = HttpExporter(_with_credentials(receiver.url, userinfo=False), token=TOKEN)
    try:
        with pytest.raises(ExportError) as info:
            await exporter.export(readings(1))
    finally:
        await exporter.close()
    assert not info.value.retryable  # a 400 is about the content
    _assert_clean(str(info.value))


async def test_401_then_200_holds_every_batch_and_delivers_all(
    receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    refuse = {"on": True}
    echo = _echo(401)
    receiver.decide = lambda request: echo(request) if refuse["on"] else None
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "http", 1 << 20)
    exporter = HttpExporter(_with_credentials(receiver.url), timeout=5)
    worker = ExporterWorker(exporter, FAST, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    sent = readings(5)  # 20 records, 5 batches
    try:
        for record in sent:
            await worker.put(record)
        await eventually(
            lambda: worker.store.batches == 5 and worker.describe()["consecutive_failures"] >= 4
        )
        health = worker.health()
        assert health.state == "degraded"
        assert health.reason is not None and health.reason.startswith("authentication")
        described = json.dumps(worker.describe())
        refuse["on"] = False  # the operator fixed the credentials
        await eventually(lambda: receiver.accepted_ids() >= {wire_id(r) for r in sent})
        worker.close_intake()
        await asyncio.wait_for(task, 10)
    finally:
        if not task.done():
            task.cancel()
        await exporter.close()
    assert worker.describe()["set_aside_batches"] == 0 and worker.describe()["dropped_records"] == 0
    assert not list((tmp_path / "http").rglob("rejected/*"))
    assert worker.health().state == "ok"
    refused = [r for r in receiver.requests if r.status == 401]
    assert len(refused) >= 4
    assert metrics.registry.get_sample_value(
        "gpuid_export_failure_total", {"exporter": "http", "error_type": "http_401"}
    ) == len(refused)
    logged = _logged(caplog)
    _assert_clean(logged, described)
    assert "authentication refused" in logged and "<redacted>" in logged


async def test_agent_status_and_logs_never_show_the_endpoints_credentials(
    receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    receiver.decide = _echo(401)
    agent = Agent(
        settings(
            simulate="gb200x4",
            exporter_type="http",
            http_endpoint=_with_credentials(receiver.url),
            spool_dir=str(tmp_path),
            retry_backoff=0.01,
            retry_backoff_max=0.05,
            shutdown_grace=1.0,
        )
    )
    await agent.start()
    try:
        (worker,) = agent.pipeline.workers
        await eventually(lambda: worker.describe()["consecutive_failures"] >= 2)
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{agent.bound_port}"
            async with http.get(f"{base}/status") as response:
                status_text = await response.text()
            async with http.get(f"{base}/metrics") as response:
                metrics_text = await response.text()
    finally:
        await agent.stop()
    status = json.loads(status_text)
    assert status["components"]["exporter:http"]["state"] == "degraded"
    assert "authentication" in status["components"]["exporter:http"]["reason"]
    shown = status["config"]["http_endpoint"]
    assert shown == receiver.url.replace("://", "://<redacted>@") + (
        "?api_key=<redacted>&region=<redacted>"
    )
    logged = _logged(caplog)
    assert "authentication refused" in logged
    _assert_clean(status_text, metrics_text, logged)
    assert not list(tmp_path.rglob("rejected/*"))


async def test_a_one_letter_user_name_does_not_blot_out_the_agents_own_words(
    receiver: Receiver,
) -> None:
    receiver.decide = lambda request: Reply(401, body="user u unknown")
    endpoint = receiver.url.replace("://", "://u:pw-long-enough@")
    exporter = HttpExporter(endpoint, timeout=5)
    try:
        with pytest.raises(ExportError) as info:
            await exporter.export(readings(1))
    finally:
        await exporter.close()
    message = str(info.value)
    assert message.startswith("authentication refused by the receiver (HTTP 401: ")
    assert "check HTTP_AUTH_TOKEN, HTTP_AUTH_TOKEN_FILE or the credentials" in message
    # every "u" of the receiver's words goes: over-scrubbing its text is the safe side
    assert "HTTP 401: <redacted>ser <redacted> <redacted>nknown)" in message
