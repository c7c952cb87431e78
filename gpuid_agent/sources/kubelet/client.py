"""A thin client of the kubelet pod-resources v1 API over its unix socket (gRPC calls made by
`unary`, answers parsed by protobuf through `wire`).

The connection is dropped after any failure and dialled again on the next call, so a kubelet
that restarted and recreated its socket is reached at the next poll. A kubelet that restarted
between two calls fails neither, so each call also checks that the socket is still the one
dialled (its inode and change time, as a filesystem may give a new socket the inode just
freed): a new one is dialled afresh and counted in `restarts`, which tells the poller that
what it keeps of the old kubelet (its allocatable devices) is out of date.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from gpuid_agent.runtime.errors import GrpcCallError, PodResourcesError
from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.unary import Status, UnaryChannel
from gpuid_agent.sources.kubelet.v1 import api_pb2

# A node with hundreds of pods produces responses far above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_LIST = "/v1.PodResourcesLister/List"
_ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
_REASONS: dict[int, str] = {
    Status.UNAVAILABLE: "unavailable",
    Status.DEADLINE_EXCEEDED: "deadline_exceeded",
    Status.UNIMPLEMENTED: "unimplemented",
    Status.PERMISSION_DENIED: "permission_denied",
    Status.RESOURCE_EXHAUSTED: "resource_exhausted",
}
_Parsed = TypeVar("_Parsed")


def _classify(exc: GrpcCallError) -> PodResourcesError:
    reason = _REASONS.get(exc.status, "rpc_error")
    details = exc.details.strip().splitlines()
    detail = details[0][:200] if details else ""
    return PodResourcesError(reason, f"kubelet {exc.name}: {detail}".rstrip(": "))


class PodResourcesClient:
    def __init__(self, socket_path: str, *, timeout: float) -> None:
        self.socket_path = socket_path
        self._path = os.path.abspath(socket_path)
        self.timeout = timeout
        self._channel: UnaryChannel | None = None
        self._dialled: tuple[int, int, int] | None = None  # the socket last dialled
        self.restarts = 0  # sockets replaced under this client since it first dialled one

    async def _connect(self) -> UnaryChannel:
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
        if self._channel is None:
            self._channel = UnaryChannel(
                self._path, timeout=self.timeout, max_message_bytes=MAX_MESSAGE_BYTES
            )
        return self._channel

    async def _call(self, method: str) -> bytes:
        channel = await self._connect()
        try:
            return await channel.call(method, b"")  # both requests are empty messages
        except GrpcCallError as exc:
            error = _classify(exc)
            if error.reason != "unimplemented":
                await self.reset()
            raise error from exc

    async def list(self) -> api_pb2.ListPodResourcesResponse:
        return _parsed(wire.parse_list, await self.list_bytes())

    async def list_bytes(self) -> bytes:
        """The List answer as the kubelet sent it (parsed by the caller only when it moved)."""
        return await self._call(_LIST)

    async def allocatable(self) -> api_pb2.AllocatableResourcesResponse:
        """Raises PodResourcesError("unimplemented") on kubelets before 1.21."""
        return _parsed(wire.parse_allocatable, await self._call(_ALLOCATABLE))

    async def reset(self) -> None:
        """Drop the connection; the next call dials the socket afresh."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        await self.reset()


def _parsed(parse: Callable[[bytes], _Parsed], answer: bytes) -> _Parsed:
    try:
        return parse(answer)
    except wire.WireError as exc:
        raise PodResourcesError("rpc_error", f"kubelet answer not parsable: {exc}") from exc
