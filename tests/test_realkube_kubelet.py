"""The agent's kubelet client (its own h2 gRPC and protobuf decoding) against the kubelet's own
pod-resources server: Go's grpc and protobuf encoding, NewV1PodResourcesServer and the
kubelet's rate limiter (100 qps, burst 10, ResourceExhausted past it)."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry

from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.simulate.pods import KubeletContainer, KubeletPod, pod
from gpuid_agent.sources.kubelet import (
    PodResourcesClient,
    PodResourcesError,
    PodResourcesSource,
    ResourceMatcher,
)
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually

GPU_A = "GPU-0a0a0a0a-1111-4222-8333-444444444444"
GPU_B = "GPU-0b0b0b0b-1111-4222-8333-444444444444"
MIG = "MIG-0c0c0c0c-1111-4222-8333-444444444444"


def source(path: str, *, interval: float = 0.02, backoff_max: float = 0.1) -> PodResourcesSource:
    return PodResourcesSource(
        PodResourcesClient(path, timeout=5.0),
        interval=interval,
        stale_after=30.0,
        resources=ResourceMatcher([]),
        board=StatusBoard(),
        metrics=AttributionMetrics(CollectorRegistry()),
        backoff_max=backoff_max,
    )


def polls(src: PodResourcesSource, outcome: str) -> float:
    return (
        src.registry.get_sample_value("gpuid_pod_resources_polls_total", {"outcome": outcome}) or 0
    )


async def test_list_and_allocatable_from_the_kubelets_server(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = [
        KubeletPod(
            "ml",
            "train",
            (
                KubeletContainer(
                    "main", (("nvidia.com/gpu", (GPU_A, GPU_B)), ("example.com/nic", ("nic0",)))
                ),
                KubeletContainer("sidecar"),
            ),
        ),
        pod("research", "mig-job", "w", "nvidia.com/mig-1g.10gb", MIG),
        KubeletPod("kube-system", "no-devices", (KubeletContainer("c"),)),
    ]
    real_kubelet.allocatable = (
        ("nvidia.com/gpu", (GPU_A, GPU_B)),
        ("nvidia.com/mig-1g.10gb", (MIG,)),
    )
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    try:
        assert await src.poll_once()
        snapshot = src.current()
        assert snapshot is not None and snapshot.pods == 3
        assert {
            (a.namespace, a.pod, a.container, a.resource_name, a.device_id)
            for a in snapshot.assignments
        } == {
            ("ml", "train", "main", "nvidia.com/gpu", GPU_A),
            ("ml", "train", "main", "nvidia.com/gpu", GPU_B),
            ("research", "mig-job", "w", "nvidia.com/mig-1g.10gb", MIG),
        }
        assert snapshot.allocatable is not None
        assert set(snapshot.allocatable) == {
            ("nvidia.com/gpu", GPU_A),
            ("nvidia.com/gpu", GPU_B),
            ("nvidia.com/mig-1g.10gb", MIG),
        }
        # A pod ends and another starts: the server reads its file again at the next call.
        real_kubelet.pods = [pod("ml", "next", "main", "nvidia.com/gpu", GPU_B)]
        real_kubelet.publish()
        assert await src.poll_once()
        assert {(a.pod, a.device_id) for a in src.current().assignments} == {("next", GPU_B)}  # type: ignore[union-attr]
    finally:
        await src.client.close()


async def test_ten_thousand_pods(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = [
        pod(
            f"ns-{i % 50}",
            f"job-{i}",
            "main",
            "nvidia.com/gpu",
            f"GPU-{i:08x}-1111-4222-8333-444444444444",
        )
        for i in range(10_000)
    ]
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    try:
        assert await src.poll_once()
        snapshot = src.current()
        assert snapshot is not None and snapshot.pods == 10_000
        assert len(snapshot.assignments) == 10_000
        assert {a.device_id for a in snapshot.assignments} == {
            f"GPU-{i:08x}-1111-4222-8333-444444444444" for i in range(10_000)
        }
    finally:
        await src.client.close()


async def test_a_burst_past_the_rate_limit_is_survived_without_a_hot_loop(
    real_kubelet: KubeletServer,
) -> None:
    real_kubelet.pods = [pod("ml", "train", "main", "nvidia.com/gpu", GPU_A)]
    real_kubelet.publish()
    src = source(real_kubelet.socket_path, interval=0.01, backoff_max=1.0)
    task = asyncio.create_task(src.run())
    other = PodResourcesClient(real_kubelet.socket_path, timeout=5.0)
    refused = 0
    try:
        await eventually(lambda: polls(src, "ok") >= 1)
        # Another client of the kubelet takes every token for a while (the limiter is the
        # kubelet's, shared by all its callers): the agent's polls are refused meanwhile.
        before = polls(src, "ok")
        loop = asyncio.get_running_loop()
        until = loop.time() + 3.0
        reasons: set[str] = set()
        while loop.time() < until:
            try:
                await other.list_bytes()
            except PodResourcesError as exc:
                reasons.add(exc.reason)
                refused += 1
        assert reasons == {"resource_exhausted"}
        exhausted = polls(src, "resource_exhausted")
        assert refused > 100 and exhausted >= 1
        # Backing off from 10 ms to at most 1 s: a handful of tries in 3 s, not one per 10 ms.
        assert exhausted + polls(src, "ok") - before < 30
        assert src.board.get("pod-resources").state == "degraded"  # type: ignore[union-attr]
        await eventually(lambda: src.board.is_ok("pod-resources"), within=10)
        assert src.current() is not None and src.current().pods == 1  # type: ignore[union-attr]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await other.close()
