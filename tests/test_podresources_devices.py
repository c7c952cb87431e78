"""Device-id parsing and mapping onto an inventory, including hostile input."""

from __future__ import annotations

import string
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity, MigDevice, NodeInventory
from gpuid_agent.sources.kubelet import (
    DeviceAssignment,
    DeviceIdError,
    PodResourcesSnapshot,
    ResourceMatcher,
    parse_device_id,
)
from gpuid_agent.sources.kubelet.devices import MAX_DEVICE_ID
from gpuid_agent.state.attribution import DeviceIndex, attribute
from gpuid_agent.state.inventory import build_inventory

UUID0 = "GPU-2b7f5b8e-4c1a-4d6e-9a3b-1f2e3d4c5b6a"
UUID1 = "GPU-9c0d1e2f-3a4b-4c5d-8e6f-7a8b9c0d1e2f"
MIG_A = "MIG-11111111-2222-4333-8444-555555555555"
MIG_B = "MIG-aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"


def inventory() -> NodeInventory:
    """GPU 0 whole (minor 4, so index and device name differ), GPU 1 with two MIG devices."""
    gpus = [
        GpuIdentity(index=0, uuid=UUID0, minor_number=4, serial="S0"),
        GpuIdentity(
            index=1,
            uuid=UUID1,
            minor_number=5,
            serial="S1",
            mig_enabled=True,
            mig_devices=(
                MigDevice(0, MIG_A, gpu_instance_id=1, compute_instance_id=0, profile="3g.40gb"),
                MigDevice(1, MIG_B, gpu_instance_id=9, compute_instance_id=0, profile="1g.10gb"),
            ),
        ),
    ]
    return build_inventory(
        gpus,
        node="n",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version="570",
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )


# device id → (GPU UUID, MIG UUID, replica) on inventory()
RESOLVED = {
    UUID0: (UUID0, None, None),
    "GPU-" + UUID0[4:].upper(): (UUID0, None, None),
    f"{UUID0}::3": (UUID0, None, 3),
    "0": (UUID0, None, None),
    "1:1": (UUID1, MIG_B, None),
    "1:0::2": (UUID1, MIG_A, 2),
    MIG_A: (UUID1, MIG_A, None),
    f"{MIG_B}::0": (UUID1, MIG_B, 0),  # EKS
    f"MIG-{UUID1}/9/0": (UUID1, MIG_B, None),  # before R470
    "nvidia4": (UUID0, None, None),  # GKE names the device node, not the index
    "nvidia4/vgpu2": (UUID0, None, 2),
    "nvidia5/gi1": (UUID1, MIG_A, None),
    "nvidia5/gi9/vgpu1": (UUID1, MIG_B, 1),
}


@pytest.mark.parametrize(("device_id", "want"), RESOLVED.items())
def test_every_known_form_resolves(
    device_id: str, want: tuple[str, str | None, int | None]
) -> None:
    ref = parse_device_id(device_id)
    gpu, mig = DeviceIndex(inventory()).resolve(ref)
    assert (gpu.uuid, mig.uuid if mig else None, ref.replica) == want


@pytest.mark.parametrize(
    ("device_id", "reason"),
    [
        ("", "empty"),
        ("x" * (MAX_DEVICE_ID + 1), "too_long"),
        ("GPU-abc\n", "bad_characters"),
        ("GPU-ábc", "bad_characters"),
        (" 0", "bad_characters"),
        ("GPU-abc::", "bad_replica"),
        ("GPU-abc::x", "bad_replica"),
        ("GPU-abc::1::2", "bad_replica"),
        ("nvidia0/vgpu1::2", "bad_replica"),
        ("GPU-", "unknown_form"),
        ("GPU-xyz", "unknown_form"),
        ("nvidia", "unknown_form"),
        ("nvidia0/gi", "unknown_form"),
        ("amd0", "unknown_form"),
        ("-1", "unknown_form"),
        ("123456", "unknown_form"),
        ("MIG-GPU-abc/1", "unknown_form"),
    ],
)
def test_malformed_ids_say_why(device_id: str, reason: str) -> None:
    with pytest.raises(DeviceIdError) as caught:
        parse_device_id(device_id)
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    ("device_id", "reason"),
    [
        ("GPU-deadbeef", "unknown_gpu"),
        ("7", "unknown_gpu"),
        ("nvidia0", "unknown_gpu"),  # minor 0 does not exist; index 0 is nvidia4
        ("MIG-deadbeef", "unknown_mig"),
        ("0:0", "unknown_mig"),  # GPU 0 has no MIG devices
        ("nvidia5/gi3", "unknown_mig"),
    ],
)
def test_well_formed_ids_of_absent_devices(device_id: str, reason: str) -> None:
    with pytest.raises(DeviceIdError) as caught:
        DeviceIndex(inventory()).resolve(parse_device_id(device_id))
    assert caught.value.reason == reason


