"""A pure-Python decoder of the kubelet's pod-resources v1 answers (List, GetAllocatableResources).

The agent makes one unary call and reads a handful of fields from its answer; importing the
protobuf runtime for that costs ~12 MiB of RSS on every node. This decoder reads the same bytes
with the stdlib only, into frozen dataclasses whose attribute names are the protobuf field names,
so code written against the generated classes reads either.

It follows what protobuf's own (upb) parser accepts and rejects, field by field: a singular
string's last occurrence wins, repeated fields append, unknown fields (groups included, nested
at most as deep as upb allows) are skipped, a known field arriving with another wire type is an
unknown field, and fields the agent does not use (topology, cpu_ids, memory) are checked as upb
checks them but not stored. Anything malformed raises `WireError`, whose message never carries
the payload.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuid_agent.runtime.errors import PodResourcesDecodeError

_DEPTH = 100  # upb's default nesting limit: messages and groups together


# The bytes are not a well-formed message of the expected type.
WireError = PodResourcesDecodeError


@dataclass(frozen=True, slots=True)
class CDIDevice:
    name: str = ""


@dataclass(frozen=True, slots=True)
class ClaimResource:
    cdi_devices: tuple[CDIDevice, ...] = ()
    driver_name: str = ""
    pool_name: str = ""
    device_name: str = ""
    share_id: str | None = None  # proto3 `optional`: None when absent

    def HasField(self, field: str) -> bool:  # noqa: N802 - the generated classes' spelling
        """Presence of the one field with presence (`share_id`), as protobuf answers it."""
        if field != "share_id":
            raise ValueError(f"{field!r} has no presence")
        return self.share_id is not None


@dataclass(frozen=True, slots=True)
class DynamicResource:
    claim_name: str = ""
    claim_namespace: str = ""
    claim_resources: tuple[ClaimResource, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    resource_name: str = ""
    device_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerResources:
    name: str = ""
    devices: tuple[ContainerDevices, ...] = ()
    dynamic_resources: tuple[DynamicResource, ...] = ()


@dataclass(frozen=True, slots=True)
class PodResources:
    name: str = ""
    namespace: str = ""
    containers: tuple[ContainerResources, ...] = ()


@dataclass(frozen=True, slots=True)
class ListPodResourcesResponse:
    pod_resources: tuple[PodResources, ...] = ()


@dataclass(frozen=True, slots=True)
class AllocatableResourcesResponse:
    devices: tuple[ContainerDevices, ...] = ()


def parse_list(data: bytes) -> ListPodResourcesResponse:
    """Decode a `List` answer; WireError if malformed."""
    return ListDecoder().parse(data)


class ListDecoder:
    """Decodes successive `List` answers of one kubelet, reusing the pods whose bytes are the
    same as in the previous answer (between two polls most are): a changed answer costs about
    the pods that changed, not the whole node."""

    def __init__(self) -> None:
        self._pods: dict[bytes, PodResources] = {}

    def parse(self, data: bytes) -> ListPodResourcesResponse:
        """Decode `data`; WireError if malformed (what was remembered is then kept)."""
        known, seen = self._pods, {}
        pods = []
        try:
            for field, start, stop in _fields(data, 0, len(data), _DEPTH):
                if field == 1:
                    raw = data[start:stop]
                    pod = known.get(raw) or _pod(data, start, stop, _DEPTH - 1)
                    seen[raw] = pod
                    pods.append(pod)
        except UnicodeDecodeError:
            raise WireError("string field is not valid UTF-8") from None
        self._pods = seen
        return ListPodResourcesResponse(tuple(pods))


def parse_allocatable(data: bytes) -> AllocatableResourcesResponse:
    """Decode a `GetAllocatableResources` answer; WireError if malformed."""
    try:
        return _allocatable(data, 0, len(data), _DEPTH)
    except UnicodeDecodeError:
        raise WireError("string field is not valid UTF-8") from None


# ---- primitives --------------------------------------------------------------------------------
# Each message loop below inlines the common case (a one-byte tag, a one-byte length) and falls
# back to these for the rest.


def _short_varint(data: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    """A tag or a length: upb reads at most 5 bytes for either."""
    value = shift = 0
    for _ in range(5):
        if pos >= end:
            raise WireError(f"truncated {what}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise WireError(f"{what} over 5 bytes")


def _tag(data: bytes, pos: int, end: int) -> tuple[int, int]:
    tag, pos = _short_varint(data, pos, end, "tag")
    if tag > 0xFFFFFFFF:
        raise WireError("tag over 32 bits")
    return tag, pos


def _span(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """Where the value after a length prefix starts and stops; it must fit."""
    size, pos = _short_varint(data, pos, end, "length")
    if pos + size > end:
        raise WireError("length past the end")
    return pos, pos + size


def _skip_varint(data: bytes, pos: int, end: int) -> int:
    """Past a varint of at most 10 bytes (bits over 64 are dropped, as upb does)."""
    for _ in range(10):
        if pos >= end:
            raise WireError("truncated varint")
        pos += 1
        if data[pos - 1] < 0x80:
            return pos
    raise WireError("varint over 10 bytes")


def _skip(data: bytes, pos: int, end: int, tag: int, depth: int) -> int:
    """Past the value of a field read as unknown (or known but not stored) after its tag."""
    kind = tag & 7
    if kind == 0:
        return _skip_varint(data, pos, end)
    if kind == 2:
        return _span(data, pos, end)[1]
    if kind in (1, 5):
        pos += 8 if kind == 1 else 4
        if pos > end:
            raise WireError("truncated fixed-width value")
        return pos
    if kind == 3:
        return _skip_group(data, pos, end, tag >> 3, depth - 1)
    raise WireError("end of group outside a group" if kind == 4 else f"wire type {kind}")


def _skip_field(data: bytes, pos: int, end: int, tag: int, depth: int) -> int:
    """`_skip` for a field of a message, where field number 0 is refused."""
    if tag < 8:
        raise WireError("field number 0")
    return _skip(data, pos, end, tag, depth)


def _skip_group(data: bytes, pos: int, end: int, field: int, depth: int) -> int:
    """Past a group up to its matching end tag; inside one, upb allows field number 0."""
    if depth < 0:
        raise WireError("groups nested too deep")
    while True:
        tag, pos = _tag(data, pos, end)
        if tag & 7 == 4:
            if tag >> 3 != field:
                raise WireError("end of group does not match its start")
            return pos
        pos = _skip(data, pos, end, tag, depth)


def _check_packed(data: bytes, pos: int, end: int) -> None:
    """A packed repeated int64 (`cpu_ids`): varints filling the field exactly."""
    while pos < end:
        pos = _skip_varint(data, pos, end)


# ---- messages ----------------------------------------------------------------------------------
# Every message loop reads (tag, value) pairs up to `end`; `depth` is the nesting left to groups.


def _fields(data: bytes, pos: int, end: int, depth: int) -> list[tuple[int, int, int]]:
    """(field, start, stop) of every length-delimited field of a message not on the hot path,
    the other fields checked and skipped."""
    found = []
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _tag(data, pos, end)
        if tag < 8:
            raise WireError("field number 0")
        if tag & 7 == 2:
            start, pos = _span(data, pos, end)
            found.append((tag >> 3, start, pos))
        else:
            pos = _skip(data, pos, end, tag, depth)
    return found


def _check_topology(data: bytes, pos: int, end: int, depth: int) -> None:
    """TopologyInfo{repeated NUMANode nodes = 1}, NUMANode{int64 ID = 1}: read, not kept."""
    for field, start, stop in _fields(data, pos, end, depth):
        if field == 1:
            _fields(data, start, stop, depth - 1)


def _check_memory(data: bytes, pos: int, end: int, depth: int) -> None:
    """ContainerMemory{memory_type = 1, uint64 size = 2, topology = 3}: read, not kept."""
    for field, start, stop in _fields(data, pos, end, depth):
        if field == 1:
            data[start:stop].decode()
        elif field == 3:
            _check_topology(data, start, stop, depth - 1)


def _claim_resource(data: bytes, pos: int, end: int, depth: int) -> ClaimResource:
    cdi: list[CDIDevice] = []
    driver = pool = device = ""
    share: str | None = None
    for field, start, stop in _fields(data, pos, end, depth):
        if field == 1:
            name = ""
            for inner, a, b in _fields(data, start, stop, depth - 1):
                if inner == 1:
                    name = data[a:b].decode()
            cdi.append(CDIDevice(name))
        elif field == 2:
            driver = data[start:stop].decode()
        elif field == 3:
            pool = data[start:stop].decode()
        elif field == 4:
            device = data[start:stop].decode()
        elif field == 5:
            share = data[start:stop].decode()
    return ClaimResource(tuple(cdi), driver, pool, device, share)


def _dynamic_resource(data: bytes, pos: int, end: int, depth: int) -> DynamicResource:
    name = namespace = ""
    resources: list[ClaimResource] = []
    for field, start, stop in _fields(data, pos, end, depth):
        if field == 2:
            name = data[start:stop].decode()
        elif field == 3:
            namespace = data[start:stop].decode()
        elif field == 4:
            resources.append(_claim_resource(data, start, stop, depth - 1))
    return DynamicResource(name, namespace, tuple(resources))


def _devices(data: bytes, pos: int, end: int, depth: int) -> ContainerDevices:
    resource = ""
    ids: list[str] = []
    while pos < end:
        tag = data[pos]
        pos += 1
        if tag > 0x7F:
            tag, pos = _tag(data, pos - 1, end)
        if tag & 7 != 2:
            pos = _skip_field(data, pos, end, tag, depth)
            continue
        size = data[pos] if pos < end else 0x80
        if size < 0x80:
            pos += 1
            stop = pos + size
            if stop > end:
                raise WireError("length past the end")
        else:
            pos, stop = _span(data, pos, end)
        if tag == 18:
            ids.append(data[pos:stop].decode())
        elif tag == 10:
            resource = data[pos:stop].decode()
        elif tag == 26:
            _check_topology(data, pos, stop, depth - 1)
        elif tag < 8:
            raise WireError("field number 0")
        pos = stop
    return ContainerDevices(resource, tuple(ids))


def _container(data: bytes, pos: int, end: int, depth: int) -> ContainerResources:
    name = ""
    devices: list[ContainerDevices] = []
    claims: list[DynamicResource] = []
    while pos < end:
        tag = data[pos]
        pos += 1
        if tag > 0x7F:
            tag, pos = _tag(data, pos - 1, end)
        if tag & 7 != 2:
            pos = _skip_field(data, pos, end, tag, depth)
            continue
        size = data[pos] if pos < end else 0x80
        if size < 0x80:
            pos += 1
            stop = pos + size
            if stop > end:
                raise WireError("length past the end")
        else:
            pos, stop = _span(data, pos, end)
        if tag == 10:
            name = data[pos:stop].decode()
        elif tag == 18:
            devices.append(_devices(data, pos, stop, depth - 1))
        elif tag == 26:
            _check_packed(data, pos, stop)
        elif tag == 34:
            _check_memory(data, pos, stop, depth - 1)
        elif tag == 42:
            claims.append(_dynamic_resource(data, pos, stop, depth - 1))
        elif tag < 8:
            raise WireError("field number 0")
        pos = stop
    return ContainerResources(name, tuple(devices), tuple(claims))


def _pod(data: bytes, pos: int, end: int, depth: int) -> PodResources:
    name = namespace = ""
    containers: list[ContainerResources] = []
    while pos < end:
        tag = data[pos]
        pos += 1
        if tag > 0x7F:
            tag, pos = _tag(data, pos - 1, end)
        if tag & 7 != 2:
            pos = _skip_field(data, pos, end, tag, depth)
            continue
        size = data[pos] if pos < end else 0x80
        if size < 0x80:
            pos += 1
            stop = pos + size
            if stop > end:
                raise WireError("length past the end")
        else:
            pos, stop = _span(data, pos, end)
        if tag == 10:
            name = data[pos:stop].decode()
        elif tag == 18:
            namespace = data[pos:stop].decode()
        elif tag == 26:
            containers.append(_container(data, pos, stop, depth - 1))
        elif tag < 8:
            raise WireError("field number 0")
        pos = stop
    return PodResources(name, namespace, tuple(containers))


def _allocatable(data: bytes, pos: int, end: int, depth: int) -> AllocatableResourcesResponse:
    devices: list[ContainerDevices] = []
    for field, start, stop in _fields(data, pos, end, depth):
        if field == 1:
            devices.append(_devices(data, start, stop, depth - 1))
        elif field == 2:
            _check_packed(data, start, stop)
        elif field == 3:
            _check_memory(data, start, stop, depth - 1)
    return AllocatableResourcesResponse(tuple(devices))
