"""DRA claims from the kubelet: NVIDIA device names parsed (hostile names included), the
pod-resources `dynamic_resources` read from the kubelet's own pod-resources server (Go,
`real_kubelet`: its protobuf, share_id included), and claims attributed through the node-local
fallback when no ResourceSlices can be read. No stand-in: nothing here is a fault."""

from __future__ import annotations

import logging
import string
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpuid_agent.facts import GpuIdentity, MigDevice, NodeInventory
from gpuid_agent.runtime.errors import DeviceIdError
from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.simulate.pods import (
    ClaimDevice,
    KubeletClaim,
    KubeletContainer,
    KubeletPod,
    claim_pod,
    pod,
)
from gpuid_agent.sources.kubelet import (
    ClaimAssignment,
    DraDeviceName,
    PodResourcesClient,
    PodResourcesSnapshot,
    PodResourcesSource,
    parse_dra_device,
)
from gpuid_agent.sources.kubelet.claims import MAX_DEVICE_NAME
from gpuid_agent.state.attribution import attribute
from gpuid_agent.state.inventory import build_inventory
from tests.realkube.kubelet import KubeletServer

NODE = "node-a"
GPU = "gpu.nvidia.com"
UUIDS = [f"GPU-{i:08x}-1111-4222-8333-444444444444" for i in range(4)]
MIG_3G = "MIG-aaaaaaaa-1111-4222-8333-444444444444"


def inventory() -> NodeInventory:
    gpus = [GpuIdentity(index=i, uuid=u, minor_number=i) for i, u in enumerate(UUIDS)]
    gpus[3] = GpuIdentity(
        index=3,
        uuid=UUIDS[3],
        minor_number=3,
        mig_enabled=True,
        mig_devices=(MigDevice(0, MIG_3G, 2, 0, "3g.40gb"),),
    )
    return build_inventory(
        gpus,
        node=NODE,
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version="580.65.06",
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )


# ---- device names -------------------------------------------------------------------------


