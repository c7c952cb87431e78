"""The labeller through the agent's own client (kubernetes_asyncio's configuration and auth).

On the real kube-apiserver, as the agent of a node of its own (the pod-bound token, the chart's
RBAC and own-node policy): layouts, removals, drift repair, the resync cadence, foreign and
hostile labels, dry-run, the provider ID, and real refusals: a 409 from a Node changed between
the agent's read and its patch (once, and every time), a 403 from a release whose role lacks
`patch nodes` (granted while the labeller runs), a 422 from annotations past the server's size
limit (trimmed while it runs), a 404 while the Node is gone (registered again while it runs).
Requests are counted by the agent's own `gpuid_kube_api_requests_total`, their times taken
from the client's observer.

On the stand-in (`tests/fakekube`), for faults the real server cannot be made to produce: a
429 with Retry-After (`test_429_honours_retry_after`), 5xx answers, a stall and a reset
connection (`test_transient_errors_back_off_then_converge`), and an API server that comes up
after the labeller started (`test_api_down_at_start_then_up_converges`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.node.labels import LabelledNode, NodeLabeler
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client, request_counter
from tests.fakekube import FakeKube, free_port, write_kubeconfig
from tests.realkube import objects
from tests.realkube.chart import AgentIdentity
from tests.realkube.cluster import Client, KubeCluster
from tests.test_attribution_pods import release_without
from tests.test_labels_layout import gb200, gpu, h100, inventory
from tests.waiting import eventually

P = "gpuid.github.com"
NODE = "gpu-node-1"  # the stand-in's Node
HOSTNAME = "kubernetes.io/hostname"
FOREIGN = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    f"{P}/team": "ml-infra",  # someone else's label under our prefix
    f"{P}.other/gpu-0": "theirs",
}
# The API server's limit on a Node's annotations, keys and values together (256 KiB).
ANNOTATIONS_LIMIT = 256 * 1024


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith(f"{P}/") and k != f"{P}/team"}


class Harness:
    """A labeller of `node` over `client`, with the agent's metrics and status board."""

    def __init__(self, client: KubeClient, node: str) -> None:
        self.client = client
        self.node = node
        agent_metrics = AgentMetrics()
        self.registry = agent_metrics.registry
        self.metrics = agent_metrics.labels
        count = request_counter(agent_metrics.kube_api_requests)
        self.answered_at: dict[str, list[float]] = defaultdict(list)  # by verb

        def observe(verb: str, resource: str, code: str) -> None:
            count(verb, resource, code)
            self.answered_at[verb].append(time.monotonic())

        client.observe(observe)
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
            # a request answered late on a busy machine must not turn into a retry
            "request_timeout": 5.0,
            "backoff_base": 0.02,
            "backoff_cap": 0.1,
            "on_node": self.seen.append,
            "rand": random.Random(7),
        }
        options.update(overrides)
        return NodeLabeler(self.client, self.node, **options)

    def run(self, labeler: NodeLabeler) -> NodeLabeler:
        self.tasks.append(asyncio.create_task(labeler.run()))
        return labeler

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def requests(self, verb: str | None = None, code: str | None = None) -> float:
        """Requests the client sent, from gpuid_kube_api_requests_total."""
        return sum(
            s.value
            for family in self.registry.collect()
            if family.name == "gpuid_kube_api_requests"
            for s in family.samples
            if s.name.endswith("_total")
            and verb in (None, s.labels["verb"])
            and code in (None, s.labels["code"])
        )

    def state(self) -> tuple[str, str | None]:
        entry = self.board.get("labels")
        assert entry is not None
        return entry.state, entry.reason

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.close()


@dataclass
class RealNode:
    """The agent's Node on the real API server, as an administrator sees and edits it."""

    admin: Client
    name: str

    @property
    def path(self) -> str:
        return f"/api/v1/nodes/{self.name}"

    def set(
        self,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        provider_id: str | None = None,
    ) -> None:
        """Labels and annotations added (None removes one), the cloud's providerID set."""
        patch: dict[str, Any] = {"metadata": {}}
        if labels is not None:
            patch["metadata"]["labels"] = labels
        if annotations is not None:
            patch["metadata"]["annotations"] = annotations
        if provider_id is not None:
            patch["spec"] = {"providerID": provider_id}
        self.admin.merge_patch(self.path, patch)

    def get(self) -> dict[str, Any]:
        return self.admin.get(self.path)  # type: ignore[no-any-return]

    def labels(self) -> dict[str, str]:
        return dict(self.get()["metadata"].get("labels") or {})

    def annotations(self) -> dict[str, str]:
        return dict(self.get()["metadata"].get("annotations") or {})


