"""OTLP exporter against a real OTLP/HTTP receiver that decodes with opentelemetry-proto."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.otlp import OtlpExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker, Outcome
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import SCHEMA_VERSION, AllocationRecord, HealthRecord
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.setup.delivery import make_exporters
from tests.exporter_support import readings, wire_id
from tests.servers.otlp import Answer, OtlpReceiver
from tests.servers.tls import make_ca_and_server
from tests.waiting import eventually

Factory = Callable[..., OtlpExporter]
FAST = BatchPolicy(
    batch_size=4, flush_interval=0.02, retry_count=2, backoff_base=0.01, backoff_max=0.05
)


def allocation(event: str = "start", **kw: Any) -> AllocationRecord:
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "allocation",
        "record_id": f"alloc-{event}",
        "event": event,
        "cluster": "c1",
        "node": "n1",
        "machine": "m1",
        "machine_source": "machine_id",
        "source": "test/agent",
        "chassis": "CH-1",
        "gpu": "SN-A",
        "read_time": "2025-03-01T12:00:00.000Z" if event == "start" else "2025-03-01T13:00:00.000Z",
        "allocation_id": "a1",
        "serial": "SN-A",
        "uuid": "GPU-n1-0",
        "gpu_index": 0,
        "mig_uuid": None,
        "mig_gpu_instance_id": None,
        "mig_profile": None,
        "namespace": "ml",
        "pod": "trainer-0",
        "pod_uid": "uid-trainer-0",
        "container": "main",
        "resource_name": "nvidia.com/gpu",
        "device_id": "GPU-n1-0",
        "replica": None,
        "workload_kind": "StatefulSet",
        "workload_name": "trainer",
        "started_at": "2025-03-01T12:00:00.000Z",
        "start_observed": True,
        "ended_at": None if event == "start" else "2025-03-01T13:00:00.000Z",
        "end_observed": None if event == "start" else True,
    }
    fields.update(kw)
    return AllocationRecord(**fields)


def health(state: str = "unhealthy") -> HealthRecord:
    return HealthRecord(
        schema_version=SCHEMA_VERSION,
        kind="health",
        cluster="c1",
        node="n1",
        machine="m1",
        source="test/agent",
        chassis="CH-1",
        gpu="SN-B",
        read_time="2025-03-01T12:30:00.000Z",
        uuid="GPU-n1-2",
        index=2,
        check="xid",
        state=state,
        previous_state="healthy",
        action="reboot",
        reason="XID 79",
        since="2025-03-01T12:30:00.000Z",
        gpu_state="unhealthy",
        machine_source="machine_id",
    )


def nanos(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000) * 1_000_000


@pytest.fixture
async def make(otlp_receiver: OtlpReceiver) -> AsyncIterator[Factory]:
    made: list[OtlpExporter] = []

    def factory(**kw: Any) -> OtlpExporter:
        endpoint = kw.pop("endpoint", otlp_receiver.url)
        exporter = OtlpExporter(endpoint, timeout=kw.pop("timeout", 5.0), **kw)
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


async def test_records_arrive_as_decoded_log_records(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    batch = [*readings(1), allocation("start"), allocation("end"), health()]
    await make(resource_attributes={"deployment.environment.name": "prod"}).export(batch)
    (got,) = otlp_receiver.requests
    assert got.headers["Content-Type"] == "application/x-protobuf"
    assert got.headers["Content-Encoding"] == "gzip"
    assert got.headers["User-Agent"] == f"gpuid-agent/{__version__}"
    assert [log.attributes["gpuid.record.id"] for log in got.logs] == [wire_id(r) for r in batch]
    for log, record in zip(got.logs, batch, strict=True):
        assert log.record == to_wire(record)  # the body is the whole record
        assert log.resource == {
            "service.name": "gpuid-agent",
            "service.version": __version__,
            "deployment.environment.name": "prod",
            "k8s.cluster.name": "c1",
            "k8s.node.name": "n1",
            "host.id": "m1",
        }
        assert log.scope == ("gpuid_agent", __version__)
        assert log.time_unix_nano == nanos(record.read_time) == log.observed_time_unix_nano
        assert log.event_name == f"gpuid.{record.kind}"
        assert log.attributes["gpuid.record.kind"] == record.kind
    reading, start, end, check = got.logs[0], got.logs[4], got.logs[5], got.logs[6]
    assert (
        reading.attributes.items()
        >= {
            "gpu.uuid": "GPU-n1-0",
            "gpu.serial": "SN-A",
            "gpu.chassis.serial": "CH-1",
            "gpu.model": "NVIDIA GB200",
            "gpu.pci.bus_id": "0000:00:00.0",
            "gpu.index": 0,
            "gpu.module.id": 1,
            "gpuid.reading.reason": "heartbeat",
        }.items()
    )
    assert start.attributes["k8s.pod.name"] == "trainer-0"
    assert start.attributes["k8s.namespace.name"] == "ml"
    assert start.attributes["k8s.container.name"] == "main"
    assert start.attributes["k8s.pod.uid"] == "uid-trainer-0"
    assert start.attributes["k8s.statefulset.name"] == "trainer"
    assert start.attributes["gpuid.allocation.event"] == "start"
    assert "gpuid.allocation.ended_at" not in start.attributes  # absent values are left out
    assert end.attributes["gpuid.allocation.ended_at"] == "2025-03-01T13:00:00.000Z"
    assert end.time_unix_nano - start.time_unix_nano == 3600 * 10**9
    assert (start.severity_text, check.severity_text) == ("INFO", "ERROR")
    assert (check.severity_number, check.attributes["gpuid.health.check"]) == (17, "xid")
    assert got.wire_bytes < got.size / 3  # gzip on the wire


async def test_one_resource_per_node_and_uncompressed_when_asked(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    batch = readings(1) + readings(1, node="n2", machine="m2")
    await make(compression="none").export(batch)
    (got,) = otlp_receiver.requests
    assert "Content-Encoding" not in got.headers
    nodes = {(log.resource["k8s.node.name"], log.resource["host.id"]) for log in got.logs}
    assert nodes == {("n1", "m1"), ("n2", "m2")}
    assert len(got.logs) == 8


# ---- answers: retries, rejection, partial success ---------------------------------------------


async def test_503_with_retry_after_is_retried_with_one_batch_identity(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    otlp_receiver.plan.extend(
        [Answer(503, headers={"Retry-After": "1"}), Answer(429), Answer(502), Answer(504)]
    )
    metrics = AgentMetrics()
    worker = ExporterWorker(make(), BatchPolicy(retry_count=4, backoff_base=0.01), metrics)
    assert await worker.deliver(readings(1)) is Outcome.DELIVERED
    statuses = [r.status for r in otlp_receiver.requests]
    assert statuses == [503, 429, 502, 504, 200]
    first, second = otlp_receiver.requests[:2]
    assert second.at - first.at >= 0.95  # the receiver's Retry-After, not the 10 ms backoff
    assert len({r.headers["Idempotency-Key"] for r in otlp_receiver.requests}) == 1
    assert len({tuple(r.record_ids) for r in otlp_receiver.requests}) == 1
    for status in (503, 429, 502, 504):
        assert (
            metrics.registry.get_sample_value(
                "gpuid_export_failure_total", {"exporter": "otlp", "error_type": f"http_{status}"}
            )
            == 1
        )


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(429, True), (502, True), (503, True), (504, True), (400, False), (401, False),
     (404, False), (413, False), (500, False), (501, False)],
)  # fmt: skip
async def test_only_the_specifications_statuses_are_retryable(
    make: Factory, otlp_receiver: OtlpReceiver, status: int, retryable: bool
) -> None:
    otlp_receiver.plan.append(Answer(status, message=f"answer {status}"))
    with pytest.raises(ExportError) as info:
        await make().export(readings(1))
    assert info.value.retryable is retryable
    assert info.value.error_type == f"http_{status}"
    assert f"answer {status}" in str(info.value)  # the receiver's Status message, readable


async def test_connection_refused_and_timeout_are_retryable(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    await otlp_receiver.stop()
    with pytest.raises(ExportError) as refused:
        await make().export(readings(1))
    assert (refused.value.retryable, refused.value.error_type) == (True, "connection")


async def test_400_sets_the_batch_aside_and_delivery_goes_on(
    make: Factory, otlp_receiver: OtlpReceiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    poisoned = wire_id(readings(1)[0])
    otlp_receiver.decide = lambda req: (
        Answer(400, message="log record 0: bad attribute") if poisoned in req.record_ids else None
    )
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "otlp", 1 << 20)
    worker = ExporterWorker(
        make(headers={"Authorization": "Bearer s3cr3t"}), FAST, metrics, store=spool
    )
    task = asyncio.create_task(worker.run())
    for record in readings(1) + readings(1, node="n2"):
        await worker.put(record)
    await eventually(lambda: len(otlp_receiver.accepted_ids()) == 4)
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    assert [r.status for r in otlp_receiver.requests] == [400, 200]  # never sent again
    assert (
        metrics.registry.get_sample_value(
            "gpuid_export_set_aside_batches_total", {"exporter": "otlp"}
        )
        == 1
    )
    assert len(list((tmp_path / "otlp" / "rejected").glob("*.ndjson"))) == 1
    (aside,) = [r for r in caplog.records if r.getMessage() == "batch set aside"]
    assert "HTTP 400" in aside.reason  # type: ignore[attr-defined]
    assert "log record 0: bad attribute" in aside.reason  # type: ignore[attr-defined]
    assert "s3cr3t" not in " ".join(str(r.__dict__) for r in caplog.records)
    assert otlp_receiver.requests[0].headers["Authorization"] == "Bearer s3cr3t"


async def test_partial_success_is_counted_and_logged_once_per_batch(
    make: Factory, otlp_receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    otlp_receiver.plan.extend(
        [Answer(rejected=3, message="3 records over the size limit"), Answer(), Answer(rejected=1)]
    )
    metrics = AgentMetrics()
    worker = ExporterWorker(make(), FAST, metrics)
    for _ in range(3):
        assert await worker.deliver(readings(1)) is Outcome.DELIVERED
    assert (
        metrics.registry.get_sample_value(
            "gpuid_export_rejected_records_total", {"exporter": "otlp"}
        )
        == 4
    )
    assert worker.describe()["delivered_records"] == 12  # declined records are not re-sent
    assert len(otlp_receiver.requests) == 3
    logged = [r for r in caplog.records if "declined" in r.getMessage()]
    assert [(r.rejected, r.records) for r in logged] == [(3, 4), (1, 4)]  # type: ignore[attr-defined]
    assert logged[0].reason == "3 records over the size limit"  # type: ignore[attr-defined]


async def test_receiver_rejects_what_a_collector_would(otlp_receiver: OtlpReceiver) -> None:
    """The receiver itself: garbage, broken gzip and a wrong content type are refused."""
    protobuf = {"Content-Type": "application/x-protobuf"}
    async with aiohttp.ClientSession() as http:
        for data, headers, status in [
            (b"\xff\xff\xff\xff", protobuf, 400),
            (b"\x1f\x8b\x08\x00garbage", {**protobuf, "Content-Encoding": "gzip"}, 400),
            (json.dumps({"resourceLogs": []}).encode(), {"Content-Type": "application/json"}, 415),
        ]:
            async with http.post(otlp_receiver.url, data=data, headers=headers) as response:
                assert response.status == status
    assert otlp_receiver.malformed == 3
    assert not otlp_receiver.requests


async def test_header_values_echoed_by_the_receiver_are_redacted(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    otlp_receiver.decide = lambda req: Answer(
        401, message=f"token {req.headers['X-Api-Key']} unknown"
    )
    with pytest.raises(ExportError) as info:
        await make(headers={"X-Api-Key": "k3y-v4lue"}).export(readings(1))
    assert otlp_receiver.requests[0].headers["X-Api-Key"] == "k3y-v4lue"  # it was sent
    assert "k3y-v4lue" not in str(info.value)
    assert "token <redacted> unknown" in str(info.value)


async def test_endpoint_credentials_echoed_by_the_receiver_are_redacted(
    make: Factory, otlp_receiver: OtlpReceiver
) -> None:
    """The same scrubbing as the HTTP exporter's: the URL's user, password and query values,
    and the Basic credentials sent from them, never reach an error."""
    otlp_receiver.decide = lambda req: Answer(
        400, message=f"bad auth {req.headers.get('Authorization')} for api_key=qu3ry-k3y"
    )
    endpoint = otlp_receiver.url.replace("://", "://otlp-user:pa55-w0rd@") + "?api_key=qu3ry-k3y"
    with pytest.raises(ExportError) as info:
        await make(endpoint=endpoint).export(readings(1))
    basic = otlp_receiver.requests[0].headers["Authorization"]
    assert basic.startswith("Basic ")  # it was sent
    message = str(info.value)
    assert not info.value.retryable
    for secret in ("otlp-user", "pa55-w0rd", "qu3ry-k3y", basic.removeprefix("Basic ")):
        assert secret not in message
    assert "bad auth Basic <redacted> for api_key=<redacted>" in message


async def test_an_unusable_ca_file_is_a_tls_error_naming_it(make: Factory, tmp_path: Path) -> None:
    missing = tmp_path / "gone.pem"
    with pytest.raises(ExportError) as info:
        await make(ca_file=str(missing)).export(readings(1))
    assert (info.value.error_type, info.value.retryable) == ("tls", True)
    assert str(missing) in str(info.value)


async def test_certificate_setting_trusts_a_private_ca(tmp_path: Path) -> None:
    ca, server_context = make_ca_and_server(tmp_path)
    server = OtlpReceiver(ssl_context=server_context)
    await server.start()
    settings = load_settings(
        {
            "exporter_type": "otlp",
            "otel_exporter_otlp_endpoint": server.base_url,
            "otel_exporter_otlp_certificate": str(ca),
        }
    )
    (trusting,) = make_exporters(settings)
    default = OtlpExporter(server.url)
    try:
        await trusting.export(readings(1))
        with pytest.raises(ExportError) as info:
            await default.export(readings(1))
        assert info.value.error_type in ("tls", "connection")
        assert info.value.retryable
    finally:
        await trusting.close()
        await default.close()
        await server.stop()
    assert len(server.accepted()) == 4


async def test_health_reports_an_unreadable_ca_bundle(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    exporter = OtlpExporter("https://127.0.0.1:1/v1/logs", ca_file=str(ca))
    assert (await exporter.health()).reason == f"CA bundle {ca} unreadable"
    make_ca_and_server(tmp_path)  # writes ca.pem
    assert (await exporter.health()).ok
