"""The agent's own pipeline into a real OTLP receiver: spooled while the receiver is down,
all of it delivered once it is up, nothing lost, attribution readable as attributes."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from gpuid_agent.agent import Agent
from tests.conftest import free_port, settings
from tests.servers.otlp import OtlpReceiver
from tests.waiting import eventually


def _sample_sum(agent: Agent, name: str) -> float:
    return sum(
        s.value
        for family in agent.metrics.registry.collect()
        for s in family.samples
        if s.name == name
    )


async def test_spooled_records_reach_the_receiver_once_it_is_up(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here yet
    agent = Agent(
        settings(
            simulate="mig",
            exporter_type="otlp",
            otel_exporter_otlp_endpoint=f"http://127.0.0.1:{port}",
            otel_resource_attributes="deployment.environment.name=test",
            otel_exporter_otlp_headers="x-api-key=k3y%2Fsecret-value",
            spool_dir=str(tmp_path / "spool"),
            pod_resources_interval=0.05,
            heartbeat_interval=0.2,
            retry_count=0,
            retry_backoff=0.01,
            retry_backoff_max=0.05,
            shutdown_grace=5.0,
        )
    )
    receiver = OtlpReceiver()
    await agent.start()
    try:
        (worker,) = agent.pipeline.workers
        await eventually(
            lambda: worker.store.batches >= 3 and worker.describe()["consecutive_failures"] >= 2
        )
        spooled = list((tmp_path / "spool" / "otlp").glob("*.ndjson"))
        assert len(spooled) >= 3  # on disk, not only in memory
        await receiver.start(port)
        await eventually(lambda: worker.store.batches == 0 and receiver.accepted(), within=20)
        async with aiohttp.ClientSession() as http:
            for path in ("/status", "/metrics"):
                async with http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as response:
                    shown = await response.text()
                    assert response.status == 200
                    assert "secret-value" not in shown, path
                    if path == "/status":
                        config = json.loads(shown)["config"]
                        assert config["otel_exporter_otlp_headers"] == "<redacted>"
    finally:
        await agent.stop()
        await receiver.stop()
    emitted = _sample_sum(agent, "gpuid_records_emitted_total")
    assert emitted > 0
    assert _sample_sum(agent, "gpuid_dropped_records_total") == 0
    assert len(receiver.accepted_ids()) == emitted  # every record, once each by id
    assert {r.headers["x-api-key"] for r in receiver.requests} == {"k3y/secret-value"}
    assert not list((tmp_path / "spool" / "otlp").glob("*.ndjson"))
    logs = receiver.accepted()
    assert {log.resource["host.id"] for log in logs} == {agent.identity.machine}
    assert {log.resource["k8s.node.name"] for log in logs} == {"node-a"}
    assert {log.resource["deployment.environment.name"] for log in logs} == {"test"}
    starts = [log for log in logs if log.attributes.get("gpuid.allocation.event") == "start"]
    pods = {log.attributes["k8s.pod.name"]: log.attributes for log in starts}
    assert set(pods) == {"mig-job-0", "mig-job-1", "llm-serve-0", "llm-serve-1", "llm-serve-2"}
    assert pods["mig-job-0"]["gpu.mig.profile"] == "3g.40gb"
    assert all(a["k8s.namespace.name"] and a["gpu.uuid"] for a in pods.values())
    assert {log.attributes["gpuid.record.kind"] for log in logs} >= {"reading", "allocation"}
