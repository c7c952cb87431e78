"""Every state file, spooled batch and health clear request says which format wrote it; a file of
an older format is read, one of a newer format is kept where it is, untouched, and reported once.
(The upgrade from the previous release and the rollback from the next one, with real agents:
test_upgrade_rollback.py.)"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.delivery.spool_files import batch_named, names_count, names_format
from gpuid_agent.runtime import formats
from gpuid_agent.runtime.clear_requests import take_clear_requests, write_clear_request
from gpuid_agent.runtime.errors import NewerFormatError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.allocation_trail import OpenAllocations
from gpuid_agent.state.gpu_slots import GpuSlots
from gpuid_agent.state.health.health_file import HealthFile
from gpuid_agent.state.state_file import StateDir
from tests.exporter_support import readings, spool_files
from tests.servers.receiver import Receiver
from tests.waiting import eventually

NODE = "node-a"
START = {
    "allocation_id": "a1",
    "namespace": "ml",
    "pod": "train-0",
    "container": "main",
    "resource_name": "nvidia.com/gpu",
    "device_id": "GPU-0",
}
# each state file as this version writes it, less its format
DOCS: dict[str, dict[str, Any]] = {
    formats.ALLOCATIONS: {"node": NODE, "saved_at": "t", "open": [START], "pending": []},
    formats.HARDWARE: {"slots": {"0000:01:00.0": "1650"}, "pending": []},
    formats.HEALTH: {"boot_id": "b", "gpus": {"GPU-0": {"latched": [{"code": 79}]}}},
    formats.ACCOUNTING: {
        "node": NODE,
        "as_of": 1.0,
        "energy": {},
        "split": {},
        "holdings": [],
    },
}


def readers(state_dir: StateDir) -> dict[str, Any]:
    """Each state file's reader, started on `state_dir` as the agent starts them."""
    health = HealthFile(state_dir)
    return {
        formats.ALLOCATIONS: OpenAllocations(NODE, state_dir, stamp=lambda: "later"),
        formats.HARDWARE: GpuSlots(state_dir),
        formats.HEALTH: (health, health.load()),
        formats.ACCOUNTING: Accountant(AccountingConfig(state_dir=state_dir), NODE),
    }


def write(directory: Path, name: str, version: int | None) -> bytes:
    doc = DOCS[name] if version is None else {"version": version, **DOCS[name]}
    payload = orjson.dumps(doc)
    (directory / name).write_bytes(payload)
    return payload


def test_files_without_a_format_are_read_as_format_1(tmp_path: Path) -> None:
    for name in DOCS:
        write(tmp_path, name, None)
    found = readers(StateDir(str(tmp_path)))
    assert list(found[formats.ALLOCATIONS].open.values()) == [START]
    assert found[formats.HARDWARE].serials == {"0000:01:00.0": "1650"}
    assert list(found[formats.HEALTH][1]) == ["GPU-0"]
    assert found[formats.ACCOUNTING].path == tmp_path / formats.ACCOUNTING
    assert not (tmp_path / "rejected").exists()


