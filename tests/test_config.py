from __future__ import annotations

import math
import os
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.runtime.config import Settings, parse_duration
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30),
        ("2.5", 2.5),
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        ("250ms", 0.25),
        (" 10S ", 10),
        (7, 7.0),
        (0.5, 0.5),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "", "10x", "-5", "5m-", "m5", "nan", "inf", "1e999", True])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@given(st.text(max_size=40))
def test_duration_parser_never_crashes(text: str) -> None:
    try:
        value = parse_duration(text)
    except ValueError:
        return
    assert math.isfinite(value) and value >= 0


@given(st.integers(0, 10**6), st.sampled_from(["s", "m", "h"]))
def test_duration_units_roundtrip(n: int, unit: str) -> None:
    assert parse_duration(f"{n}{unit}") == n * {"s": 1, "m": 60, "h": 3600}[unit]


def test_every_bad_variable_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_SIZE", "-1")
    monkeypatch.setenv("TIMEOUT", "abc")
    monkeypatch.setenv("SERVER_PORT", "70000")
    monkeypatch.setenv("EXPORTER_TYPE", "stdout,kafka")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert set(info.value.problems) == {"BATCH_SIZE", "TIMEOUT", "SERVER_PORT", "EXPORTER_TYPE"}
    assert "entry 2 is no exporter" in info.value.problems["EXPORTER_TYPE"]
    assert "kafka" not in str(info.value) and "abc" not in str(info.value)


def test_secret_value_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTGRES_PASSWORD", "hunter2")
    monkeypatch.setenv("POSTGRES_PORT", "not-a-port")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "hunter2" not in str(info.value)
    settings = load_settings({"postgres_port": 5432})
    assert settings.redacted()["postgres_password"] == "<redacted>"
    assert "hunter2" not in repr(settings)


def test_exporter_requirements_are_cross_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTER_TYPE", "http, postgres ,s3")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert set(info.value.problems) == {"HTTP_ENDPOINT", "POSTGRES_HOST", "S3_BUCKET"}


def test_gpuid_defaults_and_cli_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_SIZE", "50")
    s = load_settings()
    assert (s.batch_size, s.retry_count, s.timeout, s.server_port) == (50, 2, 30.0, 8080)
    assert s.exporter_type == ["stdout"]
    assert s.heartbeat_interval == 3600
    assert load_settings({"batch_size": "7"}).batch_size == 7


@pytest.mark.parametrize("table", ["readings; drop table x", "1abc", "a.b.c", "x" * 64])
def test_postgres_table_must_be_an_identifier(table: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"postgres_table": table})
    assert "POSTGRES_TABLE" in info.value.problems


def test_simulation_profiles_match_the_simulator() -> None:
    from gpuid_agent.runtime.config import SIMULATION_GPUS, SIMULATION_PROFILES
    from gpuid_agent.simulate.profiles import PROFILES

    assert set(SIMULATION_PROFILES) == set(PROFILES)
    assert {name: len(make("node-a")) for name, make in PROFILES.items()} == SIMULATION_GPUS


@pytest.mark.parametrize(("profile", "gpu", "ok"), [("gb200x4", 3, True), ("gb200x4", 4, False),
                                                    ("h100x8", 7, True), ("mig", 2, False)])  # fmt: skip
def test_faults_name_gpus_the_profile_has(profile: str, gpu: int, ok: bool) -> None:
    overrides = {"simulate": profile, "fault": f"thermal:gpu{gpu}"}
    if ok:
        assert load_settings(overrides).fault == [f"thermal:gpu{gpu}"]
        return
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    assert f"entry 1 names GPU {gpu}" in info.value.problems["FAULT"]


def test_a_bad_value_does_not_hide_the_cross_checks() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"exporter_type": "http,postgres,s3", "timeout": "soon"})
    assert set(info.value.problems) == {"TIMEOUT", "HTTP_ENDPOINT", "POSTGRES_HOST", "S3_BUCKET"}
    assert "\n" not in str(info.value)
    # a FAULT is not blamed for a SIMULATE that is itself wrong
    with pytest.raises(ConfigError) as info:
        load_settings({"simulate": "gb300", "fault": "lost:gpu1"})
    assert set(info.value.problems) == {"SIMULATE"}


def test_unknown_simulation_profile_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"simulate": "gb300x9"})
    assert "gb200x4" in info.value.problems["SIMULATE"]


def test_http_files_that_work_pass_the_start_checks(tmp_path: Path) -> None:
    from tests.servers.tls import make_ca_and_server

    ca, _ = make_ca_and_server(tmp_path)
    token = tmp_path / "token"
    token.write_text("t0k\n")
    s = load_settings(
        {
            "exporter_type": "http",
            "http_endpoint": "https://127.0.0.1:9/x?api_key=k",
            "http_auth_token_file": str(token),
            "http_ca_bundle": str(ca),
            "server_address": "localhost",
        }
    )
    assert s.http_ca_bundle == str(ca)
    # URL credentials alone are fine; with a token they are refused
    assert load_settings({"exporter_type": "http", "http_endpoint": "https://u:p@h/x"})
    with pytest.raises(ConfigError) as info:
        load_settings(
            {
                "exporter_type": "http",
                "http_endpoint": "https://u:p@h/x",
                "http_auth_token_file": str(token),
            }
        )
    assert set(info.value.problems) == {"HTTP_ENDPOINT"}
    assert "u:p" not in str(info.value)


def test_http_files_are_checked_only_for_the_http_exporter(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert load_settings({"http_auth_token_file": missing, "http_ca_bundle": missing})
    with pytest.raises(ConfigError) as info:
        load_settings(
            {
                "exporter_type": "stdout,http",
                "http_endpoint": "http://127.0.0.1:9/",
                "http_auth_token_file": missing,
                "http_ca_bundle": missing,
            }
        )
    assert set(info.value.problems) == {"HTTP_AUTH_TOKEN_FILE", "HTTP_CA_BUNDLE"}
    assert all("cannot read" in why and missing not in why for why in info.value.problems.values())


def test_redacted_config_hides_endpoint_credentials() -> None:
    s = load_settings(
        {
            "exporter_type": "http",
            "http_endpoint": "https://u:pw@h.example/x?api_key=k3y",
            "s3_endpoint_url": "http://AK:SK@127.0.0.1:9000",
        }
    )
    shown = s.redacted()
    assert shown["http_endpoint"] == "https://<redacted>@h.example/x?api_key=<redacted>"
    assert shown["s3_endpoint_url"] == "http://<redacted>@127.0.0.1:9000"
    assert s.http_endpoint.endswith("k3y")  # the value itself is untouched


_SECRETISH = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=","),
    min_size=8,
    max_size=40,
).filter(lambda v: v.strip() == v and not v.isdigit())


@settings(max_examples=120, deadline=None)
@given(field=st.sampled_from(sorted(Settings.model_fields)), value=_SECRETISH)
def test_no_invalid_value_is_ever_echoed(field: str, value: str) -> None:
    """Any setting given a secret-looking value it cannot take: the error names the variable
    and says what is wrong, and the value appears nowhere in it."""
    error: ConfigError | None = None
    with mock.patch.dict(os.environ, {field.upper(): value}):
        try:
            load_settings()
        except ConfigError as exc:
            error = exc
    if error is not None:
        assert field.upper() in error.problems
        assert value.lower() not in str(error).lower()
