"""An in-process kubelet pod-resources v1 server (grpc.aio on a unix socket).

Serves a mutable list of pods, so the simulated node attributes its GPUs, and the tests drive
the real client through it: pods come and go, calls fail with a chosen status or answer late,
and a restart removes and recreates the socket as a real kubelet restart does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from gpuid_agent.simulate.pods import Devices, KubeletClaim, KubeletPod
from gpuid_agent.sources.kubelet.v1 import api_pb2, api_pb2_grpc


def _claim_message(claim: KubeletClaim) -> api_pb2.DynamicResource:
    return api_pb2.DynamicResource(
        claim_name=claim.name,
        claim_namespace=claim.namespace,
        claim_resources=[
            api_pb2.ClaimResource(
                cdi_devices=[api_pb2.CDIDevice(name=n) for n in d.cdi_devices],
                driver_name=d.driver,
                pool_name=d.pool,
                device_name=d.device,
                share_id=d.share_id,
            )
            for d in claim.devices
        ],
    )


def list_response(pods: Iterable[KubeletPod]) -> api_pb2.ListPodResourcesResponse:
    """The List answer naming `pods`, as the kubelet sends it."""
    return api_pb2.ListPodResourcesResponse(pod_resources=[_message(p) for p in pods])


def _message(p: KubeletPod) -> api_pb2.PodResources:
    return api_pb2.PodResources(
        name=p.name,
        namespace=p.namespace,
        containers=[
            api_pb2.ContainerResources(
                name=c.name,
                devices=[
                    api_pb2.ContainerDevices(resource_name=r, device_ids=list(ids))
                    for r, ids in c.devices
                ],
                dynamic_resources=[_claim_message(claim) for claim in c.claims],
            )
            for c in p.containers
        ],
    )


@dataclass
class Behaviour:
    """What the server does besides answering: failures and delays per method."""

    fail: dict[str, grpc.StatusCode] = field(default_factory=dict)
    delay: dict[str, float] = field(default_factory=dict)


_BASE: Any = api_pb2_grpc.PodResourcesListerServicer


class _Servicer(_BASE):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def _enter(self, method: str, context: Any) -> None:
        kubelet = self._kubelet
        kubelet.calls[method] += 1
        delay = kubelet.behaviour.delay.get(method)
        if delay:
            await asyncio.sleep(delay)
        code = kubelet.behaviour.fail.get(method)
        if code is not None:
            await context.abort(code, f"injected {code.name}")

    async def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:  # noqa: N802
        await self._enter("List", context)
        return list_response(self._kubelet.pods)

    async def GetAllocatableResources(  # noqa: N802
        self, request: Any, context: Any
    ) -> api_pb2.AllocatableResourcesResponse:
        await self._enter("GetAllocatableResources", context)
        if self._kubelet.allocatable is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method")
        return api_pb2.AllocatableResourcesResponse(
            devices=[
                api_pb2.ContainerDevices(resource_name=r, device_ids=list(ids))
                for r, ids in self._kubelet.allocatable or ()
            ]
        )

    async def Get(self, request: Any, context: Any) -> api_pb2.GetPodResourcesResponse:  # noqa: N802
        await self._enter("Get", context)
        for p in self._kubelet.pods:
            if p.name == request.pod_name and p.namespace == request.pod_namespace:
                return api_pb2.GetPodResourcesResponse(pod_resources=_message(p))
        # The kubelet returns a plain Go error here, which gRPC sends as UNKNOWN.
        await context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
        raise AssertionError("unreachable")  # pragma: no cover


class FakeKubelet:
    """The pod-resources server. `pods` and `allocatable` may be replaced at any time;
    `allocatable=None` answers GetAllocatableResources with UNIMPLEMENTED (kubelet < 1.21)."""

    def __init__(
        self,
        socket_path: str,
        pods: Iterable[KubeletPod] = (),
        allocatable: Devices | None = (),
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.pods: list[KubeletPod] = list(pods)
        self.allocatable = allocatable
        self.behaviour = Behaviour()
        self.calls: Counter[str] = Counter()
        self._server: grpc.aio.Server | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        if self._server is not None:
            return
        server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop serving and remove the socket, as a kubelet going down does."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def restart(self, downtime: float = 0.0) -> None:
        await self.stop()
        if downtime:
            await asyncio.sleep(downtime)
        await self.start()