async def agent_client(identity: AgentIdentity) -> KubeClient:
    made = await create_kube_client(environ={"KUBECONFIG": str(identity.kubeconfig)})
    assert made is not None
    return made


@pytest.fixture
def node(kube_cluster: KubeCluster, agent_node: AgentIdentity) -> RealNode:
    return RealNode(kube_cluster.admin, agent_node.node)


@pytest.fixture
async def harness(agent_node: AgentIdentity) -> AsyncIterator[Harness]:
    h = Harness(await agent_client(agent_node), agent_node.node)
    yield h
    await h.close()


# ---- layouts on a Node ---------------------------------------------------------------------------


async def test_h100_eight_serials_one_patch_then_quiet(harness: Harness, node: RealNode) -> None:
    node.set(labels=FOREIGN)
    labeler = harness.labeler()
    labeler.offer(h100())
    assert await labeler.reconcile_once() is None
    labels = node.labels()
    expected = sorted(g.serial or "" for g in h100().gpus)
    assert ours(labels) == {
        **{f"{P}/gpu-{j}": s for j, s in enumerate(expected)},
        f"{P}/gpu-count": "8",
    }
    assert {k: labels[k] for k in FOREIGN} == FOREIGN
    assert labels[HOSTNAME] == node.name
    assert harness.requests("patch") == 1
    annotation = json.loads(node.annotations()[f"{P}/gpus"])
    assert len(annotation["gpus"]) == 8
    # a reconcile with nothing to change reads and does not patch
    assert await labeler.reconcile_once() is None
    assert harness.requests("patch") == 1
    assert harness.requests("get") == 2
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


async def test_gb200_two_gpu_labels_and_a_chassis(harness: Harness, node: RealNode) -> None:
    labeler = harness.labeler()
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert node.labels() == {
        HOSTNAME: node.name,
        f"{P}/chassis": "1821325191357",
        f"{P}/gpu-0": "1330824060012",
        f"{P}/gpu-1": "1330824060087",
        f"{P}/gpu-count": "4",
        f"{P}/chassis-count": "1",
    }


async def test_a_stale_chassis_count_without_a_chassis_is_removed(
    harness: Harness, node: RealNode
) -> None:
    # An H100 node labelled by an earlier version, which wrote chassis-count=0: gpuid writes
    # no chassis-count without a chassis, so `-l P/chassis-count` must not match it.
    stale = {f"{P}/chassis-count": "0", f"{P}/gpu-count": "8"}
    node.set(labels=FOREIGN | stale)
    labeler = harness.labeler()
    labeler.offer(h100())
    assert await labeler.reconcile_once() is None
    labels = node.labels()
    assert f"{P}/chassis-count" not in labels
    assert labels[f"{P}/gpu-count"] == "8"
    assert {k: labels[k] for k in FOREIGN} == FOREIGN
    # the same node moved onto a GB200 tray gets the label back, with its count
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert node.labels()[f"{P}/chassis-count"] == "1"


async def test_two_chassis(harness: Harness, node: RealNode) -> None:
    labeler = harness.labeler()
    labeler.offer(inventory(gpu(0, "A1", "CH-A"), gpu(1, "B1", "CH-B")))
    assert await labeler.reconcile_once() is None
    assert node.labels() == {
        HOSTNAME: node.name,
        f"{P}/chassis-0": "CH-A",
        f"{P}/chassis-0-gpu-0": "A1",
        f"{P}/chassis-1": "CH-B",
        f"{P}/chassis-1-gpu-0": "B1",
        f"{P}/gpu-count": "2",
        f"{P}/chassis-count": "2",
    }


