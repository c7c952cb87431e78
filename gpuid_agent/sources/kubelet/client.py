"""A thin grpc.aio client of the kubelet pod-resources v1 API over its unix socket.

The channel is dropped after any failure and rebuilt on the next call: gRPC's own reconnect
backoff (up to minutes) would otherwise delay noticing a kubelet that restarted and recreated
its socket. A kubelet that restarted between two calls fails neither, so each call also checks
that the socket is still the one the channel dialled (its inode and change time, as a
filesystem may give a new socket the inode just freed): a new one is dialled afresh
and counted in `restarts`, which tells the poller that what it keeps of the old kubelet (its
allocatable devices) is out of date.
"""

from __future__ import annotations

import os
from typing import Any

import grpc
import grpc.aio

from gpuid_agent.runtime.errors import PodResourcesError
from gpuid_agent.sources.kubelet.v1 import api_pb2, api_pb2_grpc

# A node with hundreds of pods produces responses far above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
)
_STUB: Any = api_pb2_grpc.PodResourcesListerStub


def _classify(exc: grpc.aio.AioRpcError) -> PodResourcesError:
    code = exc.code()
    reasons = {
        grpc.StatusCode.UNAVAILABLE: "unavailable",
        grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
        grpc.StatusCode.UNIMPLEMENTED: "unimplemented",
        grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
        grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    }
    reason = reasons.get(code, "rpc_error")
    details = (exc.details() or "").strip().splitlines()
    detail = details[0][:200] if details else ""
    return PodResourcesError(reason, f"kubelet {code.name}: {detail}".rstrip(": "))


class PodResourcesClient:
    def __init__(self, socket_path: str, *, timeout: float) -> None:
        self.socket_path = socket_path
        self._target = f"unix://{os.path.abspath(socket_path)}"
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._dialled: tuple[int, int, int] | None = None  # the socket last dialled
        self.restarts = 0  # sockets replaced under this client since it first dialled one

    async def _connect(self) -> Any:
        try:
            found = os.stat(self.socket_path)
        except FileNotFoundError:
            raise PodResourcesError(
                "socket_missing", f"socket {self.socket_path} does not exist"
            ) from None
        except OSError as exc:
            raise PodResourcesError("socket_missing", f"socket {self.socket_path}: {exc}") from exc
        socket = (found.st_dev, found.st_ino, found.st_ctime_ns)
        if socket != self._dialled:
            if self._dialled is not None:
                self.restarts += 1
            self._dialled = socket
            await self.reset()
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
            self._stub = _STUB(self._channel)
            # List without the response parsed (no deserializer: the bytes as received)
            self._stub.ListBytes = self._channel.unary_unary(
                "/v1.PodResourcesLister/List",
                request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=None,
            )
        return self._stub

    async def _call(self, method: str, request: Any) -> Any:
        stub = await self._connect()
        try:
            return await getattr(stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            error = _classify(exc)
            if error.reason != "unimplemented":
                await self.reset()
            raise error from exc

    async def list(self) -> api_pb2.ListPodResourcesResponse:
        return api_pb2.ListPodResourcesResponse.FromString(await self.list_bytes())

    async def list_bytes(self) -> bytes:
        """The List answer as the kubelet sent it (parsed by the caller only when it moved)."""
        answer: bytes = await self._call("ListBytes", api_pb2.ListPodResourcesRequest())
        return answer

    async def allocatable(self) -> api_pb2.AllocatableResourcesResponse:
        """Raises PodResourcesError("unimplemented") on kubelets before 1.21."""
        response: api_pb2.AllocatableResourcesResponse = await self._call(
            "GetAllocatableResources", api_pb2.AllocatableResourcesRequest()
        )
        return response

    async def reset(self) -> None:
        """Drop the channel; the next call dials the socket afresh."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        await self.reset()
