"""The stdlib decoder of pod-resources answers against protobuf's own parser (upb): same
messages out of the same bytes, and the same bytes refused."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.devices import ResourceMatcher
from gpuid_agent.sources.kubelet.source import snapshot_from
from gpuid_agent.sources.kubelet.v1 import api_pb2 as pb

# ---- walking either kind of message into plain tuples ------------------------------------------


def _claim(resource: Any) -> tuple[Any, ...]:
    share = resource.share_id if resource.HasField("share_id") else None
    cdi = tuple(d.name for d in resource.cdi_devices)
    return (cdi, resource.driver_name, resource.pool_name, resource.device_name, share)


def _devices(devices: Any) -> tuple[Any, ...]:
    return tuple((d.resource_name, tuple(d.device_ids)) for d in devices)


def _container(c: Any) -> tuple[Any, ...]:
    claims = tuple(
        (d.claim_name, d.claim_namespace, tuple(_claim(r) for r in d.claim_resources))
        for d in c.dynamic_resources
    )
    return (c.name, _devices(c.devices), claims)


def plain_list(response: Any) -> tuple[Any, ...]:
    return tuple(
        (p.name, p.namespace, tuple(_container(c) for c in p.containers))
        for p in response.pod_resources
    )


def plain_allocatable(response: Any) -> tuple[Any, ...]:
    return _devices(response.devices)


KINDS = {
    "list": (pb.ListPodResourcesResponse, wire.parse_list, plain_list),
    "allocatable": (pb.AllocatableResourcesResponse, wire.parse_allocatable, plain_allocatable),
}


def outcomes(kind: str, data: bytes) -> tuple[Any, Any]:
    """(upb's reading, ours): the plain tuples, or "rejected"."""
    message, parse, plain = KINDS[kind]
    try:
        theirs: Any = plain(message.FromString(data))
    except DecodeError:
        theirs = "rejected"
    try:
        ours: Any = plain(parse(data))
    except wire.WireError:
        ours = "rejected"
    return theirs, ours


# ---- messages built with the generated classes -------------------------------------------------

texts = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    st.sampled_from(["", "\x00", "GPU-0f3a::3", "nvidia0/gi1", "ü€😀", "a" * 300]),
)
int64s = st.integers(-(2**63), 2**63 - 1)
topologies = st.builds(
    pb.TopologyInfo, nodes=st.lists(st.builds(pb.NUMANode, ID=int64s), max_size=3)
)
memories = st.builds(
    pb.ContainerMemory,
    memory_type=texts,
    size=st.integers(0, 2**64 - 1),
    topology=st.none() | topologies,
)
devices = st.builds(
    pb.ContainerDevices,
    resource_name=texts,
    device_ids=st.lists(texts, max_size=4),
    topology=st.none() | topologies,
)
claim_resources = st.builds(
    pb.ClaimResource,
    cdi_devices=st.lists(st.builds(pb.CDIDevice, name=texts), max_size=2),
    driver_name=texts,
    pool_name=texts,
    device_name=texts,
    share_id=st.none() | texts,
)
containers = st.builds(
    pb.ContainerResources,
    name=texts,
    devices=st.lists(devices, max_size=3),
    cpu_ids=st.lists(int64s, max_size=4),
    memory=st.lists(memories, max_size=2),
    dynamic_resources=st.lists(
        st.builds(
            pb.DynamicResource,
            claim_name=texts,
            claim_namespace=texts,
            claim_resources=st.lists(claim_resources, max_size=2),
        ),
        max_size=2,
    ),
)
pods = st.builds(
    pb.PodResources, name=texts, namespace=texts, containers=st.lists(containers, max_size=3)
)
list_answers = st.builds(pb.ListPodResourcesResponse, pod_resources=st.lists(pods, max_size=4))
allocatable_answers = st.builds(
    pb.AllocatableResourcesResponse,
    devices=st.lists(devices, max_size=4),
    cpu_ids=st.lists(int64s, max_size=4),
    memory=st.lists(memories, max_size=2),
)
answers = st.one_of(
    st.tuples(st.just("list"), list_answers), st.tuples(st.just("allocatable"), allocatable_answers)
)
SLOW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(answers)
def test_well_formed_answers_read_as_protobuf_reads_them(answer: tuple[str, Any]) -> None:
    kind, message = answer
    theirs, ours = outcomes(kind, message.SerializeToString())
    assert ours == theirs != "rejected"
    assert ours == KINDS[kind][2](message)


