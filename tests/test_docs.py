"""The documentation stays true to the code: generated reference pages are current, and the
hand-written pages name only settings, modules and profiles that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuid_agent import docs
from gpuid_agent.runtime.config import Settings, env_name
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.simulate.profiles import PROFILES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OWN_PAGES = [
    "quickstart.md",
    "architecture.md",
    "operations.md",
    "migration.md",
    "security.md",
    "supply-chain.md",
    "configuration.md",
    "metrics.md",
]
REGENERATE = "out of date: run `python -m gpuid_agent.docs` (or `nox -s docs`) and commit"


@pytest.mark.parametrize("page", sorted(docs.PAGES))
def test_generated_reference_page_is_current(page: str) -> None:
    committed = (DOCS / page).read_text(encoding="utf-8")
    assert committed == docs.PAGES[page](), f"docs/{page} is {REGENERATE}"


def test_configuration_reference_covers_every_setting() -> None:
    page = docs.configuration_page()
    for name, field in Settings.model_fields.items():
        row = re.search(
            rf"^\| `{env_name(name)}` \| `--{name.replace('_', '-')}` \|.*$", page, re.M
        )
        assert row, f"{env_name(name)} missing"
        assert (field.description or "") in row.group(0)
    secret = re.search(r"^\| `POSTGRES_PASSWORD` .*$", page, re.M)
    assert secret
    assert "| secret |" in secret.group(0)
    interval = re.search(r"^\| `COLLECT_INTERVAL` .*$", page, re.M)
    assert interval
    assert "`10s`" in interval.group(0)


def test_metrics_reference_covers_every_series() -> None:
    page = docs.metrics_page()
    for family in AgentMetrics().registry.collect():
        series = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{series}`" in page, series
    for naming in ("prometheus", "dcgm"):
        for name in gpu_metrics.metric_names(naming):
            assert f"`{name}`" in page, name


def test_check_mode_finds_stale_and_missing_pages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert docs.main(["--check", str(tmp_path)]) == 1
    assert docs.main([str(tmp_path)]) == 0
    assert docs.main(["--check", str(tmp_path)]) == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text() + "\nhand edit\n")
    assert docs.main(["--check", str(tmp_path)]) == 1
    assert "metrics.md" in capsys.readouterr().err


def test_durations_are_shown_as_the_environment_accepts_them() -> None:
    from gpuid_agent.runtime.config import parse_duration

    for seconds in (0.25, 2.0, 30.0, 90.0, 600.0, 3600.0, 5400.0, 86400.0):
        assert parse_duration(docs.format_seconds(seconds)) == seconds


@pytest.mark.parametrize("page", OWN_PAGES)
def test_relative_links_resolve(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text):
        assert (DOCS / target).resolve().exists(), f"{page} links to missing {target}"


def test_architecture_module_map_names_real_modules() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    paths = set(re.findall(r"`(gpuid_agent/[\w/]+(?:\.py)?)`", text))
    assert len(paths) > 10
    for path in paths:
        assert (ROOT / path).exists(), f"architecture.md names {path}, which does not exist"


def test_quickstart_uses_existing_profiles_and_chart_values() -> None:
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    profiles = re.findall(r"--simulate[ =](\w+)", text)
    assert profiles
    assert set(profiles) <= set(PROFILES)
    assert "helm install" in text
    assert "charts/gpuid-agent" in text


def test_batching_defaults_are_the_same_in_code_chart_and_docs() -> None:
    """FLUSH_INTERVAL and BATCH_SIZE: one default, wherever an operator reads it."""
    from gpuid_agent.delivery.pipeline import BatchPolicy

    values = (ROOT / "charts" / "gpuid-agent" / "values.yaml").read_text(encoding="utf-8")
    exporters = (DOCS / "exporters" / "README.md").read_text(encoding="utf-8")
    configuration = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for env, key, code in (
        ("FLUSH_INTERVAL", "flushInterval", Settings.model_fields["flush_interval"].default),
        ("BATCH_SIZE", "batchSize", Settings.model_fields["batch_size"].default),
    ):
        policy = getattr(BatchPolicy(), env.lower())
        assert policy == code, f"BatchPolicy's {env} default differs from the setting's"
        shown = f"{code:g}s" if env == "FLUSH_INTERVAL" else str(code)
        chart = re.search(rf"^\s+{key}: (\S+)", values, re.M)
        assert chart and chart.group(1) == shown, f"chart {key} is not {shown}"
        for page, text in (("configuration.md", configuration), ("exporters", exporters)):
            row = re.search(rf"^\| `{env}` \|[^\n]*", text, re.M)
            # configuration.md: | `ENV` | `--flag` | `default` |; exporters: | `ENV` | `default` |
            cells = re.findall(r"`([^`]+)`", row.group(0)) if row else []
            assert shown in cells, f"{page} shows {env} default {cells}, not {shown}"
