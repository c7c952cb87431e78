"""The OpenTelemetry environment variables: parsing, precedence, exit 2, no secret echoed."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.otlp import OtlpExporter
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.runtime.otel_env import (
    RESERVED_HEADERS,
    logs_endpoint,
    parse_headers,
    parse_key_values,
)
from gpuid_agent.setup.delivery import make_exporters
from tests.chart_render import agent_container, render

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
keys = st.text(TOKEN_CHARS, min_size=1, max_size=20)


@pytest.mark.parametrize(
    ("base", "logs", "url"),
    [
        ("http://collector:4318", "", "http://collector:4318/v1/logs"),
        ("http://collector:4318/", "", "http://collector:4318/v1/logs"),
        ("https://gw.example/otlp", "", "https://gw.example/otlp/v1/logs"),
        ("http://collector:4318", "http://other:4318/custom", "http://other:4318/custom"),
        ("", "http://other:4318/custom", "http://other:4318/custom"),
    ],
)
def test_logs_endpoint(base: str, logs: str, url: str) -> None:
    assert logs_endpoint(base, logs) == url


def test_headers_are_url_decoded_and_trimmed() -> None:
    assert parse_headers(" api-key = a%2Cb%3Dc%20d , ,x-tenant=t1,") == {
        "api-key": "a,b=c d",
        "x-tenant": "t1",
    }
    assert parse_headers("") == {}


@pytest.mark.parametrize(
    "text",
    [
        "novalue",
        "=s3cret",
        "bad key=s3cret",
        "k=%ff%fes3cret",
        "k=s3cret%0d%0aInjected: 1",
        "Content-Type=text/s3cret",
    ],
)
def test_bad_headers_raise_without_quoting_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=r"entry|header") as info:
        parse_headers(text)
    assert "s3cret" not in str(info.value)


@given(st.dictionaries(keys, st.text(max_size=40).filter(lambda v: v.isprintable()), max_size=8))
def test_header_lists_roundtrip(headers: dict[str, str]) -> None:
    headers = {k: v for k, v in headers.items() if k.lower() not in RESERVED_HEADERS}
    # a key differing only in case is a separate entry here; HTTP merges them, we keep both
    text = ",".join(f"{k}={quote(v, safe='')}" for k, v in headers.items())
    assert parse_headers(text) == headers
    assert parse_key_values(text) == headers


@given(st.text(max_size=100), st.text(max_size=100))
def test_header_errors_never_quote_a_value(before: str, after: str) -> None:
    text = f"{before},k=\u2603hidden%0A,{after}"  # this entry is always refused
    with pytest.raises(ValueError, match=r"^(entry|header) \w") as info:
        parse_headers(text)
    assert "\u2603" not in str(info.value)  # errors name positions and keys, never values


@given(st.text(max_size=200))
def test_header_parser_takes_any_input(text: str) -> None:
    try:
        parsed = parse_headers(text)
    except ValueError:
        return  # refused as a whole: the agent exits 2 naming the variable
    for key, value in parsed.items():
        assert key.isascii() and key.strip() == key and not {",", "=", " "} & set(key)
        assert not any(c in value for c in "\r\n\x00")
        assert key.lower() not in RESERVED_HEADERS


def test_the_logs_signal_settings_come_first() -> None:
    settings = load_settings(
        {
            "exporter_type": "otlp",
            "otel_exporter_otlp_endpoint": "http://127.0.0.1:4318",
            "otel_exporter_otlp_headers": "a=1,b=2",
            "otel_exporter_otlp_logs_headers": "b=3",
            "otel_exporter_otlp_timeout": "2500",
            "otel_exporter_otlp_compression": "none",
            "otel_exporter_otlp_logs_compression": "gzip",
            "otel_resource_attributes": "deployment.environment.name=prod%20east",
        }
    )
    (exporter,) = make_exporters(settings)
    assert isinstance(exporter, OtlpExporter)
    assert exporter.endpoint == "http://127.0.0.1:4318/v1/logs"
    assert exporter.http.headers == {"a": "1", "b": "3"}
    assert exporter.http.timeout == 2.5
    assert exporter.http.gzip_body
    assert exporter._resource == {"deployment.environment.name": "prod east"}
    logs = load_settings(
        {
            "exporter_type": "otlp",
            "otel_exporter_otlp_logs_endpoint": "http://127.0.0.1:9/x",
            "otel_exporter_otlp_logs_timeout": 100,
        }
    )
    (exporter,) = make_exporters(logs)
    assert isinstance(exporter, OtlpExporter)
    assert (exporter.endpoint, exporter.http.timeout, exporter.http.headers) == (
        "http://127.0.0.1:9/x",
        0.1,
        {},
    )


def test_every_bad_otlp_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "EXPORTER_TYPE": "otlp",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=sekrit-value,broken",
        "OTEL_EXPORTER_OTLP_LOGS_HEADERS": "k=%zzsekrit2%0a",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "10s",
        "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "0",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_RESOURCE_ATTRIBUTES": "=x",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    # one message names them all: the type errors, and the cross-checks run with each
    # mistyped value at its default
    assert set(info.value.problems) == {
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
        "OTEL_RESOURCE_ATTRIBUTES",
    }
    assert "sekrit" not in str(info.value)


def test_otlp_needs_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTER_TYPE", "stdout,otlp")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert set(info.value.problems) == {"OTEL_EXPORTER_OTLP_ENDPOINT"}


def test_cli_exits_2_and_redacts_headers(subprocess_env: dict[str, str]) -> None:
    agent = [sys.executable, "-m", "gpuid_agent", "check-config"]
    env = subprocess_env | {
        "EXPORTER_TYPE": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0k3n-value",
    }
    good = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["otel_exporter_otlp_headers"] == "<redacted>"
    assert "t0k3n-value" not in good.stdout + good.stderr
    env["OTEL_EXPORTER_OTLP_HEADERS"] += ",oops"
    bad = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "OTEL_EXPORTER_OTLP_HEADERS" in bad.stderr
    assert "t0k3n-value" not in bad.stdout + bad.stderr


def test_chart_pushes_metrics_without_the_log_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    result = render(
        {
            "exporters": {
                "otlp": {
                    "endpoint": "http://otel-collector.observability:4318",
                    "metrics": {"enabled": True, "intervalMs": 15000},
                    "headers": {"secretName": "otlp-auth"},
                }
            }
        }
    )
    env = {e["name"]: e for e in agent_container(result.one("DaemonSet"))["env"]}
    assert env["EXPORTER_TYPE"]["value"] == "stdout"
    assert env["OTEL_METRICS_EXPORTER"]["value"] == "otlp"
    assert env["OTEL_METRIC_EXPORT_INTERVAL"]["value"] == "15000"
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"] == {
        "name": "otlp-auth",
        "key": "headers",
    }
    for name, entry in env.items():
        if "value" in entry:
            monkeypatch.setenv(name, entry["value"])
    settings = load_settings({"node_name": "n"})
    assert settings.otel_metrics_exporter == "otlp"
    assert settings.otel_exporter_otlp_endpoint == "http://otel-collector.observability:4318"
