"""The node's ResourceSlices against the fake Kubernetes API: version discovery (v1, v1beta1),
node scope, a MIG device appearing mid-run through the watch, 410 resumption, RBAC refusal and
an API without resource.k8s.io; and hostile slice objects."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.sources.kube.resourceslices import (
    ResourceSliceCache,
    SliceDevice,
    slice_devices,
)
from gpuid_agent.sources.kubelet import ClaimAssignment, PodResourcesSnapshot
from gpuid_agent.sources.kubelet.claims import GPU_DRIVERS
from gpuid_agent.state.attribution import attribute
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.test_dra_claims import MIG_3G, NODE, UUIDS, inventory
from tests.waiting import eventually

GPU = "gpu.nvidia.com"
MIG_NEW = "MIG-bbbbbbbb-1111-4222-8333-444444444444"


def node_slice(version: str, *, extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices = [objects.gpu_device(f"gpu-{i}", UUIDS[i], version=version) for i in range(3)]
    devices.append(
        objects.gpu_device("gpu-3-mig-9-0-4", MIG_3G, parent_uuid=UUIDS[3], version=version)
    )
    return objects.resource_slice(
        f"{NODE}-gpu.nvidia.com-x7k2p", NODE, devices + (extra or []), version=version
    )


async def client_for(kube: FakeKube, tmp_path: Path) -> KubeClient:
    path = write_kubeconfig(tmp_path / "kubeconfig", kube.url)
    client = await create_kube_client("auto", environ={"KUBECONFIG": str(path)})
    assert client is not None
    return client


@pytest.fixture
async def running(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[FakeKube, ResourceSliceCache]]:
    """A fake API serving the resource.k8s.io versions the test passes (indirectly), and a
    started cache following it."""
    versions: tuple[str, ...] = request.param
    async with FakeKube(resource_versions=versions) as kube:
        client = await client_for(kube, tmp_path)
        cache = ResourceSliceCache(NODE, board=StatusBoard(), watch_timeout=30, backoff_max=0.2)
        assert cache.open(client)
        task = asyncio.create_task(cache.run())
        try:
            yield kube, cache
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()


def claim(device: str, pod: str = "p") -> ClaimAssignment:
    return ClaimAssignment("ml", pod, "c", "ml", f"claim-{pod}", GPU, NODE, device)


def attributed(cache: ResourceSliceCache, *devices: str) -> dict[str, tuple[str, str | None, str]]:
    snapshot = PodResourcesSnapshot(assignments=(), claims=tuple(claim(d) for d in devices))
    slices = cache.lookup if cache.available else None
    result = attribute(inventory(), snapshot, slices=slices)
    out = {}
    for a in result.allocations:
        assert a.claim is not None
        out[a.device_id.rsplit("/", 1)[-1]] = (a.gpu_uuid, a.mig_uuid, a.claim.source)
    for u in result.unmapped:
        out[u.device_id.rsplit("/", 1)[-1]] = ("", None, u.reason)
    return out


@pytest.mark.parametrize("running", [("v1",)], indirect=True)
async def test_v1_slices_join_gpus_and_mig_devices(
    running: tuple[FakeKube, ResourceSliceCache],
) -> None:
    kube, cache = running
    kube.create(node_slice("v1"))
    other = objects.resource_slice(
        "node-b-gpu", "node-b", [objects.gpu_device("gpu-0", "GPU-ffff")]
    )
    kube.create(other)  # another node's slice: not listed here
    kube.create(
        objects.resource_slice(
            f"{NODE}-nic", NODE, [objects.gpu_device("eth1", "x")], driver="dra.net"
        )
    )
    await eventually(lambda: cache.available and cache.lookup(GPU, NODE, "gpu-0") is not None)
    assert cache.version == "v1" and cache.status()["version"] == "resource.k8s.io/v1"
    assert cache.status()["devices"] == 4  # node-b's and the NIC driver's devices are not kept
    assert attributed(cache, "gpu-0", "gpu-2", "gpu-3-mig-9-0-4") == {
        "gpu-0": (UUIDS[0], None, "dra"),
        "gpu-2": (UUIDS[2], None, "dra"),
        "gpu-3-mig-9-0-4": (UUIDS[3], MIG_3G, "dra"),
    }
    lists = [r for r in kube.requests if "resourceslices" in r.path and r.verb in ("list", "watch")]
    assert lists and all(r.query.get("fieldSelector") == f"spec.nodeName={NODE}" for r in lists)
    assert all("/resource.k8s.io/v1/" in r.path for r in lists)


@pytest.mark.parametrize("running", [("v1beta1",)], indirect=True)
async def test_v1beta1_is_found_and_a_mig_device_appears_mid_run(
    running: tuple[FakeKube, ResourceSliceCache],
) -> None:
    kube, cache = running
    created = kube.create(node_slice("v1beta1"))
    await eventually(lambda: cache.available and cache.status()["devices"] == 4)
    assert cache.version == "v1beta1"
    tried = [r.path for r in kube.requests if r.verb == "list"]
    assert tried[:3] == [
        "/apis/resource.k8s.io/v1/resourceslices",
        "/apis/resource.k8s.io/v1beta2/resourceslices",
        "/apis/resource.k8s.io/v1beta1/resourceslices",
    ]
    # GPU 3 is published only through its MIG device: its whole-GPU name falls back, marked
    assert attributed(cache, "gpu-3") == {"gpu-3": (UUIDS[3], None, "dra-fallback")}
    new_mig = "gpu-0-mig-19-6-1"
    # Not published yet: a MIG device cannot be told from its name alone
    assert attributed(cache, new_mig)[new_mig] == ("", None, "dra_mig_unresolved")
    cache.changed.clear()
    # The driver creates a MIG device on GPU 0 and republishes its slice (watch MODIFIED)
    created["spec"]["devices"].append(
        objects.gpu_device(new_mig, MIG_NEW, parent_uuid=UUIDS[0], version="v1beta1")
    )
    kube.update(created)
    await eventually(lambda: cache.lookup(GPU, NODE, new_mig) is not None)
    assert cache.changed.is_set()  # attribution is recomputed without a restart
    found = cache.lookup(GPU, NODE, new_mig)
    assert found is not None and (found.uuid, found.parent_uuid) == (MIG_NEW, UUIDS[0])
    # The UUID is known; once NVML reports the MIG device it joins (not in this inventory)
    assert attributed(cache, new_mig)[new_mig] == ("", None, "unknown_gpu")
    # A second slice ADDED for the same pool
    kube.create(
        objects.resource_slice(
            f"{NODE}-extra",
            NODE,
            [objects.gpu_device("gpu-9", "GPU-99999999", version="v1beta1")],
            version="v1beta1",
        )
    )
    await eventually(lambda: cache.lookup(GPU, NODE, "gpu-9") is not None)
    kube.delete("ResourceSlice", f"{NODE}-extra")
    await eventually(lambda: cache.lookup(GPU, NODE, "gpu-9") is None)


@pytest.mark.parametrize("running", [()], indirect=True)
async def test_without_resource_api_the_fallback_is_marked(
    running: tuple[FakeKube, ResourceSliceCache],
) -> None:
    _, cache = running
    await eventually(lambda: cache.status()["last_error"] is not None)
    assert not cache.available
    assert "not served" in (getattr(cache.board.get(cache_component()), "reason", "") or "")
    assert attributed(cache, "gpu-1") == {"gpu-1": (UUIDS[1], None, "dra-fallback")}


async def test_forbidden_then_allowed(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.create(node_slice("v1"))
        kube.inject(403, path="/apis/resource.k8s.io/v1/resourceslices", times=2)
        client = await client_for(kube, tmp_path)
        cache = ResourceSliceCache(NODE, board=StatusBoard(), watch_timeout=30, backoff_max=0.1)
        assert cache.open(client)
        task = asyncio.create_task(cache.run())
        try:
            await eventually(
                lambda: (
                    "forbidden" in (getattr(cache.board.get(cache_component()), "reason", "") or "")
                )
            )
            assert not cache.available
            await eventually(lambda: cache.available)  # RBAC granted later: followed
            assert cache.lookup(GPU, NODE, "gpu-1") is not None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()


def cache_component() -> str:
    return "kube-resourceslices"


@pytest.mark.parametrize("running", [("v1",)], indirect=True)
async def test_watch_resumes_and_relists_after_410(
    running: tuple[FakeKube, ResourceSliceCache],
) -> None:
    kube, cache = running
    kube.create(node_slice("v1"))
    await eventually(lambda: cache.available and kube.open_watches == 1)
    relists = sum(1 for r in kube.requests if r.verb == "list")
    kube.expire_watches()  # watch ended with 410: list again
    extra = objects.resource_slice(
        f"{NODE}-late", NODE, [objects.gpu_device("gpu-7", "GPU-77777777")]
    )
    kube.create(extra)
    await eventually(lambda: cache.lookup(GPU, NODE, "gpu-7") is not None)
    assert sum(1 for r in kube.requests if r.verb == "list") > relists


def test_older_pool_generations_are_ignored() -> None:
    cache = ResourceSliceCache(NODE)
    old = objects.resource_slice("a", NODE, [objects.gpu_device("gpu-0", "GPU-old")], generation=1)
    new = objects.resource_slice("b", NODE, [objects.gpu_device("gpu-0", "GPU-new")], generation=2)
    cache.load([old, new], "a simulated node")
    found = cache.lookup(GPU, NODE, "gpu-0")
    assert found is not None and found.uuid == "GPU-new"


@pytest.mark.parametrize("running", [("v1",)], indirect=True)
async def test_a_refused_resource_version_is_dropped_for_a_fresh_list(
    running: tuple[FakeKube, ResourceSliceCache],
) -> None:
    kube, cache = running
    kube.create(node_slice("v1"))
    await eventually(lambda: cache.available and kube.open_watches == 1)
    lists = kube.count("list", status=200)
    # a string resourceVersion the server then refuses (400) on the resumed watch
    odd = {"metadata": {"name": "odd", "resourceVersion": "not-a-version"}}
    kube.send_raw(json.dumps({"type": "ADDED", "object": odd}).encode(), "resourceslices")
    await eventually(lambda: cache.status()["resource_version"] == "not-a-version")
    kube.close_watches()
    await eventually(lambda: kube.count("watch", status=400) >= 1)
    await eventually(lambda: kube.count("list", status=200) > lists and cache.available)
    await real_change_arrives(kube, cache)


async def real_change_arrives(kube: FakeKube, cache: ResourceSliceCache) -> None:
    """A slice created now is followed, and so are the slices before it."""
    name = f"gpu-{next(_serial)}"
    kube.create(objects.resource_slice(f"{NODE}-{name}", NODE, [objects.gpu_device(name, "GPU-1")]))
    await eventually(lambda: cache.available and cache.lookup(GPU, NODE, name) is not None)
    assert cache.lookup(GPU, NODE, "gpu-0") is not None
    assert cache.board.is_ok(cache_component())


_serial = itertools.count(100)  # device names unique across hypothesis examples on one server
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {
                "spec": st.fixed_dictionaries(
                    {
                        "driver": st.sampled_from([GPU, "x"]) | json_values,
                        "pool": st.fixed_dictionaries({"name": json_values}) | json_values,
                        "devices": st.lists(
                            st.fixed_dictionaries({"name": json_values, "attributes": json_values})
                            | st.fixed_dictionaries(
                                {"name": st.text(max_size=10), "basic": json_values}
                            ),
                            max_size=4,
                        )
                        | json_values,
                    }
                )
            }
        ),
    )
)
def test_hostile_slices_never_raise(obj: Any) -> None:
    if not isinstance(obj, dict):
        obj = {"spec": obj}
    generation, devices = slice_devices(obj)
    assert isinstance(generation, int)
    for d in devices:
        assert d.driver == GPU and isinstance(d.name, str)
        assert d.uuid is None or (isinstance(d.uuid, str) and 0 < len(d.uuid) <= 128)


def places(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (object keys, array indices), the document's own first."""
    found = [at]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += places(value, (*at, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            found += places(value, (*at, index))
    return found


@st.composite
def near_gpu_slices(draw: st.DrawFn) -> dict[str, Any]:
    """A slice as NVIDIA's driver publishes it (v1 or v1beta1), or as another driver would,
    with a name and pool of its own, and up to three places in it (the driver, the pool, a
    device, an attribute, a UUID…) replaced by hostile JSON or a plausible wrong value."""
    n = next(_serial)
    version = draw(st.sampled_from(["v1", "v1beta1"]))
    devices = [
        objects.gpu_device(f"near-{n}-{i}", draw(st.sampled_from(UUIDS)), version=version)
        for i in range(draw(st.integers(1, 3)))
    ]
    doc = objects.resource_slice(
        f"near-{n}",
        NODE,
        devices,
        version=version,
        driver=draw(st.sampled_from([GPU, "dra.net", "x", ""])),
        pool=f"near-pool-{n}",
        generation=n,
    )
    wrong = st.sampled_from(["x", "", "dra.net", GPU, "u" * 129, {"string": ""}]) | json_values
    for _ in range(draw(st.integers(0, 3))):
        *parents, last = draw(st.sampled_from(places(doc)[1:]))
        target = doc
        for step in parents:
            target = target[step]
        target[last] = draw(wrong)
    return doc


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        json_values
        | st.fixed_dictionaries({"type": json_values, "object": json_values})
        | near_gpu_slices(),
        max_size=8,
    ),
    st.sampled_from(["v1", "v1beta1"]),
    st.integers(0, 8),
)
def test_hostile_lists_are_survived(items: list[Any], version: str, at: int) -> None:
    """Hostile items and damaged GPU slices around one sound GPU slice: the sound slice's
    devices are all found as it gives them, and nothing gets in that is not a GPU driver's
    named device with its UUIDs absent or sane."""
    sound = objects.resource_slice(
        "sound",
        NODE,
        [
            objects.gpu_device("gpu-0", UUIDS[0], version=version),
            objects.gpu_device("gpu-3-mig", MIG_3G, parent_uuid=UUIDS[3], version=version),
        ],
        version=version,
        pool="sound-pool",
    )
    items.insert(at, sound)
    cache = ResourceSliceCache(NODE)
    cache.load(items, "a hostile node")
    whole = SliceDevice(GPU, "sound-pool", "gpu-0", UUIDS[0])
    mig = SliceDevice(GPU, "sound-pool", "gpu-3-mig", MIG_3G, UUIDS[3])
    assert [cache.lookup(GPU, "sound-pool", d.name) for d in (whole, mig)] == [whole, mig]
    for d in cache.devices():
        assert d.driver in GPU_DRIVERS and isinstance(d.pool, str) and isinstance(d.name, str)
        for uuid in (d.uuid, d.parent_uuid):
            assert uuid is None or (isinstance(uuid, str) and 0 < len(uuid) <= 128)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(resource_versions=("v1",)) as server:
        server.create(node_slice("v1"))
        yield server


watch_events = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"])
        | json_values,
        "object": st.fixed_dictionaries(
            {"metadata": st.fixed_dictionaries({"name": json_values}) | json_values},
            optional={"spec": json_values, "code": json_values, "message": json_values},
        )
        | json_values,
    }
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=st.lists(watch_events | json_values, min_size=1, max_size=6))
async def test_hostile_watch_events_are_survived(
    kube: FakeKube, tmp_path: Path, lines: list[Any]
) -> None:
    client = await client_for(kube, tmp_path)
    cache = ResourceSliceCache(NODE, board=StatusBoard(), watch_timeout=30, backoff_max=0.05)
    assert cache.open(client)
    watches = kube.count("watch", status=200)
    task = asyncio.create_task(cache.run())
    try:
        await eventually(lambda: cache.available and kube.count("watch", status=200) > watches)
        for line in lines:
            kube.send_raw(json.dumps(line).encode(), "resourceslices")
        await real_change_arrives(kube, cache)
        assert not task.done()
        assert all(d.driver == GPU for d in cache.devices())
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        kube.close_watches()