def fields(parsed: DraDeviceName) -> tuple[object, ...]:
    return (
        parsed.kind,
        parsed.minor,
        parsed.profile_id,
        parsed.placement_start,
        parsed.placement_size,
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpu-0", ("gpu", 0, None, None, None)),
        ("gpu-17", ("gpu", 17, None, None, None)),
        # gpu-<minor>-mig-<GPU instance profile id>-<placement start>-<placement size>
        ("gpu-3-mig-9-0-4", ("mig", 3, 9, 0, 4)),  # H100 3g.40gb at slice 0
        ("gpu-3-mig-9-4-4", ("mig", 3, 9, 4, 4)),  # the other 3g.40gb
        ("gpu-0-mig-19-6-1", ("mig", 0, 19, 6, 1)),  # 1g.10gb
        ("gpu-1-mig-20-4-1", ("mig", 1, 20, 4, 1)),  # 1g.10gb+me
        ("gpu-2-mig-0-0-8", ("mig", 2, 0, 0, 8)),  # 7g.80gb: profile id 0
    ],
)
def test_nvidia_device_names(name: str, expected: tuple[object, ...]) -> None:
    parsed = parse_dra_device(name)
    assert parsed.name == name and fields(parsed) == expected


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty"),
        ("gpu-" + "1" * 70, "too_long"),
        ("gpu-0\n", "bad_characters"),
        ("gpu-é", "bad_characters"),
        ("gpu 0", "bad_characters"),
        ("gpu-", "unknown_form"),
        ("gpu--1", "unknown_form"),
        ("GPU-0", "unknown_form"),
        ("nic-0", "unknown_form"),
        # the profile's name in a device name: never the driver's (a dot is no DNS label)
        ("gpu-3-mig-3g.40gb-9-0", "unknown_form"),
        ("gpu-0-mig-1g.10gb-19-6", "unknown_form"),
        ("gpu-1-mig-1g.10gb+me-20-4", "unknown_form"),
        ("gpu-2-mig-1c.3g.40gb-9-4", "unknown_form"),
        ("gpu-0-mig-3g40gb-9-0", "unknown_form"),
        ("gpu-0-mig-9-0", "unknown_form"),
        ("gpu-0-mig-9-0-4-1", "unknown_form"),
        ("gpu-0-mig--9-0", "unknown_form"),
        ("gpu-0-mig-9--0-4", "unknown_form"),
        ("gpu-0-mig-9-0-", "unknown_form"),
        ("gpu-0-MIG-9-0-4", "unknown_form"),
        ("gpu-123456", "unknown_form"),
        ("gpu-99999999-mig-1-1-1", "unknown_form"),
        ("gpu-100000", "unknown_form"),
        ("gpu-99999", "ok"),
        ("gpu-0-mig-123456-0-1", "unknown_form"),
        ("gpu-0-mig-9-0-123456", "unknown_form"),
    ],
)
def test_malformed_device_names_say_why(name: str, reason: str) -> None:
    if reason == "ok":
        assert parse_dra_device(name).minor == 99999
        return
    with pytest.raises(DeviceIdError) as caught:
        parse_dra_device(name)
    assert caught.value.reason == reason


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(max_size=80),
        st.text(alphabet=string.printable, max_size=80),
        st.builds(
            lambda a, b: f"gpu-{a}-mig-{b}",
            st.text(alphabet="0123456789-", max_size=8),
            st.text(alphabet=string.ascii_lowercase + string.digits + ".+-_/\x00", max_size=40),
        ),
        st.builds(
            lambda a, b, c, d: f"gpu-{a}-mig-{b}-{c}-{d}",
            *[st.text(alphabet="0123456789-.", min_size=1, max_size=7) for _ in range(4)],
        ),
    )
)
def test_parser_only_ever_raises_device_id_error(text: str) -> None:
    try:
        parsed = parse_dra_device(text)
    except DeviceIdError as exc:
        reason = exc.reason
    else:
        reason = ""
        assert parsed.name == text and len(text) <= MAX_DEVICE_NAME
        assert 0 <= parsed.minor <= 99_999
        assert "." not in text  # what parses is a DNS label, as a ResourceSlice device name is
    assert reason in ("", "empty", "too_long", "bad_characters", "unknown_form", "out_of_range")


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 99_999),
    st.integers(0, 99_999),
    st.integers(0, 99_999),
    st.integers(0, 99_999),
)
def test_generated_mig_names_parse_back(minor: int, profile_id: int, start: int, size: int) -> None:
    name = f"gpu-{minor}-mig-{profile_id}-{start}-{size}"
    assert fields(parse_dra_device(name)) == ("mig", minor, profile_id, start, size)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 99_999),
    st.from_regex(r"[1-8]c?\.?[1-8]g\.[0-9]{1,3}gb(\+me)?", fullmatch=True),
    st.integers(0, 99_999),
    st.integers(0, 99_999),
)
def test_names_with_a_profile_name_are_unknown(
    minor: int, profile: str, profile_id: int, placement: int
) -> None:
    """`gpu-<minor>-mig-<profile>-<profileID>-<placement>` with a profile such as 3g.40gb: no
    DRA driver can publish it (a ResourceSlice device name is a DNS label), so it is no form."""
    with pytest.raises(DeviceIdError) as caught:
        parse_dra_device(f"gpu-{minor}-mig-{profile}-{profile_id}-{placement}")
    assert caught.value.reason in ("unknown_form", "too_long")


# ---- the kubelet's dynamic_resources --------------------------------------------------------


def claim(namespace: str, name: str, *devices: str, driver: str = GPU) -> KubeletClaim:
    return KubeletClaim(namespace, name, tuple(ClaimDevice(driver, NODE, d) for d in devices))


def dra_pods() -> list[KubeletPod]:
    shared = claim("ml", "shared-gpu", "gpu-2")
    return [
        claim_pod("ml", "train-0", "trainer", claim("ml", "train-gpus", "gpu-0", "gpu-1")),
        claim_pod("ml", "serve-a", "server", shared),  # one claim, two pods: both hold gpu-2
        claim_pod("ml", "serve-b", "server", shared),
        claim_pod("research", "small", "w", claim("research", "mig", "gpu-3-mig-9-0-4")),
        KubeletPod(
            "net",
            "rdma",
            (
                KubeletContainer(
                    "c",
                    devices=(("nvidia.com/gpu", (UUIDS[3],)),),  # device plugin beside DRA
                    claims=(claim("net", "nic", "eth1", driver="dra.net"),),  # not a GPU
                ),
            ),
        ),
        pod("kube-system", "plain", "c", "example.com/other", "x"),
    ]


def source(path: str) -> PodResourcesSource:
    return PodResourcesSource(
        PodResourcesClient(path, timeout=1.0),
        interval=0.02,
        stale_after=30.0,
        board=StatusBoard(),
        metrics=AttributionMetrics(CollectorRegistry()),
    )


