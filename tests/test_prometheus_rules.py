"""The chart's PrometheusRule under `promtool`: lint clean, and every alert's unit tests pass.

The rule file is the PrometheusRule's spec as the chart renders it with every optional rule
on. Unit tests live in tests/promrules/*.test.yaml (promtool's format, `rule_files:
[rules.yaml]`); their series are the ones the agent emits (names, labels, the pace a failing
worker retries at) with the target labels the ServiceMonitor adds.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuid_agent.docs import metric_wrappers
from gpuid_agent.node.labels.policy import REASONS
from gpuid_agent.runtime.metrics import COLLECTION_ERROR_REASONS, DROP_REASONS, AgentMetrics
from gpuid_agent.serving.metrics_fields import metric_names
from tests.chart_render import CHART, PROMETHEUS_OPERATOR, load_values, newest_supported, render
from tests.servers import prometheus

UNIT_TESTS = sorted((Path(__file__).parent / "promrules").glob("*.test.yaml"))


@pytest.fixture(scope="module")
def promtool_ready() -> None:
    reason = prometheus.unavailable()
    if reason:
        pytest.skip(f"promtool needed: {reason}")


def every_rule_values() -> dict[str, Any]:
    rules = load_values(CHART / "values.yaml")["monitoring"]["prometheusRule"]
    optional = {
        k: {"enabled": True} for k, v in rules.items() if isinstance(v, dict) and "enabled" in v
    }
    return {"monitoring": {"prometheusRule": optional}}


def rule_spec() -> dict[str, Any]:
    result = render(
        every_rule_values(), kube_version=newest_supported(), api_versions=PROMETHEUS_OPERATOR
    )
    spec: dict[str, Any] = result.one("PrometheusRule")["spec"]
    return spec


def alerts() -> set[str]:
    return {r["alert"] for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    return tmp_path


def test_rules_lint_clean(promtool_ready: None, rules_dir: Path) -> None:
    done = prometheus.promtool(
        "check", "rules", "--lint=all", "--lint-fatal", "rules.yaml", cwd=rules_dir
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout, done.stdout


@pytest.mark.parametrize("unit", UNIT_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests(promtool_ready: None, rules_dir: Path, unit: Path) -> None:
    spec = yaml.safe_load(unit.read_text())
    assert spec["rule_files"] == ["rules.yaml"], f"{unit.name} must test the rendered rules"
    shutil.copy(unit, rules_dir / unit.name)
    done = prometheus.promtool("test", "rules", unit.name, cwd=rules_dir)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_unit_tests() -> None:
    tested: set[str] = set()
    for unit in UNIT_TESTS:
        for case in yaml.safe_load(unit.read_text()).get("tests", []):
            tested.update(a["alertname"] for a in case.get("alert_rule_test", []))
    assert alerts() - tested == set(), "alerts without promtool unit tests"


def test_a_failing_unit_test_fails(promtool_ready: None, rules_dir: Path) -> None:
    """The runner notices a wrong expectation (promtool exits non-zero)."""
    wrong = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'gpuid_nvml_up{namespace="n",pod="p",node="x"}', "values": "1x30"}
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "20m",
                        "alertname": "GpuidNvmlDown",
                        "exp_alerts": [{"exp_labels": {"severity": "critical"}}],
                    }
                ],
            }
        ],
    }
    (rules_dir / "wrong.test.yaml").write_text(yaml.safe_dump(wrong))
    done = prometheus.promtool("test", "rules", "wrong.test.yaml", cwd=rules_dir)
    assert done.returncode != 0
    assert "GpuidNvmlDown" in done.stdout + done.stderr


# Labels the ServiceMonitor's target (or the PodMonitor's) adds to /metrics series.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "node", "container", "endpoint", "service"}
_SERIES = re.compile(r"^([a-zA-Z_:][\w:]*)\{(.*)\}$")
_LABEL = re.compile(r'(\w+)="((?:\\.|[^"\\])*)"')
KNOWN_VALUES = {
    ("gpuid_dropped_records_total", "reason"): set(DROP_REASONS),
    ("gpuid_collection_errors_total", "reason"): set(COLLECTION_ERROR_REASONS),
    ("gpuid_label_reconcile_errors_total", "reason"): set(REASONS),
}


# /gpu/metrics families in our naming (the rules read those)
GPU_SERIES = frozenset(metric_names("prometheus"))


def input_series() -> Iterator[tuple[str, str]]:
    for unit in UNIT_TESTS:
        for case in yaml.safe_load(unit.read_text())["tests"]:
            for series in case.get("input_series", []):
                yield unit.name, series["series"]


def test_unit_tests_use_series_the_agent_emits() -> None:
    """Names, label names and label values as the agent exposes them (a rename breaks this)."""
    wrappers = metric_wrappers(AgentMetrics())
    exposed = {
        wrapper._name + ("_total" if wrapper._type == "counter" else ""): set(wrapper._labelnames)
        for wrapper in wrappers.values()
    }
    checked = 0
    for unit, series in input_series():
        match = _SERIES.match(series)
        assert match, f"{unit}: {series}"
        name, labels = match.group(1), dict(_LABEL.findall(match.group(2)))
        if name in GPU_SERIES:  # /gpu/metrics: its labels vary with the device and holders
            # accounting series are per workload, not per device
            device = set() if name.startswith(("gpuid_workload_", "gpuid_pod_")) else {"uuid"}
            assert {"node", *device} <= set(labels), f"{unit}: {series}"
            checked += 1
            continue
        assert name in exposed, f"{unit}: {name} is not a /metrics or /gpu/metrics series"
        assert set(labels) - TARGET_LABELS == exposed[name], f"{unit}: {series}"
        for (metric, label), known in KNOWN_VALUES.items():
            if name == metric:
                assert labels[label] in known, f"{unit}: {label}={labels[label]} never emitted"
        checked += 1
    assert checked >= 20
