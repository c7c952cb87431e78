"""The XID catalogue as data: complete, judged, safe against hostile codes, documented, and
repeats escalate."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent import docs
from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.sources.nvml.signals import XidEvent
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import ACTIONS
from gpuid_agent.state.health.xid import (
    CATALOG,
    CATALOG_FILE,
    XID_TABLE,
    XidDetail,
    classify_xid,
    escalate,
    judge_xid,
    parse_catalog,
)
from tests import fakenvml
from tests.conftest import node_health, settings
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on
from tests.waiting import eventually

DOCS = Path(__file__).resolve().parent.parent / "docs"
RAW = resources.files("gpuid_agent.state.health").joinpath(CATALOG_FILE).read_text("utf-8")
BUCKETS = sorted(json.loads(RAW)["buckets"])


def hex_digests(*lengths: int) -> st.SearchStrategy[str]:
    """Hex strings of these lengths, lower case or not: digests and near misses."""
    return st.sampled_from(lengths).flatmap(
        lambda n: (
            st.text("0123456789abcdef", min_size=n, max_size=n)
            | st.text("0123456789abcdefABCDEF", min_size=n, max_size=n)
        )
    )


def test_every_code_nvidia_lists_is_there_with_its_source_and_date() -> None:
    assert sorted(CATALOG.entries) == list(range(1, 174))
    assert "docs.nvidia.com/deploy/xid-errors" in CATALOG.source
    assert datetime.strptime(CATALOG.retrieved, "%Y-%m-%d")
    assert CATALOG.source_version and CATALOG.retrieved in CATALOG.source_version
    # what it was checked against: a named file at a commit, with that file's digest
    assert CATALOG.source_file.endswith("/nvidia/xid/catalog_generated.go")
    assert re.fullmatch(r"[0-9a-f]{40}", CATALOG.source_commit)
    assert re.fullmatch(r"[0-9a-f]{64}", CATALOG.source_file_sha256)
    for entry in CATALOG.entries.values():
        assert entry.mnemonic and entry.description and entry.category
        assert set(entry.applies_to) <= {"A100", "H100", "B100", "GB200"}
        # no bucket in the catalogue: the agent's own judgement must say why
        assert entry.immediate is not None or entry.override


@pytest.mark.parametrize(
    ("code", "bucket", "state", "action", "latched"),
    [
        (13, "RESTART_APP", "degraded", "check_workload", False),
        (31, "RESTART_APP", "degraded", "check_workload", False),
        (43, "IGNORE", "healthy", "none", False),
        (45, "WORKFLOW_XID_45", "healthy", "none", False),
        (48, "WORKFLOW_XID_48", "unhealthy", "reboot", True),
        (54, "CHECK_MECHANICALS", "unhealthy", "hardware_inspection", True),
        (74, "WORKFLOW_NVLINK_ERR", "unhealthy", "reboot", True),
        (79, "RESTART_BM", "unhealthy", "reboot", True),
        (94, "RESTART_APP", "degraded", "check_workload", False),
        (95, "RESET_GPU", "unhealthy", "reset", True),
        (119, "RESET_GPU", "unhealthy", "reset", True),
        (64, "RESET_GPU", "unhealthy", "reset", True),  # reset first, as NVIDIA says
        (63, "IGNORE", "healthy", "none", False),  # the remapped_rows check owns it
        (145, "WORKFLOW_NVLINK5_ERR", "degraded", "none", False),  # without its subcode
        (154, "XID_154", "healthy", "none", False),  # the recovery check carries it
        (1, "CONTACT_SUPPORT", "degraded", "hardware_inspection", False),  # unused
    ],
)
def test_the_bucket_decides_the_judgement(
    code: int, bucket: str, state: str, action: str, latched: bool
) -> None:
    cls = classify_xid(code)
    assert (cls.bucket, cls.state, cls.action, cls.latched) == (bucket, state, action, latched)
    assert cls.known and cls.code == code


def test_where_the_agent_differs_from_the_bucket_it_says_why() -> None:
    overridden = {c: e for c, e in CATALOG.entries.items() if e.override}
    assert {92, 154, 173} <= set(overridden) and not {63, 64} & set(overridden)
    assert all(len(e.override or "") > 20 for e in overridden.values())
    assert "remapped_rows" in (CATALOG.entries[63].note or "")
    assert "remapped_rows" in (CATALOG.entries[64].note or "")


@pytest.mark.parametrize("code", range(144, 151))
def test_nvlink5_xids_without_their_subcode_say_read_the_kernel_log(code: int) -> None:
    plain = judge_xid(code)
    assert (plain.state, plain.action, plain.latched) == ("degraded", "none", False)
    assert plain.name.endswith("check the kernel log for its subcode")
    fatal = judge_xid(code, XidDetail(subcode=2, bucket="RESET_GPU"))
    assert (fatal.state, fatal.action, fatal.latched) == ("unhealthy", "reset", True)
    ignore = judge_xid(code, XidDetail(subcode=4, bucket="IGNORE"))
    assert ignore.state == "healthy"
    unknown = judge_xid(code, XidDetail(subcode=9, bucket="NOT_A_BUCKET"))
    assert unknown.state == "degraded" and "kernel log" in unknown.name


def test_xid_154_falls_back_to_its_bucket_where_the_driver_lacks_the_recovery_field() -> None:
    assert judge_xid(154).state == "healthy"
    fallback = judge_xid(154, recovery_field=False)
    assert (fallback.state, fallback.action, fallback.latched) == ("unhealthy", "reboot", True)
    assert judge_xid(79, recovery_field=False) is classify_xid(79)


@pytest.mark.parametrize(
    ("key", "length"), [("source_commit", 40), ("source_file_sha256", 64), ("source_file", 0)]
)
@given(
    value=st.one_of(
        st.none(), st.integers(), st.text(max_size=70), hex_digests(39, 40, 41, 63, 64, 65)
    )
)
def test_the_source_file_must_be_named_with_its_commit_and_digest(
    key: str, length: int, value: object
) -> None:
    doc = json.loads(RAW)
    doc[key] = value
    if length:
        good = isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{length}}}", value)
    else:
        good = isinstance(value, str) and value != ""
    if good:
        assert getattr(parse_catalog(json.dumps(doc)), key) == value
    else:
        with pytest.raises(ValueError, match=key):
            parse_catalog(json.dumps(doc))


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=70),
        st.binary(max_size=8),
        hex_digests(63, 64, 65),
    )
)
def test_the_sheet_digest_must_be_a_sha256_or_absent(value: object) -> None:
    doc = json.loads(RAW)
    doc["sheet_sha256"] = value
    good = value is None or (
        isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")
    )
    if good:
        assert parse_catalog(json.dumps(doc, default=str)).sheet_sha256 == value
    else:
        with pytest.raises(ValueError, match="sha256"):
            parse_catalog(json.dumps(doc, default=str))


@given(
    st.one_of(
        st.integers(),
        st.integers(-(2**70), 2**70),
        st.booleans(),
        st.none(),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    )
)
def test_any_code_gets_a_class_and_unknown_ones_are_reported_as_unknown(code: object) -> None:
    cls = classify_xid(code)  # type: ignore[arg-type]
    assert cls.state in ("healthy", "degraded", "unhealthy") and cls.action in ACTIONS
    listed = isinstance(code, int) and not isinstance(code, bool) and 1 <= code <= 173
    assert cls.known is listed
    if listed:
        assert cls is XID_TABLE[code]  # type: ignore[index]
    else:
        assert (cls.state, cls.action, cls.latched) == ("degraded", "check_workload", False)
        assert cls.name.startswith("unknown XID")


# a bucket of the catalogue's, one near it (another case, a space more), or any text
bucket_names = st.sampled_from(BUCKETS).flatmap(
    lambda b: st.sampled_from([b, b.lower(), f"{b} ", b[:-1]])
) | st.text(max_size=12)


@given(st.sampled_from(sorted(XID_TABLE)), bucket_names)
def test_a_corrupted_bucket_is_refused_naming_the_code(code: int, bucket: str) -> None:
    doc = json.loads(RAW)
    row = next(r for r in doc["xids"] if r["code"] == code)
    row.pop("agent", None)
    row["category"], row["immediate"] = "engine", bucket
    if bucket in doc["buckets"]:
        entry = parse_catalog(json.dumps(doc)).entries[code]
        judged = doc["buckets"][bucket]
        assert entry.immediate == bucket
        assert (entry.judged.state, entry.judged.action, entry.judged.latched) == (
            judged["state"],
            judged["action"],
            judged["latched"],
        )
    else:
        with pytest.raises(ValueError, match=f"XID {code}"):
            parse_catalog(json.dumps(doc))


def test_a_repeated_code_is_refused() -> None:
    doc = json.loads(RAW)
    doc["xids"].append(dict(doc["xids"][0]))
    with pytest.raises(ValueError, match="repeated"):
        parse_catalog(json.dumps(doc))


def test_escalation_steps_the_action_once_and_leaves_counted_only_alone() -> None:
    assert escalate(classify_xid(13), 3, "1h").action == "reset"
    assert escalate(classify_xid(46), 3, "1h").action == "reboot"
    assert escalate(classify_xid(79), 3, "1h").action == "hardware_inspection"
    top = classify_xid(54)
    assert escalate(top, 9, "1h") is top
    assert escalate(classify_xid(45), 50, "1h") is classify_xid(45)


def _tracker(now: list[float], count: int = 3) -> HealthTracker:
    tracker = HealthTracker(
        xid_hold=1e6,
        xid_repeat_count=count,
        xid_repeat_window=60.0,
        clock=lambda: now[0],
        wall=lambda: datetime(2026, 1, 1, tzinfo=UTC),
    )
    tracker.observe([GpuIdentity(index=0, uuid="GPU-0", serial="S0")], {}, {})
    return tracker


def _xid(code: int) -> XidEvent:
    return XidEvent(0, "GPU-0", code, datetime(2026, 1, 1, tzinfo=UTC))


def test_the_same_xid_n_times_in_the_window_raises_the_action_one_step() -> None:
    now = [0.0]
    tracker = _tracker(now)
    [first] = tracker.record_xid(_xid(13))
    assert (first.current.state, first.current.action) == ("degraded", "check_workload")
    now[0] = 10.0
    assert tracker.record_xid(_xid(13)) == []  # twice: no news
    now[0] = 20.0
    [third] = tracker.record_xid(_xid(13))
    assert (third.current.state, third.current.action) == ("degraded", "reset")
    assert third.current.reason == (
        "XID 13: graphics engine exception (usually an out-of-bounds access in the application)"
        " (seen 3 times in 1m) (recent)"
    )


def test_repeats_outside_the_window_do_not_escalate_and_zero_turns_it_off() -> None:
    now = [0.0]
    tracker = _tracker(now)
    for t in (0.0, 61.0, 122.0):
        now[0] = t
        tracker.record_xid(_xid(31))
    assert tracker.snapshot().gpus[0].checks["xid"].action == "check_workload"
    off = _tracker([0.0], count=0)
    for _ in range(10):
        off.record_xid(_xid(79))
    assert off.snapshot().gpus[0].checks["xid"].action == "reboot"


def test_an_unknown_xid_is_shown_and_counted_not_dropped() -> None:
    tracker = _tracker([0.0])
    [transition] = tracker.record_xid(_xid(4242))
    assert transition.current.reason == "XID 4242: unknown XID (not in the catalogue) (recent)"
    assert tracker.snapshot().gpus[0].xid_counts == {4242: 1}


def test_docs_health_md_carries_the_table_the_data_file_gives() -> None:
    committed = (DOCS / "health.md").read_text(encoding="utf-8")
    assert docs.health_page(committed) == committed, "run `python -m gpuid_agent.docs`"
    assert "173 codes" in committed
    for code, entry in CATALOG.entries.items():
        if entry.category != "unused":
            assert f"| {code} | `{entry.mnemonic}` |" in committed


def test_the_page_generator_refuses_a_page_without_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        docs.health_page("# Health\n")


async def test_repeats_and_unknown_codes_through_the_driver(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:2]
    async with agent_on(fake_nvml, config, xid_repeat_count=3, xid_repeat_window=3600) as run:
        await eventually(lambda: run.agent.collector.health.xid.alive)
        config.gpus[0].xids = [(13, 0), (13, 1), (13, 2)]
        config.gpus[1].xids = [(4242, 0)]
        fake_nvml.apply(config)
        await eventually(lambda: run.check(0, "xid").action == "reset")
        records = await run.settled_health(3, check="xid")
    by_gpu = {(r["index"], r["action"]): r["reason"] for r in records}
    assert by_gpu[(0, "check_workload")].startswith("XID 13: graphics engine exception")
    assert "(seen 3 times in 1h)" in by_gpu[(0, "reset")]
    assert by_gpu[(1, "check_workload")].startswith("XID 4242: unknown XID")
    assert node_health(run.agent).gpus[1].xid_counts == {4242: 1}


def test_repeat_settings_are_validated_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="XID_REPEAT_COUNT"):
        settings(xid_repeat_count=-1)
    with pytest.raises(ConfigError, match="PCIE_REPLAY_THRESHOLD"):
        settings(pcie_replay_threshold="many")
