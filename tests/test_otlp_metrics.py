"""/gpu/metrics telemetry pushed as OTLP metrics into a real receiver that decodes them."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from tests.conftest import free_port, running_agent, serves, settings
from tests.servers.otlp import Answer, OtlpReceiver, Point
from tests.waiting import eventually

Series = tuple[str, frozenset[tuple[str, str]]]


def scraped_series(text: str) -> dict[Series, float]:
    """/gpu/metrics as OTLP names it: counters without _total, empty labels absent."""
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name
            if family.type == "counter":
                name = name.removesuffix("_total")
            labels = frozenset((k, v) for k, v in sample.labels.items() if v != "")
            out[(name, labels)] = sample.value
    return out


def pushed_series(points: list[Point]) -> dict[Series, float]:
    return {
        (p.name, frozenset((k, str(v)) for k, v in p.attributes.items())): p.value for p in points
    }


def agent_for(endpoint: str, **kw: Any) -> Agent:
    return Agent(
        settings(
            simulate="mig",
            pod_resources_interval=0.05,
            otel_metrics_exporter="otlp",
            otel_exporter_otlp_endpoint=endpoint,
            otel_metric_export_interval=100,
            **kw,
        ),
        exporters=[StdoutExporter(io.BytesIO())],
    )


async def test_pushed_metrics_are_the_gpu_metrics_series(otlp_receiver: OtlpReceiver) -> None:
    agent = agent_for(otlp_receiver.base_url)
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b"gpuid_gpu_allocation_info{"))
        seq = agent.renderer.seq
        # a push made after that render has the holders too
        await eventually(
            lambda: any(
                p.name == "gpuid_gpu_allocation_info"
                for push in otlp_receiver.metric_pushes[-1:]
                for p in push
            ),
            within=10,
        )
        assert agent.renderer.seq >= seq
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/gpu/metrics") as resp,
        ):
            scraped = scraped_series(await resp.text())
        pushes_before_stop = len(otlp_receiver.metric_pushes)
    assert len(otlp_receiver.metric_pushes) == pushes_before_stop + 1  # one more at shutdown
    last = otlp_receiver.metric_pushes[-1]
    pushed = pushed_series(last)
    # the same series (names and label sets) on both paths; telemetry values move between
    # snapshots, identity and info series do not
    assert set(pushed) == set(scraped)
    for series, value in scraped.items():
        if series[0].endswith("_info"):
            assert pushed[series] == value == 1.0
    assert {p.resource["host.id"] for p in last} == {agent.identity.machine}
    assert {p.resource["k8s.node.name"] for p in last} == {"node-a"}
    assert {p.resource["service.name"] for p in last} == {"gpuid-agent"}
    now = time.time_ns()
    assert all(now - 60 * 10**9 < p.time_unix_nano <= now for p in last)
    for point in last:
        if point.kind == "sum":
            assert point.monotonic and 0 < point.start_time_unix_nano <= point.time_unix_nano
    holders = {p.attributes["pod"] for p in last if p.name == "gpuid_gpu_allocation_info"}
    assert {"mig-job-0", "llm-serve-0"} <= holders


async def test_a_down_receiver_is_counted_and_pushes_resume() -> None:
    port = free_port()
    agent = agent_for(f"http://127.0.0.1:{port}")
    receiver = OtlpReceiver()
    failures = {"exporter": "otlp_metrics", "error_type": "connection"}
    async with running_agent(agent):
        registry = agent.metrics.registry
        await eventually(
            lambda: (registry.get_sample_value("gpuid_export_failure_total", failures) or 0) >= 2
        )
        await receiver.start(port)
        try:
            await eventually(lambda: len(receiver.metric_pushes) >= 2)
        finally:
            await receiver.stop()
        assert registry.get_sample_value("gpuid_export_success_total", {"exporter": "otlp_metrics"})
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/healthz") as resp,
        ):
            assert resp.status == 200


def test_opentelemetry_is_loaded_only_when_asked_for() -> None:
    script = """
import sys
from gpuid_agent.agent import Agent
from gpuid_agent.runtime.config_load import load_settings
extra = {"otel_metrics_exporter": "otlp", "otel_exporter_otlp_endpoint": "http://127.0.0.1:1"}
Agent(load_settings({"simulate": "gb200x4", **(extra if sys.argv[1] == "push" else {})}))
print("opentelemetry" in sys.modules)
"""
    seen = {}
    for mode in ("default", "push"):
        done = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        seen[mode] = done.stdout.strip()
    assert seen == {"default": "False", "push": "True"}


async def test_retry_after_pauses_pushes_and_partial_success_is_counted(
    otlp_receiver: OtlpReceiver,
) -> None:
    otlp_receiver.metrics_plan.extend(
        [Answer(503, headers={"Retry-After": "1"}), Answer(rejected=5, message="too many")]
    )
    agent = agent_for(otlp_receiver.base_url)
    async with running_agent(agent):
        await eventually(lambda: len(otlp_receiver.metric_requests) >= 3)
        registry = agent.metrics.registry
        rejected = registry.get_sample_value(
            "gpuid_export_rejected_records_total", {"exporter": "otlp_metrics"}
        )
        failed = registry.get_sample_value(
            "gpuid_export_failure_total", {"exporter": "otlp_metrics", "error_type": "http_503"}
        )
    (first, status), (second, _) = otlp_receiver.metric_requests[:2]
    assert status == 503
    assert second - first >= 0.95  # not every 100 ms: the receiver asked for a second
    assert (failed, rejected) == (1, 5)
