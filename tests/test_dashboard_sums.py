"""No panel of the chart's dashboard counts a GPU twice.

dcgm naming repeats every telemetry series per pod holding the GPU (dcgm-exporter's layout),
and in either naming a MIG GPU has a series of its own plus one per instance. A sum or an
average over GPU series must first keep one series per whole GPU: `max by (…, uuid)` (or
`UUID`) over the series without a GPU instance id. Maxima and minima need nothing.
The same panels are evaluated on a real Prometheus in tests/test_prometheus_operator.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from gpuid_agent.serving.metrics_fields import FIELDS
from tests.test_chart_metrics import dashboard_exprs

TELEMETRY = {f.prom_name for f in FIELDS} | {f.dcgm_name for f in FIELDS}
_IDEMPOTENT = {"max", "min"}
_AGGREGATION = re.compile(
    r"\b(sum|avg|count|max|min|group|stddev|stdvar|quantile|topk|bottomk|count_values)\s*"
    r"(?:(by|without)\s*\(([^)]*)\))?\s*$"
)
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"')


@dataclass(frozen=True)
class Aggregation:
    op: str
    labels: frozenset[str]


def _enclosing(expr: str, position: int) -> list[Aggregation]:
    """Aggregations around `position`, innermost first (functions are skipped)."""
    masked = _STRINGS.sub(lambda m: " " * len(m.group()), expr)
    found: list[Aggregation] = []
    depth = 0
    for i in range(position - 1, -1, -1):
        char = masked[i]
        if char == ")":
            depth += 1
        elif char == "(":
            if depth:
                depth -= 1
                continue
            match = _AGGREGATION.search(masked[:i])
            if match:
                labels = frozenset(x.strip() for x in (match.group(3) or "").split(",") if x)
                found.append(Aggregation(match.group(1), labels))
    return found


def double_counts(expr: str) -> list[str]:
    """The GPU selectors of `expr` that a sum or average would count more than once."""
    problems = []
    for match in re.finditer(r"\b([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name not in TELEMETRY:
            continue
        chain = _enclosing(expr, match.start())
        if all(a.op in _IDEMPOTENT for a in chain):
            continue
        first = chain[0]
        one_per_gpu = first.op in _IDEMPOTENT and first.labels & {"uuid", "UUID"}
        whole_gpus = re.search(r'\b(gpu_instance_id|GPU_I_ID)\s*=\s*""', matchers)
        if not (one_per_gpu and whole_gpus):
            problems.append(name)
    return problems


@pytest.mark.parametrize(
    "expr",
    [
        'sum by (node) (gpuid_gpu_power_watts{node=~"$node"} or DCGM_FI_DEV_POWER_USAGE)',
        'avg by (node) (DCGM_FI_DEV_GPU_UTIL{node=~"$node"} / 100)',
        "sum(max by (node) (DCGM_FI_DEV_FB_USED))",  # one per node, not per GPU
        'sum(max by (UUID) (DCGM_FI_DEV_FB_USED{pod!=""}))',  # MIG instances and the parent
        "sum(DCGM_FI_DEV_POWER_USAGE) by (node)",
    ],
)
def test_the_check_catches_double_counting(expr: str) -> None:
    assert double_counts(expr)


@pytest.mark.parametrize(
    "expr",
    [
        'sum by (node) (max by (node, UUID) (DCGM_FI_DEV_POWER_USAGE{GPU_I_ID=""}))',
        "max by (node) (gpuid_gpu_temperature_celsius or DCGM_FI_DEV_GPU_TEMP)",
        'sum(rate(gpuid_records_emitted_total{kind="reading"}[5m]))',
    ],
)
def test_the_check_accepts_one_series_per_gpu(expr: str) -> None:
    assert double_counts(expr) == []


def test_no_dashboard_panel_double_counts_a_shared_gpu() -> None:
    exprs = dashboard_exprs()
    gpu_exprs = [e for e in exprs if any(re.search(rf"\b{n}\b", e) for n in TELEMETRY)]
    assert len(gpu_exprs) >= 4
    assert {e: double_counts(e) for e in gpu_exprs if double_counts(e)} == {}
