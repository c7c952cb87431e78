"""The pod cache against a hostile API server: watch lines that are not JSON, events that are
not objects or name no pod, ERROR events with odd codes, a list reply that is no PodList. Each
is counted, logged and skipped; the cache keeps serving the pods it has and picks up the next
real change."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.sources.kube.client import (
    WATCH_LINE_LIMIT,
    KubeClient,
    create_kube_client,
    watch_lines,
)
from gpuid_agent.sources.kube.pods import PodCache
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.waiting import eventually

NODE = "node-a"
_serial = itertools.count(1)  # pod names unique across hypothesis examples on one server


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(token="t0ken") as server:
        yield server


class Running:
    """A pod cache following the fake API in a task, stopped (and checked alive) at the end."""

    def __init__(self, kube: FakeKube, tmp_path: Path) -> None:
        self.kube = kube
        self.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube.url, token="t0ken")
        self.cache = PodCache(NODE, label_allowlist=["team"], backoff_max=0.05, watch_timeout=30)
        self.client: KubeClient | None = None
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Running:
        watches = self.kube.count("watch", status=200)
        environ = {"KUBECONFIG": str(self.kubeconfig)}
        self.client = await create_kube_client("auto", environ=environ)
        assert self.cache.open(self.client)
        self.task = asyncio.create_task(self.cache.run())
        await eventually(
            lambda: self.cache.ready and self.kube.count("watch", status=200) > watches
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        self.kube.close_watches()  # the server side of this cache's watch, too

    def malformed(self) -> float:
        return self.cache.registry.get_sample_value("gpuid_pod_cache_malformed_total") or 0.0

    async def real_change_arrives(self) -> None:
        """A pod created now is seen, the pods before it are still served, all is ok."""
        assert self.task is not None and not self.task.done()
        before = self.cache.status()["pods"]
        name = f"real-{next(_serial)}"
        made = self.kube.create(objects.pod(name, node_name=NODE, labels={"team": "t"}))
        meta = await eventually(lambda: self.cache.lookup("default", name))
        assert meta.uid == made["metadata"]["uid"] and dict(meta.labels) == {"team": "t"}
        assert self.cache.status()["pods"] >= before + 1
        assert self.cache.resource_version == made["metadata"]["resourceVersion"]
        await eventually(lambda: self.cache.board.is_ok("kube-pods"))
        assert not self.task.done()


def line(value: Any) -> bytes:
    return json.dumps(value).encode()


POD_META = {"name": "odd", "namespace": "default", "resourceVersion": "1"}
# Each is skipped whole: nothing in it names a pod.
SKIPPED = [
    b"this is not json",
    b'{"type": "ADDED", "object": {"metadata": {"name": "cut',
    b"\xff\xfe\x00",
    line(None),
    line([]),
    line(["ADDED", {}]),
    line("ADDED"),
    line(7),
    line({"type": "ADDED"}),
    line({"type": "ADDED", "object": None}),
    line({"type": "ADDED", "object": []}),
    line({"type": "ADDED", "object": "pod"}),
    line({"type": "ADDED", "object": {"metadata": "x"}}),
    line({"type": "ADDED", "object": {"metadata": {"name": 5, "namespace": "default"}}}),
    line({"type": "MODIFIED", "object": {"metadata": {"name": "x", "namespace": ["default"]}}}),
    line({"type": "ADDED", "object": {"metadata": {"name": "", "namespace": "default"}}}),
    line({"type": "DELETED", "object": {"metadata": None}}),
    line({"type": "DELETED", "object": {"metadata": {"name": {"a": 1}, "namespace": "d"}}}),
    line({"type": "DELETED", "object": []}),
    line({"type": ["ADDED"], "object": {"metadata": POD_META}}),
    line({"type": "RENAMED", "object": {"metadata": POD_META}}),
]
# Each names a pod with odd fields: kept, with what can be read of it.
ODD_PODS = [
    {"name": "odd-1", "namespace": "default", "uid": {"x": 1}, "labels": ["team"]},
    {"name": "odd-2", "namespace": "default", "ownerReferences": 5, "resourceVersion": 12},
    {"name": "odd-3", "namespace": "default", "ownerReferences": ["x", None, {"kind": 3}]},
    {
        "name": "odd-4",
        "namespace": "default",
        "ownerReferences": [{"kind": "ReplicaSet", "name": None, "controller": "yes"}],
        "labels": {"team": 5},
    },
]


async def test_hostile_watch_lines_are_skipped_and_the_cache_keeps_serving(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.create(objects.pod("first", node_name=NODE))
    async with Running(kube, tmp_path) as run:
        assert run.cache.lookup("default", "first") is not None
        for raw in SKIPPED:
            assert kube.send_raw(raw, "pods") == 1
        await eventually(lambda: run.malformed() == len(SKIPPED))
        for meta in ODD_PODS:
            kube.send_raw(line({"type": "ADDED", "object": {"metadata": meta, "status": 1}}))
        await eventually(lambda: run.cache.lookup("default", "odd-4"))
        odd = {m["name"]: run.cache.lookup("default", m["name"]) for m in ODD_PODS}
        assert all(p is not None and p.uid == "" and not p.labels for p in odd.values())
        assert odd["odd-3"].workload_kind == ""  # type: ignore[union-attr]
        assert run.cache.lookup("default", "first") is not None
        assert run.malformed() == len(SKIPPED)
        assert run.kube.open_watches == 1  # the same watch went on: no reconnect
        await run.real_change_arrives()


@pytest.mark.parametrize(
    "error",
    [
        {"code": [410], "message": {"m": 1}},
        {"code": "410"},
        {"code": True},
        {},
        {"code": 410, "reason": "Expired"},
        {"code": 500, "message": "x" * 5000},
    ],
)
async def test_odd_error_events_end_the_watch_and_it_resumes(
    kube: FakeKube, tmp_path: Path, error: dict[str, Any]
) -> None:
    kube.create(objects.pod("first", node_name=NODE))
    async with Running(kube, tmp_path) as run:
        watches = kube.count("watch")
        kube.send_raw(line({"type": "ERROR", "object": error}), "pods")
        await eventually(lambda: kube.count("watch") > watches)
        await run.real_change_arrives()
        assert run.cache.lookup("default", "first") is not None
        assert len(run.cache.last_error or "") <= 300


async def test_a_refused_resource_version_is_dropped_for_a_fresh_list(
    kube: FakeKube, tmp_path: Path
) -> None:
    async with Running(kube, tmp_path) as run:
        # a string resourceVersion the server then refuses (400) on the resumed watch
        meta = {"name": "odd", "namespace": "default", "resourceVersion": "not-a-version"}
        kube.send_raw(line({"type": "ADDED", "object": {"metadata": meta}}), "pods")
        await eventually(lambda: run.cache.resource_version == "not-a-version")
        kube.close_watches()
        await eventually(lambda: kube.count("watch", status=400) >= 1)
        await eventually(
            lambda: run.cache.registry.get_sample_value("gpuid_pod_cache_relists_total") == 2
        )
        assert run.cache.lookup("default", "odd") is not None  # tombstoned, still readable
        await run.real_change_arrives()


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b"null", b'{"items": 5}', b'{"kind": "PodList"}', b'{"items": {"a": 1}}'],
)
async def test_a_list_reply_that_is_no_pod_list_keeps_the_cached_pods(
    kube: FakeKube, tmp_path: Path, body: bytes
) -> None:
    kube.create(objects.pod("first", node_name=NODE))
    async with Running(kube, tmp_path) as run:
        fault = kube.inject(verb="list", path="/api/v1/pods", body=body, times=1000)
        kube.expire_watches()  # 410: the cache lists again and gets the odd reply
        await eventually(lambda: fault.hits >= 2)
        await eventually(lambda: run.cache.board.get("kube-pods").state == "degraded")  # type: ignore[union-attr]
        assert run.cache.lookup("default", "first") is not None
        assert run.cache.status()["pods"] == 1
        kube.clear_faults()
        await run.real_change_arrives()  # the next list is a real one


async def test_odd_items_of_a_list_are_skipped(kube: FakeKube, tmp_path: Path) -> None:
    items = [None, 3, {"metadata": []}, {"metadata": {"name": "x"}}, objects.pod("ok")]
    items[-1]["metadata"].update(uid="u-1", resourceVersion="5")
    body = line({"kind": "PodList", "metadata": {"resourceVersion": 9}, "items": items})
    kube.inject(verb="list", path="/api/v1/pods", body=body)
    async with Running(kube, tmp_path) as run:
        assert run.cache.lookup("default", "ok").uid == "u-1"  # type: ignore[union-attr]
        assert run.malformed() == 4
        assert run.cache.resource_version == ""  # not a string: watch from now
        await run.real_change_arrives()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=20,
)
names = st.sampled_from(["a", "b", "real-1", "first"]) | json_values
metadata = st.fixed_dictionaries(
    {"name": names, "namespace": st.sampled_from(["default"]) | json_values},
    optional={
        "uid": json_values,
        "labels": json_values,
        "ownerReferences": json_values
        | st.lists(
            st.fixed_dictionaries(
                {"kind": st.sampled_from(["ReplicaSet", "Job"]) | json_values},
                optional={"name": names, "uid": json_values, "controller": json_values},
            ),
            max_size=2,
        ),
        "resourceVersion": json_values,
    },
)
events = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"])
        | json_values,
        "object": st.fixed_dictionaries(
            {"metadata": metadata | json_values},
            optional={"status": json_values, "code": json_values, "message": json_values},
        )
        | json_values,
    }
)
hostile_lines = st.lists(
    events.map(line) | json_values.map(line) | st.binary(max_size=24), min_size=1, max_size=6
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=hostile_lines)
async def test_any_watch_lines_are_survived(
    kube: FakeKube, tmp_path: Path, lines: list[bytes]
) -> None:
    async with Running(kube, tmp_path) as run:
        for raw in lines:
            kube.send_raw(raw, "pods")
        await run.real_change_arrives()


async def test_a_large_pod_is_applied_and_an_oversized_line_skipped(
    kube: FakeKube, tmp_path: Path
) -> None:
    """A pod whose JSON is far over aiohttp's default line size arrives like any other; a line
    over the limit is skipped without being held in memory, and the watch goes on."""
    async with Running(kube, tmp_path) as run:
        big = objects.pod("big", node_name=NODE, labels={"team": "t"})
        env = [{"name": f"VAR_{i}", "value": "v" * 100} for i in range(3000)]
        big["spec"]["containers"][0]["env"] = env
        assert len(json.dumps(big)) > 300_000
        kube.create(big)
        meta = await eventually(lambda: run.cache.lookup("default", "big"))
        assert dict(meta.labels) == {"team": "t"}
        kube.send_raw(b"[" * (WATCH_LINE_LIMIT + 10), "pods")
        await eventually(lambda: run.malformed() == 1)
        assert run.kube.open_watches == 1
        await run.real_change_arrives()


async def _lines(chunks: list[bytes], limit: int) -> list[bytes | None]:
    loop = asyncio.get_running_loop()
    stream = StreamReader(BaseProtocol(loop), 2**16, loop=loop)
    for chunk in chunks:
        stream.feed_data(chunk)
    stream.feed_eof()
    return [line async for line in watch_lines(stream, limit)]


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"")), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    final_newline=st.booleans(),
)
def test_watch_lines_splits_any_chunking(
    lines: list[bytes], cuts: list[int], final_newline: bool
) -> None:
    """However the stream is cut into chunks, each line comes out once, and exactly the lines
    over the limit come out as None."""
    limit = 12
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    want: list[bytes | None] = [None if len(line) > limit else line for line in lines]
    if lines and not final_newline and not lines[-1]:
        want.pop()  # an empty last line without its newline is no line
    assert asyncio.run(_lines(chunks, limit)) == want
