"""A real Prometheus scrapes a simulated agent with the configuration prometheus-operator
generates from the chart's ServiceMonitor or PodMonitor (tests/operator_scrape.py); the
assertions ask its query API what it stored.

The simulated node (h100x8): GPU 0 time-shared by llm-serve-0..2 (namespace inference), GPUs
1-4 held by train-0 (ml), GPU 5 by notebook (default), GPUs 6 and 7 free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gpuid_agent.runtime.config import Settings
from tests.chart_render import CHART, PROMETHEUS_OPERATOR, ROOT, newest_supported, render
from tests.operator_scrape import AgentPod, scrape_configs
from tests.servers import prometheus
from tests.servers.postgres import free_port
from tests.waiting import eventually_blocking

AGENT_POD = AgentPod(address="")  # the name, namespace and node discovery would report


@dataclass(frozen=True)
class Setup:
    kind: str
    naming: str
    values: dict[str, Any]

    @property
    def id(self) -> str:
        honor = self.values.get("monitoring", {}).get("gpuMetrics", {}).get("honorLabels", True)
        return f"{self.kind}-{self.naming}" + ("" if honor else "-no-honorLabels")


SETUPS = [
    Setup("ServiceMonitor", "dcgm", {}),
    Setup(
        "PodMonitor",
        "prometheus",
        {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False}}},
    ),
    Setup("ServiceMonitor", "dcgm", {"monitoring": {"gpuMetrics": {"honorLabels": False}}}),
]


@dataclass
class Scraped:
    setup: Setup
    server: prometheus.PrometheusServer

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return self.server.query(expr, at)

    def values(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        return [(r["metric"], float(r["value"][1])) for r in self.query(expr, at)]


def _wait_http(url: str, within: float = 30.0) -> None:
    def answers() -> bool:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200

    eventually_blocking(answers, within=within, ignoring=(OSError,), what=f"{url} answering 200")


@pytest.fixture(scope="module")
def prometheus_ready() -> None:
    reason = prometheus.unavailable()
    if reason:
        pytest.skip(f"a Prometheus server is needed: {reason}")


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: s.id)
def scraped(request: pytest.FixtureRequest, prometheus_ready: None) -> Iterator[Scraped]:
    setup: Setup = request.param
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k.lower() not in Settings.model_fields}
    env |= {
        "PYTHONPATH": str(ROOT),
        "SIMULATE": "h100x8",
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": str(port),
        "NODE_NAME": "node-a",
        "LABELS": "off",
        "KUBE_API": "off",
        "DMI_PRODUCT_UUID_PATH": "",
        "MACHINE_ID_PATH": "",
        "METRICS_NAMING": setup.naming,
        "EXPORTER_TYPE": "stdout",
        "COLLECT_INTERVAL": "1s",
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpuid_agent", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/readyz")
        rendered = render(
            setup.values, kube_version=newest_supported(), api_versions=PROMETHEUS_OPERATOR
        )
        monitor = rendered.one(setup.kind)
        daemonset = rendered.one("DaemonSet")
        pod = AgentPod(address=f"127.0.0.1:{port}")
        owner = rendered.one("Service") if setup.kind == "ServiceMonitor" else daemonset
        labels = owner["metadata"]["labels"]
        if setup.kind == "PodMonitor":
            labels = daemonset["spec"]["template"]["metadata"]["labels"]
        with prometheus.running(scrape_configs(monitor, pod, labels)) as server:
            scraped = Scraped(setup, server)
            _until(scraped, "up", 1)
            gpu_family = "DCGM_FI_DEV_GPU_UTIL" if setup.naming == "dcgm" else "gpuid_gpu_info"
            _until(scraped, gpu_family, 8)
            # The tests read 5 s and 10 s windows: several scrapes of each endpoint in them.
            _until(scraped, "count_over_time(up[5s]) >= 4", 2)
            yield scraped
    finally:
        agent.terminate()
        agent.wait(timeout=30)


def _until(scraped: Scraped, expr: str, count: int, within: float = 40.0) -> None:
    def found() -> bool:
        series = scraped.query(expr)
        assert len(series) >= count, f"{expr}: {series}\n{scraped.server.log()[-3000:]}"
        return True

    eventually_blocking(found, within=within, step=0.3, ignoring=(AssertionError,))


def test_each_endpoint_has_its_own_up(scraped: Scraped) -> None:
    up = scraped.values("up")
    assert sorted(m["endpoint"] for m, _ in up) == ["gpu-metrics", "metrics"]
    assert all(value == 1 for _, value in up)
    # one series per endpoint, scraped once a second: ~10 samples in 10s, not ~20 merged
    for metric, count in scraped.values("count_over_time(up[10s])"):
        assert 3 <= count <= 11, (metric, count)
    scraped_samples = dict(
        (m["endpoint"], v) for m, v in scraped.values("max_over_time(scrape_samples_scraped[5s])")
    )
    steady = dict(
        (m["endpoint"], v) for m, v in scraped.values("min_over_time(scrape_samples_scraped[5s])")
    )
    # Merged endpoints would alternate between two very different sizes; one endpoint's size
    # only grows by a series that appears (a counter's first label set, say).
    for endpoint, most in scraped_samples.items():
        assert most <= steady[endpoint] * 1.1, f"{endpoint} alternates: endpoints merged"
    counts = {m["endpoint"]: v for m, v in scraped.values("count_over_time(up[10s])")}
    print(f"{scraped.setup.id}: up samples in 10s {counts}, samples/scrape {scraped_samples}")
    smaller, larger = sorted(scraped_samples, key=scraped_samples.__getitem__)
    assert steady[larger] > scraped_samples[smaller] * 1.1


def test_agent_series_carry_the_agents_pod(scraped: Scraped) -> None:
    [(metric, value)] = scraped.values("gpuid_gpus")
    assert value == 8
    assert metric["pod"] == AGENT_POD.name and metric["namespace"] == AGENT_POD.namespace
    assert metric["node"] == "node-a" and metric["endpoint"] == "metrics"
    assert metric["container"] == "agent"


def test_gpu_series_carry_their_holders_and_never_the_agents_pod(scraped: Scraped) -> None:
    assert scraped.query('{__name__=~".+", exported_pod=~".+"}') == []
    assert scraped.query('{__name__=~".+", exported_namespace=~".+"}') == []
    assert scraped.query(f'{{endpoint="gpu-metrics", pod="{AGENT_POD.name}"}}') == []
    assert scraped.query(f'{{endpoint="gpu-metrics", namespace="{AGENT_POD.namespace}"}}') == []
    dcgm = scraped.setup.naming == "dcgm"
    held = "DCGM_FI_DEV_GPU_UTIL" if dcgm else "gpuid_gpu_allocation_info"
    train = scraped.values(f'{held}{{pod="train-0"}}')
    assert sorted(m["gpu"] for m, _ in train) == ["1", "2", "3", "4"]
    assert {(m["namespace"], m["container"], m["node"]) for m, _ in train} == {
        ("ml", "trainer", "node-a")
    }
    shared = scraped.values(f'{held}{{gpu="0"}}')
    assert sorted(m["pod"] for m, _ in shared) == ["llm-serve-0", "llm-serve-1", "llm-serve-2"]
    if dcgm:
        free = scraped.values('DCGM_FI_DEV_GPU_UTIL{gpu=~"6|7"}')
    else:
        free = scraped.values("gpuid_gpu_utilization_ratio")
        assert len(free) == 8  # one series per GPU, no holder labels in Prometheus naming
    assert free
    for metric, _ in free:
        assert not {"pod", "namespace", "container"} & set(metric), metric
        assert metric["node"] == "node-a"


def _panel(title: str) -> str:
    dashboard = json.loads((CHART / "dashboards" / "gpuid-agent.json").read_text())
    [expr] = [t["expr"] for p in dashboard["panels"] if p["title"] == title for t in p["targets"]]
    return str(expr).replace("$node", ".*")


@pytest.mark.parametrize(
    ("title", "prom", "dcgm", "scale"),
    [
        ("Power", "gpuid_gpu_power_watts", "DCGM_FI_DEV_POWER_USAGE", 1.0),
        ("GPU memory used", "gpuid_gpu_memory_used_bytes", "DCGM_FI_DEV_FB_USED", 1048576.0),
    ],
)
def test_dashboard_sums_count_a_shared_gpu_once(
    scraped: Scraped, title: str, prom: str, dcgm: str, scale: float
) -> None:
    """The panel's sum equals one value per GPU, added up here from the raw series."""
    at = time.time()
    dcgm_naming = scraped.setup.naming == "dcgm"
    family = dcgm if dcgm_naming else prom
    uuid = "UUID" if dcgm_naming else "uuid"
    per_gpu: dict[str, float] = {}
    raw = scraped.values(family, at)
    for metric, value in raw:
        if "GPU_I_ID" not in metric and "gpu_instance_id" not in metric:
            per_gpu[metric[uuid]] = value * (scale if dcgm_naming else 1.0)
    assert len(per_gpu) == 8
    [(_, shown)] = scraped.values(_panel(title), at)
    assert shown == pytest.approx(sum(per_gpu.values()), rel=1e-9)
    naive = sum(v for _, v in raw) * (scale if dcgm_naming else 1.0)
    if dcgm_naming:  # GPU 0's series is there once per holder: a plain sum counts it 3 times
        assert len(raw) == 8 + 2
        gpu0 = next(v for m, v in raw if m["gpu"] == "0") * scale
        assert naive == pytest.approx(shown + 2 * gpu0, rel=1e-9)
        print(f"{title}: panel {shown:.6g}, plain sum {naive:.6g} ({scraped.setup.id})")
    else:
        assert naive == pytest.approx(shown, rel=1e-9)


