"""The kubelet's pod-resources v1 answers (List, GetAllocatableResources), read by protobuf's
own parser into the generated messages of `v1/api_pb2`.

With the upb backend that protobuf's wheels ship, a 1,024-pod List answer parses in ~0.1 ms,
so every answer is parsed whole. upb refuses broken framing, wire types 6 and 7, nesting past
its depth limit and invalid UTF-8 in any string field, used by the agent or not; nothing else
is refused (an empty name is a valid proto3 string). Its `DecodeError` becomes `WireError`,
whose message names the message type, never the payload.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gpuid_agent.runtime.errors import PodResourcesDecodeError
from gpuid_agent.sources.kubelet.v1 import api_pb2

# The bytes are not a well-formed message of the expected type.
WireError = PodResourcesDecodeError

_Message = TypeVar("_Message", bound=Message)


def parse_list(data: bytes) -> api_pb2.ListPodResourcesResponse:
    """Decode a `List` answer; WireError if malformed."""
    return _parse(api_pb2.ListPodResourcesResponse, data)


def parse_allocatable(data: bytes) -> api_pb2.AllocatableResourcesResponse:
    """Decode a `GetAllocatableResources` answer; WireError if malformed."""
    return _parse(api_pb2.AllocatableResourcesResponse, data)


def _parse(message: type[_Message], data: bytes) -> _Message:
    try:
        return message.FromString(data)
    except DecodeError:
        # from None: a log shows this message alone, whatever protobuf's own text holds
        raise WireError(f"not a well-formed {message.DESCRIPTOR.full_name}") from None
