"""The pod-resources client and poller on a unix socket.

Against the kubelet's own pod-resources server (Go, `real_kubelet`): devices and allocatable
devices read, the v1 wire (paths, field numbers, Get), a kubelet that comes up after the agent.

The Python kubelet (`gpuid_agent.simulate.kubelet.FakeKubelet`, the `kubelet` fixture) stays
for what the real server cannot be made to do: a restart that replaces the socket between
polls (`test_kubelet_restart_mid_run`,
`test_a_restarted_kubelet_is_asked_its_allocatable_devices_again`), injected gRPC status codes
and delays (`test_unavailable_and_deadline_are_survived`,
`test_stale_mapping_is_not_served_forever`), and a kubelet before 1.21 without
GetAllocatableResources, its calls counted (`test_kubelet_without_get_allocatable`)."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kubelet import (
    PodResourcesClient,
    PodResourcesSource,
    ResourceMatcher,
)
from gpuid_agent.sources.kubelet.v1 import api_pb2
from tests.fakekubelet import FakeKubelet, KubeletContainer, KubeletPod, pod
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually

GPU_A = "GPU-0a0a0a0a-1111-4222-8333-444444444444"
GPU_B = "GPU-0b0b0b0b-1111-4222-8333-444444444444"


def source(
    path: str, *, interval: float = 0.02, stale_after: float = 30.0, timeout: float = 1.0
) -> PodResourcesSource:
    return PodResourcesSource(
        PodResourcesClient(path, timeout=timeout),
        interval=interval,
        stale_after=stale_after,
        resources=ResourceMatcher(["example.com/accel"]),
        board=StatusBoard(),
        metrics=AttributionMetrics(CollectorRegistry()),
        backoff_max=0.1,
    )


def devices(src: PodResourcesSource) -> set[tuple[str, str, str, str, str]]:
    current = src.current()
    assert current is not None
    return {
        (a.namespace, a.pod, a.container, a.resource_name, a.device_id) for a in current.assignments
    }


def metric(src: PodResourcesSource, name: str, **labels: str) -> float | None:
    return src.registry.get_sample_value(name, labels or None)


async def test_list_keeps_gpu_devices_and_reads_allocatable(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = [
        KubeletPod(
            "ml",
            "train",
            (
                KubeletContainer(
                    "main",
                    (
                        ("nvidia.com/gpu", (GPU_A, GPU_B)),
                        ("example.com/nic", ("nic0",)),  # not a GPU resource: ignored
                    ),
                ),
                KubeletContainer("sidecar"),
            ),
        ),
        pod("ml", "other", "c", "example.com/accel", "0"),  # configured extra resource
        KubeletPod("kube-system", "no-devices", (KubeletContainer("c"),)),
    ]
    real_kubelet.allocatable = (
        ("nvidia.com/gpu", (GPU_A, GPU_B)),
        ("example.com/nic", ("nic0",)),
    )
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    try:
        assert await src.poll_once()
        assert devices(src) == {
            ("ml", "train", "main", "nvidia.com/gpu", GPU_A),
            ("ml", "train", "main", "nvidia.com/gpu", GPU_B),
            ("ml", "other", "c", "example.com/accel", "0"),
        }
        snapshot = src.current()
        assert snapshot is not None and snapshot.pods == 3
        assert snapshot.allocatable == (("nvidia.com/gpu", GPU_A), ("nvidia.com/gpu", GPU_B))
        assert src.allocatable_supported is True
        assert src.board.is_ok("pod-resources")
        assert metric(src, "gpuid_pod_resources_up") == 1
        assert metric(src, "gpuid_pod_resources_polls_total", outcome="ok") == 1
    finally:
        await src.client.close()


async def test_wire_is_kubelet_v1(real_kubelet: KubeletServer) -> None:
    """Paths and field numbers as a real kubelet serves them (package v1)."""
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]
    numbers = {
        "ListPodResourcesResponse": {"pod_resources": 1},
        "PodResources": {"name": 1, "namespace": 2, "containers": 3},
        "ContainerResources": {
            "name": 1,
            "devices": 2,
            "cpu_ids": 3,
            "memory": 4,
            "dynamic_resources": 5,
        },
        "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
        "TopologyInfo": {"nodes": 1},
        "NUMANode": {"ID": 1},
        "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
        "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
        "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
        "GetPodResourcesResponse": {"pod_resources": 1},
        "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
        "ClaimResource": {
            "cdi_devices": 1,
            "driver_name": 2,
            "pool_name": 3,
            "device_name": 4,
            "share_id": 5,  # optional, Kubernetes 1.35
        },
        "CDIDevice": {"name": 1},
    }
    for message, fields in numbers.items():
        descriptor = api_pb2.DESCRIPTOR.message_types_by_name[message]
        assert {f.name: f.number for f in descriptor.fields} == fields, message

    real_kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)]
    real_kubelet.publish()
    await check_get(real_kubelet.socket_path)


async def check_get(socket_path: str) -> None:
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(
            "/v1.PodResourcesLister/Get",
            request_serializer=api_pb2.GetPodResourcesRequest.SerializeToString,
            response_deserializer=api_pb2.GetPodResourcesResponse.FromString,
        )
        response = await call(api_pb2.GetPodResourcesRequest(pod_name="p", pod_namespace="a"))
        assert response.pod_resources.containers[0].devices[0].device_ids == [GPU_A]
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await call(api_pb2.GetPodResourcesRequest(pod_name="nope", pod_namespace="a"))
        # the kubelet answers a plain error, which gRPC sends as UNKNOWN (not NOT_FOUND)
        assert missing.value.code() == grpc.StatusCode.UNKNOWN
        assert missing.value.details() == "pod nope in namespace a not found"


async def test_the_python_kubelet_answers_get_as_the_real_one(kubelet: FakeKubelet) -> None:
    """The stand-in the simulated node serves must not drift from the kubelet's own server."""
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)]
    await check_get(kubelet.socket_path)