async def test_newer_state_files_stay_untouched_and_are_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    written = {name: write(tmp_path, name, formats.FORMATS[name] + 1) for name in DOCS}
    metrics, board = AgentMetrics(), StatusBoard()
    state_dir = StateDir(
        str(tmp_path),
        metrics.state_files_rejected,
        newer=metrics.state_files_newer,
        board=board,
    )
    found = readers(state_dir)
    trail, slots = found[formats.ALLOCATIONS], found[formats.HARDWARE]
    (health, gpus), accountant = found[formats.HEALTH], found[formats.ACCOUNTING]
    # none of it read: each starts as without a state file, and has nowhere to save
    assert trail.open == {} and slots.serials is None and gpus == {}
    assert trail.path is slots.path is health.path is accountant.path is None
    trail.opened(("ns", "p", "c", "r", "d"), dict(START))
    await trail.save()
    slots.serials = {"0000:02:00.0": "77"}
    await slots.save()
    health.save({"boot_id": "b", "gpus": {}})
    await accountant.save_due()
    assert {name: (tmp_path / name).read_bytes() for name in DOCS} == written
    assert not (tmp_path / "rejected").exists()
    for name in DOCS:
        kept = board.get(f"state:{name}")
        assert kept is not None and kept.state == "degraded"
        assert kept.reason is not None
        assert f"format {formats.FORMATS[name] + 1}, newer than this version reads" in kept.reason
        assert metrics.state_files_newer.labels(name)._value.get() == 1
        assert metrics.state_files_rejected.labels(name, "invalid")._value.get() == 0
    said = [r.getMessage() for r in caplog.records]
    assert sorted(m for m in said if m.startswith("state:")) == sorted(
        f"state:{name} is degraded" for name in DOCS
    )
    assert state_dir.kept_newer == dict.fromkeys(DOCS, 2)


@pytest.mark.parametrize("version", [0, -1, "2", True, 1.5, None, [1], 10**6])
def test_a_format_that_is_no_number_sets_the_file_aside(tmp_path: Path, version: Any) -> None:
    (tmp_path / formats.HARDWARE).write_bytes(
        orjson.dumps({"version": version, **DOCS[formats.HARDWARE]})
    )
    metrics = AgentMetrics()
    slots = GpuSlots(StateDir(str(tmp_path), metrics.state_files_rejected))
    assert slots.serials is None and slots.path == tmp_path / formats.HARDWARE
    [set_aside] = (tmp_path / "rejected").iterdir()
    assert set_aside.name.startswith("hardware.json.") and set_aside.name.endswith(".invalid")
    assert metrics.state_files_rejected.labels(formats.HARDWARE, "invalid")._value.get() == 1


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@given(st.dictionaries(st.sampled_from(["version", "node", "x"]), _json) | _json)
def test_a_format_is_read_older_current_newer_or_refused(doc: Any) -> None:
    version = doc.get("version", 1) if isinstance(doc, dict) else None
    is_format = type(version) is int and 0 < version <= formats.MAX_FORMAT
    for kind, known in formats.FORMATS.items():
        if not is_format:
            with pytest.raises(ValueError, match=r"no format version|not a JSON object"):
                formats.readable_format(kind, doc)
        elif version > known:
            with pytest.raises(NewerFormatError) as caught:
                formats.readable_format(kind, doc)
            assert (caught.value.found, caught.value.known) == (version, known)
            assert formats.judge(kind, version) == "newer"
        else:
            assert formats.readable_format(kind, doc) == version
            assert formats.judge(kind, version) in ("older", "current")


@hsettings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_json)
def test_a_state_file_is_read_kept_or_set_aside_never_lost(tmp_path: Path, version: Any) -> None:
    for entry in tmp_path.rglob("*"):
        if entry.is_file():
            entry.unlink()
    payload = orjson.dumps({"version": version, **DOCS[formats.HARDWARE]})
    (tmp_path / formats.HARDWARE).write_bytes(payload)
    state_dir = StateDir(str(tmp_path))
    slots = GpuSlots(state_dir)
    at_path = tmp_path / formats.HARDWARE
    set_aside = list((tmp_path / "rejected").glob("*")) if (tmp_path / "rejected").exists() else []
    if slots.serials is not None:  # read: older or this version's
        assert at_path.read_bytes() == payload and not set_aside
    elif state_dir.kept_newer:  # kept for a newer version, where it was
        assert at_path.read_bytes() == payload and not set_aside and slots.path is None
    else:  # no format at all: set aside, never deleted
        assert not at_path.exists() and [p.read_bytes() for p in set_aside] == [payload]


# ---- spooled batches ---------------------------------------------------------------------------


def newer_name(name: str) -> str:
    """A batch file's name as the next format writes it."""
    stem, form = name.rsplit(".", 1)
    return f"{stem}.v{formats.FORMATS[formats.SPOOL_BATCH] + 1}.{form}"