@settings(SLOW, max_examples=100)
@given(st.lists(pods, min_size=1, max_size=6), st.lists(st.lists(st.integers(0, 5)), max_size=4))
def test_a_decoder_reuses_unchanged_pods(pool: list[Any], picks: list[list[int]]) -> None:
    """Answers drawn from one pool of pods, read in turn by one decoder (with a damaged one
    among them): each read as protobuf reads it, a pod seen in the last answer reused."""
    decoder = wire.ListDecoder()
    last: dict[bytes, Any] = {}
    for pick in picks:
        chosen = [pool[i % len(pool)] for i in pick]
        data = pb.ListPodResourcesResponse(pod_resources=chosen).SerializeToString()
        with pytest.raises(wire.WireError):
            decoder.parse(data + b"\x0a\x05\x0a\x03\xff")
        ours = decoder.parse(data)
        assert plain_list(ours) == plain_list(pb.ListPodResourcesResponse.FromString(data))
        for message, read in zip(chosen, ours.pod_resources, strict=True):
            raw = message.SerializeToString()
            assert raw not in last or read is last[raw]
        last = {m.SerializeToString(): r for m, r in zip(chosen, ours.pod_resources, strict=True)}


# ---- hostile bytes -----------------------------------------------------------------------------


@st.composite
def merged(draw: st.DrawFn) -> bytes:
    """Two encodings of each message back to back, nested: protobuf reads them as one message
    (a singular field's last occurrence wins, repeated fields append)."""

    def twice(strategy: st.SearchStrategy[Any]) -> bytes:
        return b"".join(
            m.SerializeToString() for m in draw(st.lists(strategy, min_size=2, max_size=2))
        )

    claim = _ld(4, twice(claim_resources))
    dynamic = _ld(5, twice(st.builds(pb.DynamicResource, claim_name=texts)) + claim)
    container = _ld(3, twice(containers) + _ld(2, twice(devices)) + dynamic)
    return _ld(1, twice(pods) + container)


@settings(SLOW, max_examples=100)
@given(merged())
def test_repeated_occurrences_merge_as_in_protobuf(data: bytes) -> None:
    theirs, ours = outcomes("list", data)
    assert ours == theirs != "rejected"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