async def test_gpu_removed_its_label_disappears(harness: Harness, node: RealNode) -> None:
    node.set(labels=FOREIGN)
    labeler = harness.run(harness.labeler())
    full = h100()
    labeler.offer(full)
    await eventually(lambda: node.labels().get(f"{P}/gpu-count") == "8")
    gone = max(g.serial or "" for g in full.gpus)
    labeler.offer(inventory(*(g for g in full.gpus if g.serial != gone)))
    await eventually(lambda: node.labels().get(f"{P}/gpu-count") == "7")
    labels = node.labels()
    assert f"{P}/gpu-7" not in labels
    assert gone not in labels.values()
    assert {k: labels[k] for k in FOREIGN} == FOREIGN


async def test_gpu_count_zero_removes_all_our_labels_only(harness: Harness, node: RealNode) -> None:
    node.set(labels=FOREIGN, annotations={"keep.io/me": "yes"})
    labeler = harness.run(harness.labeler())
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in node.labels())
    labeler.offer(inventory())
    await eventually(lambda: ours(node.labels()) == {})
    meta = node.get()["metadata"]
    assert meta["labels"] == {HOSTNAME: node.name, **FOREIGN}
    assert meta["annotations"] == {"keep.io/me": "yes"}


async def test_drift_is_repaired_on_resync(harness: Harness, node: RealNode) -> None:
    node.set(labels=FOREIGN)
    labeler = harness.run(harness.labeler(resync_interval=0.2))
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in node.labels())
    want = node.labels()
    # someone deletes one of our labels and edits another
    node.set(labels={f"{P}/chassis": None, f"{P}/gpu-0": "tampered"})
    assert node.labels() != want
    await eventually(lambda: node.labels() == want)
    # the patch is counted once its answer is read, a moment after the server applied it
    await eventually(lambda: harness.requests("patch") >= 2)
    reads = harness.requests("get")
    await eventually(lambda: harness.requests("get") > reads)  # another resync: nothing more
    assert harness.requests("patch") == 2


async def test_steady_state_reads_at_resync_cadence_without_patches(
    harness: Harness, node: RealNode
) -> None:
    labeler = harness.run(harness.labeler(resync_interval=0.1))
    labeler.offer(gb200())
    await eventually(lambda: harness.requests("patch") == 1)
    reads = harness.requests("get")
    # the same hardware read again and again (new read_time each time) wakes nothing
    for _ in range(20):
        labeler.offer(gb200())
    await eventually(lambda: harness.requests("get") >= reads + 3)
    assert harness.requests("patch") == 1
    assert f"{P}/chassis" in node.labels()


async def test_foreign_labels_untouched_even_when_conflicting_names(
    harness: Harness, node: RealNode
) -> None:
    odd = {**FOREIGN, "gpu-0": "no-prefix", f"{P}/gpu-notanumber": "x"}
    node.set(labels=odd)
    labeler = harness.labeler()
    labeler.offer(inventory())  # no GPUs: only removals could happen, of ours
    assert await labeler.reconcile_once() is None
    assert node.labels() == {HOSTNAME: node.name, **odd}
    assert harness.requests("patch") == 0


async def test_hostile_serial_is_accepted_by_the_api_server(
    harness: Harness, node: RealNode
) -> None:
    labeler = harness.labeler()
    raw = " SN/0001 ü\udcff"
    labeler.offer(inventory(gpu(0, raw), gpu(1, "N/A")))
    assert await labeler.reconcile_once() is None  # the API server took every value
    labels = node.labels()
    assert labels[f"{P}/gpu-0"].startswith("SN-0001-")  # " SN…" sorts before "N/A"
    assert labels[f"{P}/gpu-1"].startswith("N-A-")
    detail = json.loads(node.annotations()[f"{P}/gpus"])
    assert {g["serial"] for g in detail["gpus"]} == {raw, "N/A"}
    assert harness.value("gpuid_label_rewritten_serials") == 2


# ---- API errors ------------------------------------------------------------------------------


async def test_conflict_rereads_and_retries(harness: Harness, node: RealNode) -> None:
    changed = False

    def someone_else_writes(_: LabelledNode) -> None:
        # another client updates the Node between our read and our patch, once
        nonlocal changed
        if not changed:
            changed = True
            node.set(labels={"other": "x"})

    labeler = harness.labeler(on_node=someone_else_writes)
    labeler.offer(gb200())
    assert await labeler.reconcile_once() is None
    assert harness.requests("patch", "409") == 1
    assert harness.requests("patch", "200") == 1
    assert harness.requests("get") == 2
    assert node.labels()["other"] == "x"
    assert node.labels()[f"{P}/chassis"] == "1821325191357"
    assert harness.value("gpuid_label_reconcile_errors_total", {"reason": "conflict"}) == 1


