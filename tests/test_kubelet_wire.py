"""Pod-resources answers read by protobuf's parser (upb) through `wire`: real answers built with
the generated messages read back whole, and hostile bytes end in WireError or a message the
agent can use, never another exception."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.internal import api_implementation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.runtime.errors import PodResourcesError
from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.claims import ClaimAssignment
from gpuid_agent.sources.kubelet.devices import ResourceMatcher
from gpuid_agent.sources.kubelet.source import (
    DeviceAssignment,
    PodResourcesSource,
    snapshot_from,
)
from gpuid_agent.sources.kubelet.v1 import api_pb2 as pb

SLOW = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MATCHER = ResourceMatcher(["nvidia.com/gpu.shared"])


def test_protobuf_parses_with_upb() -> None:
    """The pure-Python backend would read the same bytes, tens of times slower."""
    assert api_implementation.Type() == "upb"


# ---- walking a message into plain tuples (known fields only) -----------------------------------


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
    return (c.name, _devices(c.devices), tuple(c.cpu_ids), len(c.memory), claims)


def plain_list(response: Any) -> tuple[Any, ...]:
    return tuple(
        (p.name, p.namespace, tuple(_container(c) for c in p.containers))
        for p in response.pod_resources
    )


def plain_allocatable(response: Any) -> tuple[Any, ...]:
    return (_devices(response.devices), tuple(response.cpu_ids), len(response.memory))


KINDS: dict[str, tuple[Callable[[bytes], Any], type[Any], Callable[[Any], Any]]] = {
    "list": (wire.parse_list, pb.ListPodResourcesResponse, plain_list),
    "allocatable": (wire.parse_allocatable, pb.AllocatableResourcesResponse, plain_allocatable),
}


def read(kind: str, data: bytes) -> Any:
    """The parsed answer, or "rejected" on WireError; anything else raised fails the test. An
    accepted answer must also go through what the agent makes of it."""
    parse, message, _ = KINDS[kind]
    error: wire.WireError | None = None
    try:
        answer = parse(data)
    except wire.WireError as exc:
        error = exc
    if error is not None:
        assert str(error) == f"not a well-formed {message.DESCRIPTOR.full_name}"
        assert error.__cause__ is None and error.__suppress_context__
        return "rejected"
    assert type(answer) is message
    if kind == "list":
        snapshot_from(answer, MATCHER)
    else:
        snapshot_from(pb.ListPodResourcesResponse(), MATCHER, answer)
    return answer


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
    driver_name=st.sampled_from(["gpu.nvidia.com", "net.example"]) | texts,
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


@SLOW
@given(answers)
def test_well_formed_answers_read_back_whole(answer: tuple[str, Any]) -> None:
    kind, message = answer
    got = read(kind, message.SerializeToString())
    assert got == message
    assert KINDS[kind][2](got) == KINDS[kind][2](message)


# ---- hostile bytes -----------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


def _ld(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


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
            raw = body if isinstance(body, bytes) else body.encode()
            out += _varint(len(raw)) + raw
        elif kind == 3 and depth:
            out += draw(wire_soup(depth - 1)) + _varint(field << 3 | 4)
    return bytes(out)


@SLOW
@given(st.sampled_from(list(KINDS)), st.binary(max_size=64) | wire_soup())
def test_random_bytes_rejected_or_read(kind: str, data: bytes) -> None:
    read(kind, data)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    kind, message = draw(answers)
    data = bytearray(message.SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "soup"]))
        if action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[at : at + draw(st.integers(1, 3))]
        elif action == "soup":
            data[at:at] = draw(wire_soup())
    return kind, bytes(data)


@SLOW
@given(mutated())
def test_damaged_answers_rejected_or_read(case: tuple[str, bytes]) -> None:
    read(*case)


@SLOW
@given(st.lists(pods, min_size=1, max_size=4), st.data())
def test_a_truncated_answer_is_rejected_unless_cut_between_pods(
    chosen: list[Any], data: st.DataObject
) -> None:
    """A List answer is its pods back to back: cut between two it reads as the pods before the
    cut, cut anywhere else it is rejected."""
    full = pb.ListPodResourcesResponse(pod_resources=chosen).SerializeToString()
    between = {
        len(pb.ListPodResourcesResponse(pod_resources=chosen[:n]).SerializeToString()): n
        for n in range(len(chosen))
    }
    cut = data.draw(st.integers(0, len(full) - 1))
    got = read("list", full[:cut])
    if cut in between:
        assert plain_list(got) == plain_list(
            pb.ListPodResourcesResponse(pod_resources=chosen[: between[cut]])
        )
    else:
        assert got == "rejected"


@st.composite
def wrong_wire_type(draw: st.DrawFn, field: int) -> bytes:
    """Field `field` (length-delimited in the schema) as a varint, fixed-width value or group."""
    kind = draw(st.sampled_from([0, 1, 3, 5]))
    value = {
        0: _varint(draw(st.integers(0, 2**64 - 1))),
        1: bytes(8),
        3: _varint(field << 3 | 4),
        5: bytes(4),
    }[kind]
    return _varint(field << 3 | kind) + value


@SLOW
@given(st.lists(pods, max_size=3), pods, st.integers(1, 3), st.data())
def test_known_fields_of_another_wire_type_are_skipped(
    others: list[Any], pod: Any, field: int, data: st.DataObject
) -> None:
    """A pod's name, namespace or containers, or the answer's pods, sent with another wire type
    is an unknown field: skipped, the rest read as sent."""
    inside = _ld(1, pod.SerializeToString() + data.draw(wrong_wire_type(field)))
    outside = data.draw(wrong_wire_type(1))
    sent = pb.ListPodResourcesResponse(pod_resources=others).SerializeToString()
    got = read("list", sent + inside + outside)
    assert plain_list(got) == plain_list(pb.ListPodResourcesResponse(pod_resources=[*others, pod]))


@SLOW
@given(answers, st.integers(0, 2**32 - 1) | st.sampled_from([2**31 - 2, 2**31, 2**32 - 1]))
def test_a_length_past_the_end_is_rejected(answer: tuple[str, Any], extra: int) -> None:
    """A length prefix running past the bytes sent (at the top), or past the end of the pod or
    device holding it (inside, that one well framed)."""
    kind, message = answer
    body = message.SerializeToString()
    field = _varint(1 << 3 | 2) + _varint(2 + extra) + b"x"  # 1 byte follows, 2 or more said
    assert read(kind, body + field) == "rejected"
    assert read(kind, body + _ld(1, field)) == "rejected"


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x80\x80\x80\x80\x80\x01",  # a length of 6 bytes
        b"\x0a" + b"\xff" * 10 + b"\x01",  # a length of 11 bytes
        b"\x0b" * 200 + b"\x0c" * 200,  # groups nested past upb's limit
        b"\x0e",  # wire type 6
        _ld(1, _ld(1, b"train-0") + b"\x0f"),  # wire type 7, inside a pod
    ],
)
def test_framing_faults_are_rejected(data: bytes) -> None:
    assert read("list", data) == "rejected"


# Where each string field of the schema sits, set on a fresh template answer.
UTF8_FIELDS: dict[str, tuple[str, Callable[[Any, str], None]]] = {
    "pod name": ("list", lambda m, v: setattr(m.pod_resources[0], "name", v)),
    "pod namespace": ("list", lambda m, v: setattr(m.pod_resources[0], "namespace", v)),
    "container name": ("list", lambda m, v: setattr(m.pod_resources[0].containers[0], "name", v)),
    "resource name": (
        "list",
        lambda m, v: setattr(m.pod_resources[0].containers[0].devices[0], "resource_name", v),
    ),
    "device id": (
        "list",
        lambda m, v: m.pod_resources[0].containers[0].devices[0].device_ids.append(v),
    ),
    "memory type": (
        "list",
        lambda m, v: m.pod_resources[0].containers[0].memory.add(memory_type=v),
    ),
    "claim name": ("list", lambda m, v: setattr(_dynamic(m), "claim_name", v)),
    "claim namespace": ("list", lambda m, v: setattr(_dynamic(m), "claim_namespace", v)),
    "driver name": ("list", lambda m, v: setattr(_dynamic(m).claim_resources[0], "driver_name", v)),
    "pool name": ("list", lambda m, v: setattr(_dynamic(m).claim_resources[0], "pool_name", v)),
    "device name": ("list", lambda m, v: setattr(_dynamic(m).claim_resources[0], "device_name", v)),
    "share id": ("list", lambda m, v: setattr(_dynamic(m).claim_resources[0], "share_id", v)),
    "CDI device name": (
        "list",
        lambda m, v: _dynamic(m).claim_resources[0].cdi_devices.add(name=v),
    ),
    "allocatable resource name": (
        "allocatable",
        lambda m, v: setattr(m.devices[0], "resource_name", v),
    ),
    "allocatable memory type": ("allocatable", lambda m, v: m.memory.add(memory_type=v)),
}


def _dynamic(message: Any) -> Any:
    return message.pod_resources[0].containers[0].dynamic_resources[0]


def _template(kind: str) -> Any:
    if kind == "allocatable":
        return pb.AllocatableResourcesResponse(devices=[_devs("nvidia.com/gpu", UUID)])
    return pb.ListPodResourcesResponse(
        pod_resources=[
            _pod("ml", "train-0", pb.ContainerResources(
                name="main",
                devices=[_devs("nvidia.com/gpu", UUID)],
                dynamic_resources=[pb.DynamicResource(claim_name="gpus", claim_resources=[
                    _dra("gpu-0")])],
            ))
        ]
    )  # fmt: skip


invalid_utf8 = st.sampled_from(
    [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"ok\x80ok"]
) | st.binary(min_size=1, max_size=12).filter(lambda b: not _is_utf8(b))


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@SLOW
@given(st.sampled_from(list(UTF8_FIELDS)), invalid_utf8)
def test_invalid_utf8_in_any_string_field_is_rejected(where: str, bad: bytes) -> None:
    """Each string field, used by the agent or not, carrying bytes that are not UTF-8 (same
    length as a valid value, so the framing stays intact)."""
    kind, put = UTF8_FIELDS[where]
    message = _template(kind)
    marker = "~" * len(bad)
    put(message, marker)
    data = message.SerializeToString()
    assert data.count(marker.encode()) == 1
    assert read(kind, data.replace(marker.encode(), bad)) == "rejected"
    assert read(kind, data) != "rejected"


def test_error_names_the_message_not_the_payload() -> None:
    secret = "tok-3f9a"
    data = _ld(1, _ld(1, secret.encode() + b"\xff"))
    with pytest.raises(wire.WireError) as raised:
        wire.parse_list(data)
    assert str(raised.value) == "not a well-formed v1.ListPodResourcesResponse"
    assert secret not in repr(raised.value) and secret not in str(raised.value.__context__)


async def test_a_malformed_answer_fails_the_poll_and_keeps_nothing() -> None:
    """The poller maps WireError to its own failure, and reads the next good answer."""

    class Kubelet:
        socket_path, timeout, restarts = "/kubelet.sock", 1.0, 0
        answer = _ld(1, _ld(1, b"secret\xff"))

        async def list_bytes(self) -> bytes:
            return self.answer

        async def allocatable(self) -> Any:
            raise PodResourcesError("unimplemented", "no GetAllocatableResources")

        async def close(self) -> None:
            pass

    kubelet = Kubelet()
    source = PodResourcesSource(kubelet, interval=1, stale_after=60)
    assert not await source.poll_once()
    assert source.failure is not None and source.failure.reason == "rpc_error"
    assert "secret" not in str(source.failure) and source.snapshot is None
    kubelet.answer = REALISTIC["device plugin"][0]
    assert await source.poll_once()
    assert source.snapshot is not None and source.snapshot.assignments


# ---- what the agent makes of real answers ------------------------------------------------------


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


def _answer(*pods: pb.PodResources) -> bytes:
    return pb.ListPodResourcesResponse(pod_resources=pods).SerializeToString()


UUID = "GPU-5b3e8a1c-6f0d-4a43-9a3e-0c1d2e3f4a5b"
MIG = "MIG-0a1b2c3d-0000-1111-2222-333344445555::2"
G = "nvidia.com/gpu"


def _dev(ns: str, pod: str, container: str, resource: str, dev_id: str) -> DeviceAssignment:
    return DeviceAssignment(ns, pod, container, resource, dev_id)


def _claimed(device: str, share: str | None = None) -> ClaimAssignment:
    return ClaimAssignment(
        "ml", "dra", "c", "ml", "gpus", "gpu.nvidia.com", "node-a", device, share
    )


# Each answer with the assignments and claims the agent must find in it, written out.
REALISTIC: dict[str, tuple[bytes, list[DeviceAssignment], list[ClaimAssignment], set[str]]] = {
    "device plugin": (
        _answer(
            _pod("ml", "train-0", pb.ContainerResources(name="main", devices=[_devs(
                G, UUID, numa=0)], cpu_ids=[2, 3], memory=[pb.ContainerMemory(
                memory_type="memory", size=2**30)])),
            _pod("web", "nginx", pb.ContainerResources(name="nginx")),
        ),
        [_dev("ml", "train-0", "main", G, UUID)],
        [],
        set(),
    ),
    "mig and index ids": (
        _answer(
            _pod("ml", "mig", pb.ContainerResources(name="a", devices=[
                _devs("nvidia.com/mig-1g.10gb", MIG),
                _devs(G, "1", "0"),
                _devs("example.com/nic", "nic0"),
            ])),
        ),
        [_dev("ml", "mig", "a", G, "0"), _dev("ml", "mig", "a", G, "1"),
         _dev("ml", "mig", "a", "nvidia.com/mig-1g.10gb", MIG)],
        [],
        set(),
    ),
    "time-slicing": (
        _answer(
            *(_pod("team", f"job-{r}", pb.ContainerResources(name="c", devices=[_devs(
                "nvidia.com/gpu.shared", f"{UUID}::{r}")])) for r in range(7, -1, -1)),
        ),
        [_dev("team", f"job-{r}", "c", "nvidia.com/gpu.shared", f"{UUID}::{r}") for r in range(8)],
        [],
        set(),
    ),
    "DRA claims": (
        _answer(
            _pod("ml", "dra", pb.ContainerResources(name="c", dynamic_resources=[
                pb.DynamicResource(claim_name="gpus", claim_namespace="ml", claim_resources=[
                    _dra("gpu-1-mig-19-0-1"), _dra("gpu-0"), _dra("gpu-2", share="s1")]),
                pb.DynamicResource(claim_name="nic", claim_resources=[
                    _dra("eth0", "net.example")]),
            ])),
        ),
        [],
        [_claimed("gpu-0"), _claimed("gpu-1-mig-19-0-1"), _claimed("gpu-2", "s1")],
        {"net.example"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REALISTIC)
def test_real_answers_give_the_assignments_they_name(name: str) -> None:
    data, assignments, claims, ignored = REALISTIC[name]
    allocatable = pb.AllocatableResourcesResponse(
        devices=[_devs(G, UUID, "0", numa=1), _devs("example.com/nic", "nic0")], cpu_ids=[0, 1]
    ).SerializeToString()
    snapshot = snapshot_from(wire.parse_list(data), MATCHER, wire.parse_allocatable(allocatable))
    assert list(snapshot.assignments) == assignments
    assert list(snapshot.claims) == claims
    assert snapshot.ignored_drivers == ignored
    assert snapshot.allocatable == ((G, "0"), (G, UUID))
    assert snapshot.pods == len(pb.ListPodResourcesResponse.FromString(data).pod_resources)