@given(
    st.integers(0, 10**20 - 1),
    st.text("0123456789abcdef", min_size=32, max_size=32),
    st.integers(0, 10**9 - 1),
    st.none() | st.integers(1, 9999),
    st.from_regex(r"[a-z0-9]{1,16}", fullmatch=True),
)
def test_a_batch_files_name_says_its_format(
    created: int, batch_id: str, count: int, version: int | None, form: str
) -> None:
    marker = "" if version is None else f".v{version}"
    name = f"{created:020d}-{batch_id}-{count}{marker}.{form}"
    assert names_count(name) == count
    assert names_format(name) == (version or 1)
    batch = batch_named(Path("/spool"), name, 7)
    assert batch is not None and batch.form == form and batch.count == count


@given(st.text(max_size=80))
def test_any_other_name_is_no_batch(name: str) -> None:
    batch_like = re.fullmatch(r"\d{1,20}-[0-9a-f]{32}-\d{1,9}(\.v\d{1,4})?\.[a-z0-9]{1,16}", name)
    assert (names_count(name) >= 0) == bool(batch_like)
    assert (batch_named(Path("/spool"), name, 0) is not None) == bool(batch_like)


async def test_newer_batches_stay_in_the_spool_unsent_and_outside_its_bound(
    tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    writer = DiskSpool(tmp_path, 1 << 30)
    for i in range(3):
        await writer.add(readings(1, node=f"n{i}"))
    first, *others = spool_files(tmp_path)
    for path in others:  # two of them written by the next version
        path.rename(tmp_path / newer_name(path.name))
    (tmp_path / "rejected" / newer_name(first.name)).write_bytes(first.read_bytes())
    kept = sorted(p for p in tmp_path.rglob("*.v2.*"))
    contents = {p: p.read_bytes() for p in kept}
    spool = DiskSpool(tmp_path, max_bytes=1)  # full at once: trimming must not reach them
    assert (spool.batches, spool.newer_batches, spool.newer.records) == (1, 2, 8)
    metrics, exporter = AgentMetrics(), HttpExporter(receiver.url)
    worker = ExporterWorker(exporter, BatchPolicy(flush_interval=0.02), metrics, store=spool)
    assert worker.describe()["newer_format_batches"] == 2
    assert metrics.spool_newer_batches.labels("http")._value.get() == 2
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.describe()["delivered_records"] >= 4, within=20)
    await worker.store_now(readings(2, node="new"))  # more than the bound allows
    await eventually(lambda: worker.describe()["delivered_records"] >= 12, within=20)
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    await exporter.close()
    assert {p: p.read_bytes() for p in kept} == contents
    assert sorted(p.name for p in spool_files(tmp_path)) == sorted(
        p.name for p in kept if p.parent == tmp_path
    )
    assert len(receiver.accepted_ids()) == 12
    said = [r.getMessage() for r in caplog.records]
    assert (
        said.count("spool holds batches of a newer format; kept for the version that wrote them")
        == 1
    )


# ---- health clear requests -----------------------------------------------------------------------


def test_a_clear_request_of_a_newer_format_waits_for_its_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    ours = write_clear_request(str(tmp_path), "GPU-1")
    assert orjson.loads(ours.read_bytes())["version"] == formats.FORMATS[formats.CLEAR_REQUEST]
    newer = tmp_path / "health-clear" / "next.json"
    payload = orjson.dumps({"version": formats.FORMATS[formats.CLEAR_REQUEST] + 1, "gpu": "0"})
    newer.write_bytes(payload)
    kept: set[str] = set()
    assert take_clear_requests(tmp_path / "health-clear", kept) == ["GPU-1"]
    assert take_clear_requests(tmp_path / "health-clear", kept) == []
    assert not ours.exists() and newer.read_bytes() == payload
    said = [r.getMessage() for r in caplog.records]
    assert said.count("health clear request kept for a newer version") == 1