async def test_persistent_conflicts_back_off(harness: Harness, node: RealNode) -> None:
    writes = itertools.count()

    def someone_else_writes(_: LabelledNode) -> None:
        # the Node changes between every read and its patch
        node.set(labels={"other": str(next(writes))})

    labeler = harness.labeler(conflict_retries=2, on_node=someone_else_writes)
    labeler.offer(gb200())
    failure = await labeler.reconcile_once()
    assert failure is not None
    assert failure.retry == "backoff"
    assert harness.requests("patch") == harness.requests("patch", "409") == 3
    assert f"{P}/chassis" not in node.labels()


async def refused_until_fixed(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
    verb: str,
    status: int,
    reason: str,
    fix: Callable[[], None],
) -> None:
    """Every `verb` (get: the read, patch: the write) refused with `status` until `fix()`: one
    try per resync period, the reason on the board, one log line, the labels written once
    fixed."""
    labeler = harness.run(harness.labeler(resync_interval=0.25))
    with caplog.at_level(logging.INFO, logger="gpuid_agent"):
        labeler.offer(gb200())
        await eventually(lambda: harness.requests(verb) >= 3)
        # a GPU change does not bring the retry forward: it waits for the resync
        labeler.offer(h100())
        await eventually(lambda: harness.requests(verb) >= 4)
    assert harness.requests(verb, str(status)) == harness.requests(verb)
    gaps = [b - a for a, b in itertools.pairwise(harness.answered_at[verb])]
    assert min(gaps) >= 0.25  # one try per resync period, never a hot loop
    state, why = harness.state()
    assert state == "degraded"
    assert why is not None
    assert why.startswith(f"{reason}: {status}")
    hints = [r for r in caplog.records if r.getMessage() == "labelling retried at the next resync"]
    assert len(hints) == 1  # logged once, not per attempt
    degraded = [r for r in caplog.records if r.getMessage() == "labels is degraded"]
    assert len(degraded) == 1
    fix()
    await eventually(lambda: harness.state() == ("ok", None))