@st.composite
def wire_soup(draw: st.DrawFn, depth: int = 3) -> bytes:
    """Fields of any number and wire type, nested messages and groups, mostly well framed:
    reaches the corners (wrong wire types, groups, packed ids) random bytes seldom do."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 4))):
        field = draw(st.sampled_from([1, 1, 2, 2, 3, 3, 4, 5, 6, 15, 16, 2**29 - 1, 0]))
        kind = draw(st.sampled_from([0, 0, 1, 2, 2, 2, 2, 2, 2, 3, 5] * 4 + [4, 6, 7]))
        out += _varint(field << 3 | kind)
        if kind == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif kind in (1, 5):
            out += draw(st.binary(min_size=4 if kind == 5 else 8, max_size=4 if kind == 5 else 8))
        elif kind == 2:
            body = draw(wire_soup(depth - 1)) if depth and draw(st.booleans()) else draw(texts)
            out += _varint(len(body if isinstance(body, bytes) else body.encode()))
            out += body if isinstance(body, bytes) else body.encode()
        elif kind == 3 and depth:
            out += draw(wire_soup(depth - 1)) + _varint(field << 3 | 4)
    return bytes(out)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    kind, message = draw(answers)
    data = bytearray(message.SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "soup"]))
        if action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[at : at + draw(st.integers(1, 3))]
        elif action == "truncate":
            del data[at:]
        elif action == "soup":
            data[at:at] = draw(wire_soup())
    return kind, bytes(data)


@SLOW
@given(st.sampled_from(list(KINDS)), st.binary(max_size=64) | wire_soup())
def test_random_bytes_rejected_or_read_alike(kind: str, data: bytes) -> None:
    theirs, ours = outcomes(kind, data)
    assert ours == theirs


@SLOW
@given(mutated())
def test_damaged_answers_rejected_or_read_alike(case: tuple[str, bytes]) -> None:
    theirs, ours = outcomes(*case)
    assert ours == theirs


def _ld(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


def _groups(count: int) -> bytes:
    return b"\x2b" * count + b"\x2c" * count  # field 5, unknown everywhere


# Cases where what upb does is not obvious; each was checked against it and is kept.
CORNERS = {
    "unknown group skipped": (b"\x2b\x08\x01\x2c", True),
    "group for a known field number is unknown": (b"\x0b\x0c", True),
    "field 0 inside a group": (b"\x2b\x02\x01a\x03\x04\x2c", True),
    "field 0 outside a group": (b"\x02\x00", False),
    "end group outside a group": (b"\x2c", False),
    "end group of another field": (b"\x2b\x34", False),
    "unterminated group": (b"\x2b\x08\x01", False),
    "100 nested groups at the top": (_groups(100), True),
    "101 nested groups at the top": (_groups(101), False),
    "99 nested groups in a pod": (_ld(1, _groups(99)), True),
    "100 nested groups in a pod": (_ld(1, _groups(100)), False),
    "wire type 6": (b"\x2e", False),
    "wire type 7": (b"\x2f", False),
    "varint of 10 bytes, overflow bits dropped": (b"\x10" + b"\xff" * 9 + b"\x7f", True),
    "varint of 11 bytes": (b"\x10" + b"\xff" * 10 + b"\x01", False),
    "tag of 5 bytes within 32 bits": (b"\xf8\xff\xff\xff\x0f\x00", True),
    "tag over 32 bits": (b"\x88\x80\x80\x80\x10\x01", False),
    "tag of 6 bytes": (b"\x88\x80\x80\x80\x80\x00\x01", False),
    "length of 5 bytes": (b"\x0a\x80\x80\x80\x80\x00", True),
    "length of 6 bytes": (b"\x0a\x80\x80\x80\x80\x80\x00", False),
    "bad UTF-8 in a kept string": (_ld(1, _ld(1, b"\xff")), False),
    "surrogate in UTF-8": (_ld(1, _ld(1, b"\xed\xa0\x80")), False),
    "bad UTF-8 in an unknown field": (_ld(1, _ld(15, b"\xff")), True),
    "bad UTF-8 in the reserved claim field": (_ld(1, _ld(3, _ld(5, _ld(1, b"\xff")))), True),
    "bad UTF-8 in a memory type, not kept": (_ld(1, _ld(3, _ld(4, _ld(1, b"\xff")))), False),
    "bad topology, not kept": (_ld(1, _ld(3, _ld(2, _ld(3, _ld(1, b"\x08"))))), False),
    "truncated packed cpu ids": (_ld(1, _ld(3, _ld(3, b"\x01\x82"))), False),
    "cpu ids as fixed64 are unknown": (_ld(1, _ld(3, b"\x19" + bytes(8))), True),
    "memory size as a string is unknown": (_ld(1, _ld(3, _ld(4, _ld(2, b"abc")))), True),
    "empty share id is present": (_ld(1, _ld(3, _ld(5, _ld(4, _ld(5, b""))))), True),
}


@pytest.mark.parametrize("name", CORNERS)
def test_corner_cases_match_upb(name: str) -> None:
    data, accepted = CORNERS[name]
    theirs, ours = outcomes("list", data)
    assert ours == theirs
    assert (ours != "rejected") is accepted


def test_error_names_the_fault_not_the_payload() -> None:
    secret = "tok-3f9a"
    data = _ld(1, _ld(1, secret.encode() + b"\xff"))
    with pytest.raises(wire.WireError) as raised:
        wire.parse_list(data)
    assert str(raised.value) == "string field is not valid UTF-8"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


# ---- what the agent makes of them --------------------------------------------------------------


def _answer(*pods: pb.PodResources) -> bytes:
    return pb.ListPodResourcesResponse(pod_resources=pods).SerializeToString()


def _pod(ns: str, name: str, *containers: pb.ContainerResources) -> pb.PodResources:
    return pb.PodResources(namespace=ns, name=name, containers=containers)


def _devs(resource: str, *ids: str, numa: int | None = None) -> pb.ContainerDevices:
    topology = None if numa is None else pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)])
    return pb.ContainerDevices(resource_name=resource, device_ids=ids, topology=topology)


def _dra(device: str, driver: str = "gpu.nvidia.com", share: str | None = None) -> Any:
    return pb.ClaimResource(
        cdi_devices=[pb.CDIDevice(name=f"k8s.{driver}/claim=uid-{device}")],
        driver_name=driver,
        pool_name="node-a",
        device_name=device,
        share_id=share,
    )


UUID = "GPU-5b3e8a1c-6f0d-4a43-9a3e-0c1d2e3f4a5b"
REALISTIC = {
    "device plugin": _answer(
        _pod("ml", "train-0", pb.ContainerResources(name="main", devices=[_devs(
            "nvidia.com/gpu", UUID, numa=0)], cpu_ids=[2, 3], memory=[pb.ContainerMemory(
            memory_type="memory", size=2**30)])),
        _pod("web", "nginx", pb.ContainerResources(name="nginx")),
    ),
    "mig and index ids": _answer(
        _pod("ml", "mig", pb.ContainerResources(name="a", devices=[
            _devs("nvidia.com/mig-1g.10gb", "MIG-0a1b2c3d-0000-1111-2222-333344445555::2"),
            _devs("nvidia.com/gpu", "0", "1"),
            _devs("example.com/nic", "nic0"),
        ])),
    ),
    "time-slicing": _answer(
        *(_pod("team", f"job-{r}", pb.ContainerResources(name="c", devices=[_devs(
            "nvidia.com/gpu.shared", f"{UUID}::{r}")])) for r in range(4)),
    ),
    "DRA claims": _answer(
        _pod("ml", "dra", pb.ContainerResources(name="c", dynamic_resources=[
            pb.DynamicResource(claim_name="gpus", claim_namespace="ml", claim_resources=[
                _dra("gpu-0"), _dra("gpu-1-mig-1g.10gb-19-0"), _dra("gpu-2", share="s1")]),
            pb.DynamicResource(claim_name="nic", claim_resources=[_dra("eth0", "net.example")]),
        ])),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REALISTIC)
def test_snapshots_equal_to_protobufs(name: str) -> None:
    data = REALISTIC[name]
    allocatable = pb.AllocatableResourcesResponse(
        devices=[_devs("nvidia.com/gpu", UUID, "0", numa=1)], cpu_ids=[0, 1]
    ).SerializeToString()
    matcher = ResourceMatcher(["nvidia.com/gpu.shared"])
    theirs = snapshot_from(
        pb.ListPodResourcesResponse.FromString(data),
        matcher,
        pb.AllocatableResourcesResponse.FromString(allocatable),
    )
    ours = snapshot_from(wire.parse_list(data), matcher, wire.parse_allocatable(allocatable))
    assert ours == theirs
    assert ours.ignored_drivers == theirs.ignored_drivers
    assert ours.assignments or ours.claims