async def test_socket_missing_at_start(kubelet_socket: str) -> None:
    src = source(kubelet_socket)
    try:
        assert not await src.poll_once()
        assert src.current() is None
        state = src.board.get("pod-resources")
        assert state is not None and state.state == "unavailable"
        assert "missing" in (state.reason or "") and "no attribution yet" in (state.reason or "")
        assert metric(src, "gpuid_pod_resources_polls_total", outcome="socket_missing") == 1

        server = KubeletServer(kubelet_socket, [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)])
        await asyncio.to_thread(server.start)  # the kubelet comes up after the agent
        try:
            assert await src.poll_once()
            assert devices(src) == {("a", "p", "c", "nvidia.com/gpu", GPU_A)}
            assert src.board.is_ok("pod-resources")
        finally:
            await asyncio.to_thread(server.stop)
    finally:
        await src.client.close()


async def test_kubelet_restart_mid_run(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuid_agent")
    kubelet.pods = [pod("a", "before", "c", "nvidia.com/gpu", GPU_A)]
    src = source(kubelet.socket_path)
    task = asyncio.create_task(src.run())
    try:
        await eventually(lambda: src.current() is not None)
        assert devices(src) == {("a", "before", "c", "nvidia.com/gpu", GPU_A)}

        await kubelet.stop()  # socket removed, as when the kubelet restarts
        assert not await asyncio.to_thread(os.path.exists, kubelet.socket_path)
        await eventually(lambda: src.failure is not None and src.failure.reason == "socket_missing")
        await eventually(
            lambda: (
                (metric(src, "gpuid_pod_resources_polls_total", outcome="socket_missing") or 0) >= 3
            )
        )
        # within the staleness window the last good mapping is still served
        assert devices(src) == {("a", "before", "c", "nvidia.com/gpu", GPU_A)}
        state = src.board.get("pod-resources")
        assert state is not None and state.state == "degraded"

        kubelet.pods = [pod("a", "after", "c", "nvidia.com/gpu", GPU_B)]
        await kubelet.start()  # a new socket at the same path
        await eventually(
            lambda: (
                src.current() is not None
                and {a.pod for a in src.current().assignments} == {"after"}
            )  # type: ignore[union-attr]
        )
        assert src.board.is_ok("pod-resources")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # many failed polls, one log line per state change
    degraded = [r for r in caplog.records if r.getMessage() == "pod-resources is degraded"]
    assert len(degraded) == 1


@pytest.mark.parametrize(
    ("inject", "reason"),
    [
        ("fail", "unavailable"),
        ("delay", "deadline_exceeded"),
    ],
)
async def test_unavailable_and_deadline_are_survived(
    kubelet: FakeKubelet, inject: str, reason: str
) -> None:
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)]
    src = source(kubelet.socket_path, timeout=0.2)
    try:
        assert await src.poll_once()
        if inject == "fail":
            kubelet.behaviour.fail["List"] = grpc.StatusCode.UNAVAILABLE
        else:
            kubelet.behaviour.delay["List"] = 1.0
        assert not await src.poll_once()
        assert src.failure is not None and src.failure.reason == reason
        assert src.current() is not None  # still within stale_after
        assert metric(src, "gpuid_pod_resources_up") == 0
        kubelet.behaviour.fail.clear()
        kubelet.behaviour.delay.clear()
        assert await src.poll_once()
        assert src.failure is None and src.board.is_ok("pod-resources")
    finally:
        await src.client.close()