async def test_an_rbac_refusal_is_retried_at_resync_until_granted(
    kube_cluster: KubeCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A release whose role may get Nodes but not patch them; the chart's role granted while
    the labeller runs, as an upgrade would."""
    with release_without(kube_cluster, "nodes", "patch") as release:
        identity = release.identity(tmp_path)
        h = Harness(await agent_client(identity), identity.node)
        try:
            await refused_until_fixed(h, caplog, "patch", 403, "forbidden", release.grant)
            labels = RealNode(kube_cluster.admin, identity.node).labels()
            assert ours(labels)[f"{P}/gpu-count"] == "8"
        finally:
            await h.close()


async def test_an_invalid_patch_is_retried_at_resync_until_it_fits(
    harness: Harness, node: RealNode, caplog: pytest.LogCaptureFixture
) -> None:
    """Annotations within a few bytes of the server's limit: the agent's own annotation does
    not fit (422) until someone trims them."""
    blob = "example.com/blob"
    node.set(annotations={blob: "x" * (ANNOTATIONS_LIMIT - len(blob) - 8)})
    await refused_until_fixed(
        harness, caplog, "patch", 422, "invalid", lambda: node.set(annotations={blob: None})
    )
    assert ours(node.labels())[f"{P}/gpu-count"] == "8"
    assert f"{P}/gpus" in node.annotations()


async def test_a_missing_node_is_retried_at_resync_until_it_exists(
    harness: Harness, node: RealNode, caplog: pytest.LogCaptureFixture
) -> None:
    """The Node is gone (404 to the read) until it registers again under the same name."""
    node.admin.delete(node.path)
    await refused_until_fixed(
        harness,
        caplog,
        "get",
        404,
        "not_found",
        lambda: node.admin.create("/api/v1/nodes", objects.node(node.name)),
    )
    assert harness.requests("patch") == harness.requests("patch", "200") == 1
    assert ours(node.labels())[f"{P}/gpu-count"] == "8"


async def test_dry_run_logs_the_patch_and_sends_none(
    harness: Harness, node: RealNode, caplog: pytest.LogCaptureFixture
) -> None:
    node.set(labels={f"{P}/gpu-9": "stale"})
    labeler = harness.labeler(mode="dry-run")
    labeler.offer(gb200())
    with caplog.at_level(logging.INFO, logger="gpuid_agent"):
        assert await labeler.reconcile_once() is None
        assert await labeler.reconcile_once() is None
    assert harness.requests("patch") == 0
    assert node.labels() == {HOSTNAME: node.name, f"{P}/gpu-9": "stale"}
    logged = [r for r in caplog.records if r.getMessage() == "dry-run: would patch node"]
    assert len(logged) == 1  # the same patch is not logged again
    patch = logged[0].patch  # type: ignore[attr-defined]
    assert patch["metadata"]["labels"][f"{P}/gpu-9"] is None
    assert patch["metadata"]["labels"][f"{P}/chassis"] == "1821325191357"
    assert harness.value("gpuid_label_patches_total", {"result": "dry_run"}) == 2
    assert harness.state() == ("ok", "dry-run")


async def test_provider_id_is_reported_on_every_read(harness: Harness, node: RealNode) -> None:
    node.set(provider_id="aws:///us-east-1a/i-0abc")
    labeler = harness.labeler()
    labeler.offer(gb200())
    await labeler.reconcile_once()
    assert [s.provider_id for s in harness.seen] == ["aws:///us-east-1a/i-0abc"]


async def test_nothing_happens_before_the_first_inventory(harness: Harness) -> None:
    harness.run(harness.labeler())
    await asyncio.sleep(0.1)  # a hold: nothing may reach the API server without an inventory
    assert harness.requests() == 0
    assert harness.state() == ("starting", "waiting for the first inventory")


# ---- faults only the stand-in makes ----------------------------------------------------------


class StandIn(Harness):
    def __init__(self, kube: FakeKube, client: KubeClient) -> None:
        super().__init__(client, NODE)
        self.kube = kube


async def _client(url: str, tmp_path: Path) -> KubeClient:
    path = write_kubeconfig(tmp_path / "kubeconfig", url)
    made = await create_kube_client(environ={"KUBECONFIG": str(path)})
    assert made is not None
    return made


@pytest.fixture
async def stand_in(tmp_path: Path) -> AsyncIterator[StandIn]:
    async with FakeKube() as kube:
        h = StandIn(kube, await _client(kube.url, tmp_path))
        yield h
        await h.close()


async def test_429_honours_retry_after(stand_in: StandIn) -> None:
    stand_in.kube.add_node(NODE)
    stand_in.kube.inject(429, verb="get", path=f"/api/v1/nodes/{NODE}", retry_after=1)
    labeler = stand_in.run(stand_in.labeler())
    labeler.offer(gb200())
    await eventually(lambda: stand_in.kube.count("patch", status=200) == 1)
    gets = [r for r in stand_in.kube.requests if r.verb == "get"]
    assert gets[0].status == 429
    assert gets[1].at - gets[0].at >= 1.0
    assert stand_in.value("gpuid_label_reconcile_errors_total", {"reason": "throttled"}) == 1


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
    stand_in: StandIn, fault: dict[str, Any], reason: str
) -> None:
    stand_in.kube.add_node(NODE)
    stand_in.kube.inject(verb="patch", times=3, **fault)
    labeler = stand_in.run(stand_in.labeler(request_timeout=0.2))
    labeler.offer(gb200())
    await eventually(lambda: f"{P}/chassis" in stand_in.kube.node_labels(NODE))
    await eventually(lambda: stand_in.state() == ("ok", None))  # the client has the answer too
    assert stand_in.value("gpuid_label_reconcile_errors_total", {"reason": reason}) >= 3
    assert stand_in.kube.count("patch", status=200) == 1


async def test_api_down_at_start_then_up_converges(tmp_path: Path) -> None:
    port = free_port()
    made = await _client(f"http://127.0.0.1:{port}", tmp_path)
    kube = FakeKube(port=port)
    h = StandIn(kube, made)
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
        await h.close()
        await kube.stop()