def test_dashboard_utilization_averages_whole_gpus(scraped: Scraped) -> None:
    at = time.time()
    dcgm_naming = scraped.setup.naming == "dcgm"
    family = "DCGM_FI_DEV_GPU_UTIL" if dcgm_naming else "gpuid_gpu_utilization_ratio"
    uuid = "UUID" if dcgm_naming else "uuid"
    per_gpu = {m[uuid]: v / (100 if dcgm_naming else 1) for m, v in scraped.values(family, at)}
    [(_, shown)] = scraped.values(_panel("GPU utilization"), at)
    assert shown == pytest.approx(sum(per_gpu.values()) / len(per_gpu), rel=1e-9)


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
@pytest.mark.parametrize("honor", [True, False])
def test_rendered_monitors_separate_the_endpoints(kind: str, honor: bool) -> None:
    """The rendered objects alone (no Prometheus needed): what the scrape test relies on."""
    values = {
        "monitoring": {
            "podMonitor": {"enabled": kind == "PodMonitor"},
            "serviceMonitor": {"enabled": kind == "ServiceMonitor"},
            "gpuMetrics": {"honorLabels": honor},
        }
    }
    result = render(values, kube_version=newest_supported(), api_versions=PROMETHEUS_OPERATOR)
    spec = result.one(kind)["spec"]
    endpoints = spec["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    by_path = {e["path"]: e for e in endpoints}
    assert set(by_path) == {"/metrics", "/gpu/metrics"}

    def endpoint_label(e: dict[str, Any]) -> str:
        [rule] = [r for r in e["relabelings"] if r.get("targetLabel") == "endpoint"]
        return str(rule["replacement"])

    assert endpoint_label(by_path["/metrics"]) == "metrics"
    assert endpoint_label(by_path["/gpu/metrics"]) == "gpu-metrics"
    assert by_path["/gpu/metrics"]["honorLabels"] is honor
    assert not by_path["/metrics"].get("honorLabels", False)
    drops = [r for r in by_path["/gpu/metrics"]["relabelings"] if r.get("action") == "labeldrop"]
    assert [d["regex"] for d in drops] == ["pod|namespace|container"]
    assert not any(r.get("action") == "labeldrop" for r in by_path["/metrics"]["relabelings"])