def test_resource_names_default_and_configured() -> None:
    match = ResourceMatcher(["example.com/gpu", "acme.io/accel-*"])
    for name in (
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-3g.40gb",
        "example.com/gpu",
        "acme.io/accel-big",
    ):
        assert match(name), name
    for name in ("nvidia.com/gpux", "amd.com/gpu", "cpu", "", "example.com/gpu2"):
        assert not match(name), name


hostile_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=300
) | st.text(alphabet=string.printable, max_size=40)
hex_id = st.from_regex(r"[0-9a-f]{1,8}(-[0-9a-f]{1,8}){0,4}", fullmatch=True)


@given(hostile_text)
def test_parser_only_ever_raises_device_id_error(text: str) -> None:
    try:
        ref = parse_device_id(text)
    except DeviceIdError as exc:
        reason = exc.reason
    else:
        reason = ""
        assert ref.device_id == text
    if not reason:
        assert text.isascii() and text.isprintable() and len(text) <= MAX_DEVICE_ID
    else:
        assert reason.isidentifier()


@given(
    hex_id,
    st.sampled_from(["GPU-", "MIG-"]),
    st.none() | st.integers(min_value=0, max_value=99_999),
)
def test_generated_uuid_forms_parse_back(body: str, prefix: str, replica: int | None) -> None:
    device_id = prefix + body + ("" if replica is None else f"::{replica}")
    ref = parse_device_id(device_id)
    assert ref.replica == replica
    assert (ref.gpu_uuid if prefix == "GPU-" else ref.mig_uuid) == prefix + body


@given(
    st.integers(min_value=0, max_value=99_999),
    st.none() | st.integers(min_value=0, max_value=99_999),
    st.none() | st.integers(min_value=0, max_value=99_999),
)
def test_generated_gke_forms_parse_back(minor: int, gi: int | None, vgpu: int | None) -> None:
    device_id = f"nvidia{minor}" + (f"/gi{gi}" if gi is not None else "")
    device_id += f"/vgpu{vgpu}" if vgpu is not None else ""
    ref = parse_device_id(device_id)
    assert (ref.gpu_minor, ref.gpu_instance_id, ref.replica) == (minor, gi, vgpu)
    assert ref.is_mig == (gi is not None)


assignment = st.builds(
    DeviceAssignment,
    namespace=st.sampled_from(["ns-a", "ns-b"]),
    pod=st.sampled_from(["p0", "p1", "p2", "p3"]),
    container=st.sampled_from(["c0", "c1"]),
    resource_name=st.just("nvidia.com/gpu"),
    device_id=st.sampled_from(sorted(RESOLVED)) | hostile_text,
)


@settings(max_examples=200)
@given(st.lists(assignment, max_size=40))
def test_every_assignment_is_attributed_or_counted(assignments: list[DeviceAssignment]) -> None:
    snapshot = PodResourcesSnapshot(tuple(assignments))
    result = attribute(inventory(), snapshot)
    assert result.state == "current"
    assert len(result.allocations) + len(result.unmapped) == len(assignments)
    known = {UUID0, UUID1, MIG_A, MIG_B}
    for device, holders in result.by_device.items():
        assert device in known
        keys = [(h.namespace, h.pod, h.container) for h in holders]
        assert len(keys) == len(set(keys))  # a container with two replicas holds it once
    for a in result.allocations:
        assert a.holder in result.holders(a.mig_uuid or a.gpu_uuid)
        # a MIG device's holder is not thereby a holder of the parent GPU
        if a.mig_uuid is not None and a.holder in result.holders(a.gpu_uuid):
            assert any(
                b.holder == a.holder and b.mig_uuid is None and b.gpu_uuid == a.gpu_uuid
                for b in result.allocations
            )


def test_no_snapshot_is_unavailable_and_no_inventory_is_pending() -> None:
    snapshot = PodResourcesSnapshot((DeviceAssignment("n", "p", "c", "nvidia.com/gpu", "0"),))
    assert attribute(inventory(), None).state == "unavailable"
    pending = attribute(None, snapshot)
    assert pending.state == "pending" and not pending.unmapped