async def test_stale_mapping_is_not_served_forever(kubelet: FakeKubelet) -> None:
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)]
    src = source(kubelet.socket_path, interval=0.02, stale_after=0.3)
    task = asyncio.create_task(src.run())
    try:
        await eventually(lambda: src.current() is not None)
        src.changed.clear()
        kubelet.behaviour.fail["List"] = grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: src.failure is not None)
        assert src.current() is not None  # young enough
        await asyncio.wait_for(src.changed.wait(), timeout=5)  # woken when it turns stale
        assert src.current() is None
        assert metric(src, "gpuid_pod_resources_stale") == 1
        state = src.board.get("pod-resources")
        assert (
            state is not None and state.state == "unavailable" and "stale" in (state.reason or "")
        )
        assert src.status()["stale"] is True

        kubelet.behaviour.fail.clear()
        await eventually(lambda: src.current() is not None)
        assert metric(src, "gpuid_pod_resources_stale") == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kubelet_without_get_allocatable(kubelet: FakeKubelet) -> None:
    kubelet.allocatable = None  # kubelet before 1.21: UNIMPLEMENTED
    kubelet.pods = [pod("a", "p", "c", "nvidia.com/gpu", GPU_A)]
    src = source(kubelet.socket_path)
    try:
        for _ in range(3):
            assert await src.poll_once()
        assert src.allocatable_supported is False
        current = src.current()
        assert current is not None and current.allocatable is None
        assert len(current.assignments) == 1
        assert kubelet.calls["GetAllocatableResources"] == 1  # asked once, not every poll
        assert kubelet.calls["List"] == 3
    finally:
        await src.client.close()


async def test_a_restarted_kubelet_is_asked_its_allocatable_devices_again(
    kubelet: FakeKubelet,
) -> None:
    """A kubelet restarted between two polls (no poll saw it down) may come back with other
    devices: the new socket is noticed and its allocatable devices read at the next poll,
    not after the 30 s the count is otherwise kept."""
    eight = tuple(f"GPU-{i:08x}-1111-4222-8333-444444444444" for i in range(8))
    kubelet.allocatable = (("nvidia.com/gpu", eight),)
    src = source(kubelet.socket_path, interval=0.5)
    assert src.allocatable_every == 30.0  # the agent's own: the count is kept between reads

    def allocatable() -> int | None:
        current = src.current()
        return None if current is None or current.allocatable is None else len(current.allocatable)

    task = asyncio.create_task(src.run())
    try:
        await eventually(lambda: allocatable() == 8)
        await eventually(lambda: src.polled.is_set())
        src.polled.clear()
        await eventually(src.polled.is_set)  # just polled: the restart falls between polls
        await kubelet.stop()
        kubelet.allocatable = (("nvidia.com/gpu", eight[:4]),)
        await kubelet.start()
        await eventually(lambda: allocatable() == 4, within=10)
        assert src.failure is None and (
            metric(src, "gpuid_pod_resources_polls_total", outcome="socket_missing") is None
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
