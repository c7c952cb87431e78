"""`gpuid-agent history` as a person meets it (the real CLI in a subprocess), each command's
flags, and the parsers of what a person or a file hands it, with hostile input."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuid_agent.history import times
from gpuid_agent.history.records_dir import RecordsDirectory
from gpuid_agent.history.source import Where
from gpuid_agent.records.serialize import json_lines
from gpuid_agent.runtime.config import Settings
from tests.conftest import free_port
from tests.history_support import fleet

AGENT = [sys.executable, "-m", "gpuid_agent"]


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(AGENT + args, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def records(tmp_path: Path) -> Path:
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "agent.jsonl").write_bytes(json_lines(fleet()))
    return folder


def one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gpuid-agent: ")
    return lines[0]


def flags(help_text: str) -> set[str]:
    import re

    return set(re.findall(r"--[a-z0-9-]+", help_text))


def test_each_command_takes_only_the_settings_it_reads(subprocess_env: dict[str, str]) -> None:
    every = {f"--{name.replace('_', '-')}" for name in Settings.model_fields}
    inventory = _run(["inventory", "--help"], subprocess_env).stdout
    assert flags(inventory) & every == {"--nvml-library-path", "--simulate", "--fault",
                                        "--node-name"}  # fmt: skip
    assert len(inventory.splitlines()) < 45
    clear = _run(["health", "clear", "--help"], subprocess_env).stdout
    assert flags(clear) & every == {"--state-dir"}
    history = _run(["history", "gpu", "--help"], subprocess_env).stdout
    taken = flags(history) & every
    assert taken and all(f.startswith(("--postgres-", "--s3-")) for f in taken)
    assert "--postgres-auto-migrate" not in taken and "--records" in flags(history)
    run = _run(["run", "--help"], subprocess_env).stdout
    assert flags(run) >= every  # every setting, as ever
    for heading in ("PostgreSQL exporter:", "S3 exporter:", "OTLP exporter:", "Health:"):
        assert heading in run
    assert "docs/configuration.md" in run


def test_a_variable_for_another_command_neither_applies_nor_stops_history(
    records: Path, subprocess_env: dict[str, str]
) -> None:
    env = subprocess_env | {"BATCH_SIZE": "-1", "EXPORTER_TYPE": "postgres"}
    done = _run(["history", "gpu", "SN-A", "--records", str(records), "--json"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["subject"] == "SN-A"
    assert "BATCH_SIZE" in one_line(_run(["check-config"], env), 2)


def test_not_found_is_one_line_and_exit_1(records: Path, subprocess_env: dict[str, str]) -> None:
    for question, expected in (
        (["gpu", "SN-NONE"], "GPU serial SN-NONE"),
        (["node", "gpu-9", "--at", "2025-03-01T12:00"], "node gpu-9"),
        (["pod", "ml/nobody"], "pod ml/nobody"),
    ):
        line = one_line(_run(["history", *question, "--records", str(records)], subprocess_env), 1)
        assert expected in line


def test_a_database_that_does_not_answer_names_the_settings(
    subprocess_env: dict[str, str],
) -> None:
    env = subprocess_env | {
        "POSTGRES_HOST": "127.0.0.1",
        "POSTGRES_PORT": str(free_port()),  # nothing listens there
        "POSTGRES_PASSWORD": "pw-s3cret-value",
        "POSTGRES_SSLMODE": "disable",
    }
    done = _run(["history", "gpu", "SN-A"], env)
    line = one_line(done, 4)
    assert "POSTGRES_HOST" in line and "POSTGRES_PORT" in line
    assert "pw-s3cret-value" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["history", "node", "gpu-1", "--at", "tomorrow"], "--at"),
        (["history", "usage", "--since", "2025-03-01T10:30"], "--since"),
        (["history", "usage", "--since", "2025-03-02", "--until", "2025-03-01"], "--until"),
        (["history", "usage", "--by", "team"], "--teams"),
        (["history", "pod", "no-slash"], "NAMESPACE/NAME"),
        (["history", "gpu", "SN-A", "--tz", "Mars/Olympus"], "--tz"),
    ],
)
def test_bad_arguments_name_what_to_fix(
    args: list[str], named: str, records: Path, subprocess_env: dict[str, str]
) -> None:
    assert named in one_line(_run([*args, "--records", str(records)], subprocess_env), 2)


def test_no_source_says_where_records_can_be(subprocess_env: dict[str, str]) -> None:
    line = one_line(_run(["history", "gpu", "SN-A"], subprocess_env), 2)
    assert "--records" in line and "POSTGRES_HOST" in line and "S3_BUCKET" in line


def test_times_in_the_zone_asked_for(records: Path, subprocess_env: dict[str, str]) -> None:
    base = ["history", "pod", "ml/train-0", "--records", str(records)]
    table = _run([*base, "--tz", "Europe/Berlin"], subprocess_env)
    assert table.returncode == 0, table.stderr
    assert "2025-03-01 11:00:00+01:00" in table.stdout  # 10:00 UTC
    utc = _run(base, subprocess_env)
    assert "2025-03-01 10:00:00Z" in utc.stdout
    body = json.loads(_run([*base, "--json", "--tz=-05:00"], subprocess_env).stdout)
    assert body["allocations"][0]["started_at"] == "2025-03-01T05:00:00.000-05:00"
    # a time given without an offset is in --tz too: 11:00 in Berlin is 10:00 UTC
    at = ["history", "node", "gpu-1", "--at", "2025-03-01T11:00", "--tz", "Europe/Berlin"]
    node = json.loads(_run([*at, "--records", str(records), "--json"], subprocess_env).stdout)
    assert node["at"] == "2025-03-01T11:00:00.000+01:00"
    assert {a["pod"] for a in node["allocations"]} == {"train-0"}


def test_csv_and_html_outputs(records: Path, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    base = ["history", "gpu", "SN-A", "--records", str(records)]
    rows = list(csv.DictReader(io.StringIO(_run([*base, "--csv"], subprocess_env).stdout)))
    assert [r["record"] for r in rows].count("allocation") == 3
    assert {r["record"] for r in rows} == {"placement", "allocation", "event"}
    page = tmp_path / "sn-a.html"
    done = _run([*base, "--html", str(page)], subprocess_env)
    html = page.read_text()
    assert done.returncode == 0 and html.count('class="alloc') == 3
    # one row for SN-A under each node; the replacement mark on it, not on the newcomer's
    assert html.count('<g class="gpu-row" data-serial="SN-A"') == 2
    assert html.count('class="gpu-row"') == 2 and html.count('data-kind="replaced"') == 1
    usage = _run(["history", "usage", "--since", "2025-03-01", "--until", "2025-03-02",
                  "--records", str(records), "--csv"], subprocess_env)  # fmt: skip
    assert usage.stdout.splitlines()[0] == "namespace,gpu_hours,kwh"


# ---- parsers, with hostile input -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
@example("2025-02-30")
@example("9999-12-31T23:59:59+14:00")
@example("0001-01-01T00:00:00-23:59")
@example("2025-03-01T12:00:00.1234567Z")
@example("0001-01-01T00:00:00+01:00")
def test_a_time_is_read_or_refused_never_crashes(text: str) -> None:
    moment = _parsed(text)
    assert moment is None or moment.tzinfo is UTC


def _parsed(text: str) -> datetime | None:
    try:
        return times.parse(text, UTC, datetime(2025, 3, 1, tzinfo=UTC))
    except ValueError as exc:
        assert "is no time" in str(exc)  # noqa: PT017 - the refusal says what was expected
        return None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
@example("+99:00")
@example("../../etc/passwd")
def test_a_zone_is_read_or_refused(text: str) -> None:
    with contextlib.suppress(ValueError):  # anything else fails the test
        assert times.zone(text) is not None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_field = st.sampled_from(["kind", "read_time", "gpu", "node", "allocation_id", "event",
                          "started_at", "ended_at", "usage_start", "gpu_seconds", "record_id",
                          "pci_bus_id", "change", "check", "reason", "old_serial"])  # fmt: skip
_record = st.fixed_dictionaries(
    {"kind": st.sampled_from(["reading", "allocation", "health", "hardware", "other"])},
    optional={"read_time": st.sampled_from(["2025-03-01T10:00:00.000Z", "nope", "2025-02-30T00:00Z"])},
).flatmap(lambda base: st.dictionaries(_field, _json, max_size=6).map(lambda extra: {**extra, **base}))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(_record.map(lambda r: json.dumps(r).encode()), st.binary(max_size=40)),
                max_size=12))
def test_hostile_lines_are_skipped_or_read_never_fatal(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "r.jsonl").write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
        source = RecordsDirectory(tmp)
        source.sightings(Where(serial="x"))
        source.holdings(Where(node="n", since=None, until=None))
        source.marks(Where(node="n"))
        source.usage(datetime(2025, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC), None)
        assert 0 <= source.skipped <= len(lines)