async def test_dynamic_resources_are_read_and_other_drivers_ignored(
    real_kubelet: KubeletServer, caplog: pytest.LogCaptureFixture
) -> None:
    real_kubelet.pods = dra_pods()
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    caplog.set_level(logging.DEBUG, logger="gpuid_agent.podresources")
    try:
        assert await src.poll_once()
        assert await src.poll_once()
        snap = src.current()
        assert snap is not None
        got = {(c.pod, c.container, c.claim_namespace, c.claim_name, c.device) for c in snap.claims}
        assert got == {
            ("train-0", "trainer", "ml", "train-gpus", "gpu-0"),
            ("train-0", "trainer", "ml", "train-gpus", "gpu-1"),
            ("serve-a", "server", "ml", "shared-gpu", "gpu-2"),
            ("serve-b", "server", "ml", "shared-gpu", "gpu-2"),
            ("small", "w", "research", "mig", "gpu-3-mig-9-0-4"),
        }
        assert all(c.driver == GPU and c.pool == NODE for c in snap.claims)
        assert snap.ignored_drivers == {"dra.net"}
        assert [a.pod for a in snap.assignments] == ["rdma"]  # device plugin still read
        assert src.status()["dra_devices_claimed"] == 5
        said = [r for r in caplog.records if "non-GPU driver" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.DEBUG  # once, at debug
    finally:
        await src.client.close()


async def test_share_id_is_carried(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = [
        claim_pod(
            "ml",
            "p",
            "c",
            KubeletClaim("ml", "slice-a", (ClaimDevice(GPU, NODE, "gpu-0", share_id="7f3e"),)),
        )
    ]
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    try:
        assert await src.poll_once()
        snap = src.current()
        assert snap is not None
        (only,) = snap.claims
        assert only.share_id == "7f3e" and only.device_id == f"{NODE}/gpu-0/7f3e"
    finally:
        await src.client.close()


async def test_fallback_attributes_full_gpus_and_says_so(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = dra_pods()
    real_kubelet.publish()
    src = source(real_kubelet.socket_path)
    try:
        assert await src.poll_once()
        result = attribute(inventory(), src.current(), slices=None)
    finally:
        await src.client.close()
    held = {
        (a.holder.pod, a.gpu_uuid, a.claim.name, a.claim.source)
        for a in result.allocations
        if a.claim is not None
    }
    assert held == {
        ("train-0", UUIDS[0], "train-gpus", "dra-fallback"),
        ("train-0", UUIDS[1], "train-gpus", "dra-fallback"),
        ("serve-a", UUIDS[2], "shared-gpu", "dra-fallback"),
        ("serve-b", UUIDS[2], "shared-gpu", "dra-fallback"),
    }
    assert [h.pod for h in result.holders(UUIDS[2])] == ["serve-a", "serve-b"]
    # a MIG device's name does not say which MIG UUID it is: it waits for the slices
    (mig,) = result.unmapped
    assert (mig.pod, mig.reason, mig.claim) == ("small", "dra_mig_unresolved", "research/mig")
    plugin = [a for a in result.allocations if a.claim is None]
    assert [(a.holder.pod, a.gpu_uuid) for a in plugin] == [("rdma", UUIDS[3])]


def test_a_name_with_the_profiles_name_is_counted_as_unknown() -> None:
    """The old dotted MIG form is no name NVIDIA's driver publishes: unattributed, named."""
    claims = tuple(
        ClaimAssignment("ml", "p", "c", "ml", "mig", GPU, NODE, device)
        for device in ("gpu-3-mig-3g.40gb-9-0", "gpu-3-mig-9-0-4")
    )
    result = attribute(
        inventory(), PodResourcesSnapshot(assignments=(), claims=claims), slices=None
    )
    assert not result.allocations
    assert sorted(u.reason for u in result.unmapped) == ["dra_mig_unresolved", "unknown_form"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.builds(
            ClaimAssignment,
            namespace=st.sampled_from(["a", "b"]),
            pod=st.sampled_from(["p", "q"]),
            container=st.just("c"),
            claim_namespace=st.sampled_from(["a", "b"]),
            claim_name=st.text(max_size=10),
            driver=st.just(GPU),
            pool=st.text(max_size=10),
            device=st.one_of(
                st.sampled_from(["gpu-0", "gpu-3", "gpu-9", "gpu-3-mig-9-0-4"]),
                st.text(max_size=70),
            ),
            share_id=st.none() | st.text(max_size=5),
        ),
        max_size=12,
    )
)
def test_every_claimed_device_is_attributed_or_counted(claims: list[ClaimAssignment]) -> None:
    snapshot = PodResourcesSnapshot(assignments=(), claims=tuple(dict.fromkeys(claims)))
    result = attribute(inventory(), snapshot, slices=None)
    assert len(result.allocations) + len(result.unmapped) == len(snapshot.claims)
    for a in result.allocations:
        assert a.claim is not None and a.claim.source == "dra-fallback"
        assert a.gpu_uuid in UUIDS and a.mig_uuid is None
