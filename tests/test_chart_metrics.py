"""The dashboard and the alert rules use only metric names the agent really exports.

Names are checked against the agent's own registries (AgentMetrics and /gpu/metrics'
metric_names), so renaming a metric in the agent breaks this test until the chart follows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.serving import gpu_metrics
from tests.chart_render import (
    CHART,
    PROMETHEUS_OPERATOR,
    ROOT,
    load_values,
    newest_supported,
    render,
)

# Series a family of each type exposes (prometheus_client strips _total from counters).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "by", "without"}


def exported_series() -> set[str]:
    """Every series name the agent can expose on /metrics and /gpu/metrics."""
    names: set[str] = set()
    for family in AgentMetrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    for naming in ("prometheus", "dcgm"):
        names.update(gpu_metrics.metric_names(naming))
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels left out)."""
    text = _STRINGS.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {
        m.group(1)
        for m in _IDENT.finditer(text)
        if not m.group(2) and m.group(1).lower() not in _KEYWORDS
    }


def rule_exprs(values: dict[str, Any]) -> dict[str, str]:
    result = render(values, kube_version=newest_supported(), api_versions=PROMETHEUS_OPERATOR)
    rule = result.one("PrometheusRule")
    return {
        r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    }


def recording_rules(values: dict[str, Any]) -> dict[str, str]:
    """The series the chart's recording rules make, and their expressions."""
    result = render(values, kube_version=newest_supported(), api_versions=PROMETHEUS_OPERATOR)
    rule = result.one("PrometheusRule")
    return {
        r["record"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r
    }


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "gpuid-agent.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query["query"])
            assert match, f"unexpected variable query {query['query']}"
            exprs.append(match.group(1))
    return exprs


def unknown_names(exprs: Iterable[str], known: set[str]) -> dict[str, set[str]]:
    found = {expr: metric_names(expr) - known for expr in exprs}
    return {expr: names for expr, names in found.items() if names}


def test_extractor_finds_metric_names_and_nothing_else() -> None:
    expr = (
        'sum by (node, exporter) (rate(foo_total{job="a", x=~"b|c"}[5m])) / on (node) '
        "group_left (model) bar_info > 0.5 unless baz offset 1h or vector(0) and "
        'histogram_quantile(0.95, sum by (le) (rate(qux_bucket{a="{x}"}[5m]))) > 1e3'
    )
    assert metric_names(expr) == {"foo_total", "bar_info", "baz", "qux_bucket"}


def test_a_renamed_metric_is_caught() -> None:
    known = exported_series()
    assert "gpuid_export_failure_total" in known, "counter families expose _total"
    assert "gpuid_export_duration_seconds_bucket" in known, "histograms expose _bucket"
    assert "DCGM_FI_DEV_GPU_UTIL" in known, "dcgm naming of /gpu/metrics"
    renamed = "sum(rate(gpuid_export_failures_total[5m]))"
    assert unknown_names([renamed], known) == {renamed: {"gpuid_export_failures_total"}}


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) > 10
    # and the series the chart's recording rules make (accounting, on by default)
    assert unknown_names(exprs, exported_series() | set(recording_rules({}))) == {}


def test_recording_rules_use_only_exported_metrics() -> None:
    recorded = recording_rules({})
    assert "gpuid:workload_gpu_hours:increase1d" in recorded
    assert unknown_names(recorded.values(), exported_series()) == {}


def test_default_alert_rules_use_only_exported_metrics() -> None:
    exprs = rule_exprs({})
    assert {"GpuidExportsFailing", "GpuidGpuCountDropped"} <= set(exprs)
    assert unknown_names(exprs.values(), exported_series()) == {}


def test_rules_on_metrics_not_yet_exported_stay_off_by_default() -> None:
    every = rule_exprs(
        {
            "monitoring": {
                "prometheusRule": {
                    "spoolGrowing": {"enabled": True},
                    "labelsFailing": {"enabled": True},
                }
            }
        }
    )
    assert {"GpuidSpoolGrowing", "GpuidNodeLabelsFailing"} <= set(every)
    defaults = rule_exprs({})
    known = exported_series()
    for alert, expr in every.items():
        if metric_names(expr) - known:
            assert alert not in defaults, f"{alert} is on by default but uses unexported metrics"


def test_every_alert_has_a_runbook_entry() -> None:
    values = load_values(CHART / "values.yaml")
    rules = values["monitoring"]["prometheusRule"]
    optional = {
        k: {"enabled": True} for k, v in rules.items() if isinstance(v, dict) and "enabled" in v
    }
    alerts = rule_exprs({"monitoring": {"prometheusRule": optional}})
    runbook = Path(ROOT / "docs" / "operations.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", runbook, re.M))
    assert set(alerts) <= headings, set(alerts) - headings


@pytest.mark.parametrize("naming", ["prometheus", "dcgm"])
def test_gpu_panels_work_under_either_naming(naming: gpu_metrics.Naming) -> None:
    per_gpu = set(gpu_metrics.metric_names("prometheus")) | set(gpu_metrics.metric_names("dcgm"))
    gpu_exprs = [e for e in dashboard_exprs() if metric_names(e) & per_gpu]
    assert gpu_exprs
    for expr in gpu_exprs:
        assert metric_names(expr) & set(gpu_metrics.metric_names(naming)), (
            f"{expr} shows nothing under {naming} naming"
        )
