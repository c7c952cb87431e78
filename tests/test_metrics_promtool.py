"""`promtool check metrics` on a simulated agent's /metrics and /gpu/metrics, both namings.

Prometheus naming is clean but for the deprecated `gpuid_gpu_count` alias (kept one release,
said in docs/metrics.md). dcgm naming keeps dcgm-exporter's names, labels and types for its
DCGM_* families (camelCase labels, counters without `_total`, which promtool flags); our own
gpuid_* families stay clean there too. No `_created` series unless asked.
"""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.runtime.metrics import DEPRECATED_ALIASES
from gpuid_agent.serving.metrics_fields import FIELDS
from tests.conftest import running_agent, serves, settings
from tests.servers import prometheus
from tests.waiting import eventually

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(scope="module")
def promtool_ready() -> None:
    reason = prometheus.unavailable()
    if reason:
        pytest.skip(f"promtool needed: {reason}")


@asynccontextmanager
async def scraping(**overrides: Any) -> AsyncIterator[Any]:
    agent = Agent(
        settings(simulate="h100x8", **overrides), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent) as running, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{running.bound_port}"

        async def get(path: str, accept: str = "") -> tuple[str, str]:
            headers = {"Accept": accept} if accept else {}
            async with http.get(base + path, headers=headers) as resp:
                return resp.headers["Content-Type"], await resp.text()

        # the first page with the kubelet's holders (its first poll may come after a render)
        await eventually(lambda: serves(running, b"gpuid_gpu_allocation_info{"))
        yield get


def findings(text: str) -> list[tuple[str, str]]:
    """(metric, problem) per line promtool reports; empty when clean."""
    done = prometheus.promtool("check", "metrics", stdin=text)
    out = (done.stdout + done.stderr).strip()
    if done.returncode == 0:
        return []
    found = []
    for line in out.splitlines():
        name, _, problem = line.partition(" ")
        found.append((name, problem))
    assert found, out
    return found


async def test_prometheus_naming_is_promtool_clean(promtool_ready: None) -> None:
    async with scraping() as get:
        _, gpu = await get("/gpu/metrics")
        _, own = await get("/metrics")
    assert "gpuid_gpu_power_watts{" in gpu and "gpuid_gpu_allocation_info{" in gpu
    assert findings(gpu) == []
    assert {name for name, _ in findings(own)} == set(DEPRECATED_ALIASES)
    assert "gpuid_gpus 8.0" in own and "gpuid_gpu_count 8.0" in own


async def test_dcgm_naming_flags_only_dcgm_exporters_own_names(promtool_ready: None) -> None:
    async with scraping(metrics_naming="dcgm") as get:
        content_type, gpu = await get("/gpu/metrics", accept=OPENMETRICS)
    # served as text, as dcgm-exporter is: its counters have no _total suffix
    assert content_type.startswith("text/plain; version=0.0.4")
    found = findings(gpu)
    assert found, "dcgm-exporter's camelCase labels are expected to be flagged"
    assert {name for name, _ in found if not name.startswith("DCGM_FI_")} == set()
    counters = {f.dcgm_name for f in FIELDS if f.dcgm_counter}
    assert {
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    } <= counters
    for name in counters:
        if f"\n{name}{{" in gpu:
            assert f"# TYPE {name} counter\n" in gpu, name
    assert "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n" in gpu
    # our own families under dcgm naming: snake_case labels
    holders = re.search(r"^gpuid_gpu_holders\{([^}]*)\}", gpu, re.M)
    assert holders and 'uuid="GPU-' in holders.group(1) and "UUID" not in holders.group(1)


@pytest.mark.parametrize("created", [False, True])
async def test_created_series_only_when_asked(created: bool) -> None:
    async with scraping(metrics_created_series=created) as get:
        _, text = await get("/metrics")
        content_type, om = await get("/metrics", accept=OPENMETRICS)
        _, gpu = await get("/gpu/metrics", accept=OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    samples = [s.name for f in parse_om(om) for s in f.samples]
    assert "gpuid_export_success_total" in samples
    with_created = [n for n in samples if n.endswith("_created")]
    assert bool(with_created) is created
    assert ("_created" in text) is created
    assert "gpuid_gpu_energy_joules_total{" in gpu and "_created" not in gpu
