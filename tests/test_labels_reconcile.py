"""The labeller against the fake API server, through the real kubernetes_asyncio client."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.node.labels import LabelledNode, NodeLabeler
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client, request_counter
from tests.fakekube import FakeKube, free_port, write_kubeconfig
from tests.test_labels_layout import gb200, gpu, h100, inventory
from tests.waiting import eventually

P = "gpuid.github.com"
NODE = "gpu-node-1"
NODE_PATH = f"/api/v1/nodes/{NODE}"
FOREIGN = {
    "kubernetes.io/hostname": NODE,
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    f"{P}/team": "ml-infra",  # someone else's label under our prefix
    f"{P}.other/gpu-0": "theirs",
}


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith(f"{P}/") and k != f"{P}/team"}


class Harness:
    def __init__(self, kube: FakeKube, client: KubeClient) -> None:
        self.kube = kube
        self.client = client
        agent_metrics = AgentMetrics()
        self.registry = agent_metrics.registry
        self.metrics = agent_metrics.labels
        client.observe(request_counter(agent_metrics.kube_api_requests))
        self.board = StatusBoard()
        self.seen: list[LabelledNode] = []
        self.tasks: list[asyncio.Task[None]] = []

    def labeler(self, **overrides: Any) -> NodeLabeler:
        options: dict[str, Any] = {
            "prefix": P,
            "metrics": self.metrics,
            "board": self.board,
            "resync_interval": 0.3,
            "startup_jitter": 0.0,
            "debounce": 0.01,
            "request_timeout": 0.5,
            "backoff_base": 0.02,
            "backoff_cap": 0.1,
            "on_node": self.seen.append,
            "rand": random.Random(7),
        }
        options.update(overrides)
        return NodeLabeler(self.client, NODE, **options)

    def run(self, labeler: NodeLabeler) -> NodeLabeler:
        self.tasks.append(asyncio.create_task(labeler.run()))
        return labeler

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def state(self) -> tuple[str, str | None]:
        entry = self.board.get("labels")
        assert entry is not None
        return entry.state, entry.reason


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as server:
        yield server


async def _client(url: str, tmp_path: Path) -> KubeClient:
    path = write_kubeconfig(tmp_path / "kubeconfig", url)
    made = await create_kube_client(environ={"KUBECONFIG": str(path)})
    assert made is not None
    return made


@pytest.fixture
async def harness(kube: FakeKube, tmp_path: Path) -> AsyncIterator[Harness]:
    made = await _client(kube.url, tmp_path)
    h = Harness(kube, made)
    yield h
    for task in h.tasks:
        task.cancel()
    await asyncio.gather(*h.tasks, return_exceptions=True)
    await made.close()


def labels_of(kube: FakeKube) -> dict[str, str]:
    return kube.node_labels(NODE)


# ---- layouts on a Node ---------------------------------------------------------------------------


async def test_h100_eight_serials_one_patch_then_quiet(harness: Harness) -> None:
    harness.kube.add_node(NODE, labels=FOREIGN)
    labeler = harness.labeler()
    labeler.offer(h100())
    assert await labeler.reconcile_once() is None
    labels = labels_of(harness.kube)
    expected = sorted(g.serial or "" for g in h100().gpus)
    assert ours(labels) == {
        **{f"{P}/gpu-{j}": s for j, s in enumerate(expected)},
        f"{P}/gpu-count": "8",
    }
    assert {k: labels[k] for k in FOREIGN} == FOREIGN
    assert harness.kube.count("patch") == 1
    annotation = json.loads(harness.kube.node(NODE)["metadata"]["annotations"][f"{P}/gpus"])
    assert len(annotation["gpus"]) == 8
    # a reconcile with nothing to change reads and does not patch
    assert await labeler.reconcile_once() is None
    assert harness.kube.count("patch") == 1
    assert harness.kube.count("get", path=NODE_PATH) == 2
    assert harness.value("gpuid_label_patches_total", {"result": "applied"}) == 1
    assert harness.value("gpuid_labels_in_sync") == 1
    assert harness.value("gpuid_label_last_success_timestamp_seconds") > 0
    assert (
        harness.value(
            "gpuid_kube_api_requests_total", {"verb": "get", "resource": "nodes", "code": "200"}
        )
        == 2
    )
    assert harness.state() == ("ok", None)


async def test_gb200_two_gpu_labels_and_a_chassis(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    labeler = harness.labeler()
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert labels_of(harness.kube) == {
        f"{P}/chassis": "1821325191357",
        f"{P}/gpu-0": "1330824060012",
        f"{P}/gpu-1": "1330824060087",
        f"{P}/gpu-count": "4",
        f"{P}/chassis-count": "1",
    }


async def test_a_stale_chassis_count_without_a_chassis_is_removed(harness: Harness) -> None:
    # An H100 node labelled by an earlier version, which wrote chassis-count=0: gpuid writes
    # no chassis-count without a chassis, so `-l P/chassis-count` must not match it.
    stale = {f"{P}/chassis-count": "0", f"{P}/gpu-count": "8"}
    harness.kube.add_node(NODE, labels=FOREIGN | stale)
    labeler = harness.labeler()
    labeler.offer(h100())
    assert await labeler.reconcile_once() is None
    labels = labels_of(harness.kube)
    assert f"{P}/chassis-count" not in labels
    assert labels[f"{P}/gpu-count"] == "8"
    assert {k: labels[k] for k in FOREIGN} == FOREIGN
    # the same node moved onto a GB200 tray gets the label back, with its count
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert labels_of(harness.kube)[f"{P}/chassis-count"] == "1"


async def test_two_chassis(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    labeler = harness.labeler()
    labeler.offer(inventory(gpu(0, "A1", "CH-A"), gpu(1, "B1", "CH-B")))
    assert await labeler.reconcile_once() is None
    assert labels_of(harness.kube) == {
        f"{P}/chassis-0": "CH-A",
        f"{P}/chassis-0-gpu-0": "A1",
        f"{P}/chassis-1": "CH-B",
        f"{P}/chassis-1-gpu-0": "B1",
        f"{P}/gpu-count": "2",
        f"{P}/chassis-count": "2",
    }


async def test_gpu_removed_its_label_disappears(harness: Harness) -> None:
    harness.kube.add_node(NODE, labels=FOREIGN)
    labeler = harness.run(harness.labeler())
    full = h100()
    labeler.offer(full)
    await eventually(lambda: labels_of(harness.kube).get(f"{P}/gpu-count") == "8")
    gone = max(g.serial or "" for g in full.gpus)
    labeler.offer(inventory(*(g for g in full.gpus if g.serial != gone)))
    await eventually(lambda: labels_of(harness.kube).get(f"{P}/gpu-count") == "7")
    labels = labels_of(harness.kube)
    assert f"{P}/gpu-7" not in labels
    assert gone not in labels.values()
    assert {k: labels[k] for k in FOREIGN} == FOREIGN


async def test_gpu_count_zero_removes_all_our_labels_only(harness: Harness) -> None:
    harness.kube.add_node(NODE, labels=FOREIGN, annotations={"keep.io/me": "yes"})
    labeler = harness.run(harness.labeler())
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in labels_of(harness.kube))
    labeler.offer(inventory())
    await eventually(lambda: ours(labels_of(harness.kube)) == {})
    node = harness.kube.node(NODE)
    assert node["metadata"]["labels"] == FOREIGN
    assert node["metadata"]["annotations"] == {"keep.io/me": "yes"}


async def test_drift_is_repaired_on_resync(harness: Harness) -> None:
    harness.kube.add_node(NODE, labels=FOREIGN)
    labeler = harness.run(harness.labeler(resync_interval=0.2))
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in labels_of(harness.kube))
    want = labels_of(harness.kube)
    # someone deletes one of our labels and edits another
    harness.kube.patch(
        "Node",
        NODE,
        {"metadata": {"labels": {f"{P}/chassis": None, f"{P}/gpu-0": "tampered"}}},
    )
    assert labels_of(harness.kube) != want
    await eventually(lambda: labels_of(harness.kube) == want)
    assert harness.kube.count("patch") == 2


async def test_steady_state_reads_at_resync_cadence_without_patches(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    labeler = harness.run(harness.labeler(resync_interval=0.1))
    labeler.offer(gb200())
    await eventually(lambda: harness.kube.count("patch") == 1)
    reads = harness.kube.count("get")
    # the same hardware read again and again (new read_time each time) wakes nothing
    for _ in range(20):
        labeler.offer(gb200())
    await eventually(lambda: harness.kube.count("get") >= reads + 3)
    assert harness.kube.count("patch") == 1


async def test_foreign_labels_untouched_even_when_conflicting_names(harness: Harness) -> None:
    odd = {**FOREIGN, "gpu-0": "no-prefix", f"{P}/gpu-notanumber": "x"}
    harness.kube.add_node(NODE, labels=odd)
    labeler = harness.labeler()
    labeler.offer(inventory())  # no GPUs: only removals could happen, of ours
    assert await labeler.reconcile_once() is None
    assert labels_of(harness.kube) == odd
    assert harness.kube.count("patch") == 0


async def test_hostile_serial_is_accepted_by_the_api_server(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    labeler = harness.labeler()
    raw = " SN/0001 ü\udcff"
    labeler.offer(inventory(gpu(0, raw), gpu(1, "N/A")))
    assert await labeler.reconcile_once() is None  # the fake validates like the API server
    labels = labels_of(harness.kube)
    assert labels[f"{P}/gpu-0"].startswith("SN-0001-")  # " SN…" sorts before "N/A"
    assert labels[f"{P}/gpu-1"].startswith("N-A-")
    detail = json.loads(harness.kube.node(NODE)["metadata"]["annotations"][f"{P}/gpus"])
    assert {g["serial"] for g in detail["gpus"]} == {raw, "N/A"}
    assert harness.value("gpuid_label_rewritten_serials") == 2


# ---- API errors ------------------------------------------------------------------------------


async def test_conflict_rereads_and_retries(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    changed = False

    def someone_else_writes(node: LabelledNode) -> None:
        # another client updates the Node between our read and our patch, once
        nonlocal changed
        if not changed:
            changed = True
            harness.kube.patch("Node", NODE, {"metadata": {"labels": {"other": "x"}}})

    labeler = harness.labeler(on_node=someone_else_writes)
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert harness.kube.count("patch", status=409) == 1
    assert harness.kube.count("patch", status=200) == 1
    assert harness.kube.count("get") == 2
    assert labels_of(harness.kube)["other"] == "x"
    assert labels_of(harness.kube)[f"{P}/chassis"] == "1821325191357"
    assert harness.value("gpuid_label_reconcile_errors_total", {"reason": "conflict"}) == 1


async def test_persistent_conflicts_back_off(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    harness.kube.inject(409, verb="patch", times=100)
    labeler = harness.labeler(conflict_retries=2)
    labeler.offer(gb200())
    failure = await labeler.reconcile_once()
    assert failure is not None
    assert failure.retry == "backoff"
    assert harness.kube.count("patch") == 3


async def test_429_honours_retry_after(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    harness.kube.inject(429, verb="get", path=NODE_PATH, retry_after=1)
    labeler = harness.run(harness.labeler())
    labeler.offer(gb200())
    await eventually(lambda: harness.kube.count("patch", status=200) == 1)
    gets = [r for r in harness.kube.requests if r.verb == "get"]
    assert gets[0].status == 429
    assert gets[1].at - gets[0].at >= 1.0
    assert harness.value("gpuid_label_reconcile_errors_total", {"reason": "throttled"}) == 1


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"status": 500}, "server_error"),
        ({"status": 503}, "server_error"),
        ({"delay": 5.0}, "timeout"),
        ({"drop": True}, "connection"),
    ],
)
async def test_transient_errors_back_off_then_converge(
    harness: Harness, fault: dict[str, Any], reason: str
) -> None:
    harness.kube.add_node(NODE)
    harness.kube.inject(verb="patch", times=3, **fault)
    labeler = harness.run(harness.labeler(request_timeout=0.2))
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in labels_of(harness.kube))
    await eventually(lambda: harness.state() == ("ok", None))  # the client has the answer too
    assert harness.value("gpuid_label_reconcile_errors_total", {"reason": reason}) >= 3
    assert harness.kube.count("patch", status=200) == 1


async def test_api_down_at_start_then_up_converges(tmp_path: Path) -> None:
    port = free_port()
    made = await _client(f"http://127.0.0.1:{port}", tmp_path)
    kube = FakeKube(port=port)
    h = Harness(kube, made)
    labeler = h.run(h.labeler())
    try:
        labeler.offer(gb200())
        await eventually(
            lambda: h.value("gpuid_label_reconcile_errors_total", {"reason": "connection"}) >= 2
        )
        state, reason = h.state()
        assert state == "degraded"
        assert reason is not None
        assert reason.startswith("connection")
        await kube.start()
        kube.add_node(NODE, labels=FOREIGN)
        await eventually(lambda: f"{P}/chassis" in kube.node_labels(NODE))
        await eventually(lambda: h.state() == ("ok", None))
        assert {k: kube.node_labels(NODE)[k] for k in FOREIGN} == FOREIGN
    finally:
        for task in h.tasks:
            task.cancel()
        await asyncio.gather(*h.tasks, return_exceptions=True)
        await made.close()
        await kube.stop()


@pytest.mark.parametrize(
    ("status", "reason"), [(403, "forbidden"), (404, "not_found"), (422, "invalid")]
)
async def test_permanent_errors_do_not_loop(
    harness: Harness, caplog: pytest.LogCaptureFixture, status: int, reason: str
) -> None:
    harness.kube.add_node(NODE)
    harness.kube.inject(status, verb="patch", times=1000)
    labeler = harness.run(harness.labeler(resync_interval=0.25))
    with caplog.at_level(logging.INFO, logger="gpuid_agent"):
        labeler.offer(gb200())
        await eventually(lambda: harness.kube.count("patch") >= 3)
        # a GPU change does not bring the retry forward: it waits for the resync
        labeler.offer(h100())
        await eventually(lambda: harness.kube.count("patch") >= 4)
    patches = [r.at for r in harness.kube.requests if r.verb == "patch"]
    gaps = [b - a for a, b in itertools.pairwise(patches)]
    assert min(gaps) >= 0.25  # one try per resync period, never a hot loop
    state, why = harness.state()
    assert state == "degraded"
    assert why is not None
    assert why.startswith(f"{reason}: {status}")
    hints = [r for r in caplog.records if r.getMessage() == "labelling retried at the next resync"]
    assert len(hints) == 1  # logged once, not per attempt
    degraded = [r for r in caplog.records if r.getMessage() == "labels is degraded"]
    assert len(degraded) == 1
    harness.kube.clear_faults()
    await eventually(lambda: harness.state() == ("ok", None))
    assert ours(labels_of(harness.kube))[f"{P}/gpu-count"] == "8"


async def test_dry_run_logs_the_patch_and_sends_none(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.kube.add_node(NODE, labels={f"{P}/gpu-9": "stale"})
    labeler = harness.labeler(mode="dry-run")
    labeler.offer(gb200())
    with caplog.at_level(logging.INFO, logger="gpuid_agent"):
        assert await labeler.reconcile_once() is None
        assert await labeler.reconcile_once() is None
    assert harness.kube.count("patch") == 0
    assert labels_of(harness.kube) == {f"{P}/gpu-9": "stale"}
    logged = [r for r in caplog.records if r.getMessage() == "dry-run: would patch node"]
    assert len(logged) == 1  # the same patch is not logged again
    patch = logged[0].patch  # type: ignore[attr-defined]
    assert patch["metadata"]["labels"][f"{P}/gpu-9"] is None
    assert patch["metadata"]["labels"][f"{P}/chassis"] == "1821325191357"
    assert harness.value("gpuid_label_patches_total", {"result": "dry_run"}) == 2
    assert harness.state() == ("ok", "dry-run")


async def test_provider_id_is_reported_on_every_read(harness: Harness) -> None:
    harness.kube.add_node(NODE, provider_id="aws:///us-east-1a/i-0abc")
    labeler = harness.labeler()
    labeler.offer(gb200())
    await labeler.reconcile_once()
    assert [s.provider_id for s in harness.seen] == ["aws:///us-east-1a/i-0abc"]


async def test_nothing_happens_before_the_first_inventory(harness: Harness) -> None:
    harness.kube.add_node(NODE)
    harness.run(harness.labeler())
    await asyncio.sleep(0.1)  # a hold: nothing may reach the API server without an inventory
    assert harness.kube.requests == []
    assert harness.state() == ("starting", "waiting for the first inventory")
