"""ResourceSlice device names on the real API server and on the stand-in (tests/fakekube): a
device name is a DNS label, so the name NVIDIA's DRA driver gives a MIG device
(`gpu-0-mig-9-0-4`) is stored and one with the profile's name in it (`gpu-0-mig-3g.40gb-9-0`)
is refused. Each request goes to both servers and their answers must be the same, 422 Status
and all, so the stand-in cannot come to accept what a real cluster refuses."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import pytest

from gpuid_agent.simulate.dra import dra_slices
from gpuid_agent.simulate.profiles import dra_h100
from gpuid_agent.sources.kubelet import parse_dra_device
from tests.fakekube import FakeKube, ThreadedFakeKube, objects
from tests.fakekube.server import StatusError
from tests.realkube.cluster import ApiError, Client, KubeCluster
from tests.realkube.objects import unique

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
TOO_LONG = "gpu-0-mig-" + "9" * 60

# device names of one slice → whether the API server stores it
CASES = {
    "nvidia": (["gpu-0", "gpu-0-mig-9-0-4", "gpu-0-mig-14-4-2", "gpu-0-mig-19-6-1"], True),
    "dotted": (["gpu-1", "gpu-0-mig-3g.40gb-9-0"], False),
    "each-rule": ([TOO_LONG, "GPU-0", "gpu-1.", "", "gpu-1", "gpu-1", "x." + "y" * 70], False),
}


def slice_of(name: str, node: str, devices: list[str]) -> dict[str, Any]:
    listed = [objects.gpu_device(d, f"GPU-{i}") for i, d in enumerate(devices)]
    return objects.resource_slice(name, node, listed)


def answer(client: Client, method: str, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    try:
        return 200, client.request(method, path, body, **kw)
    except ApiError as exc:
        return exc.status, exc.body


@pytest.fixture(scope="module")
def stand_in() -> Iterator[Client]:
    with ThreadedFakeKube(resource_versions=("v1",)) as api:
        yield Client(api.url, ssl.create_default_context())


@pytest.mark.parametrize("case", list(CASES))
def test_device_names_are_refused_alike(
    kube_cluster: KubeCluster, stand_in: Client, case: str
) -> None:
    devices, stored = CASES[case]
    body = slice_of(unique(f"names-{case}"), unique("node"), devices)
    real = answer(kube_cluster.admin, "POST", SLICES, body)
    fake = answer(stand_in, "POST", SLICES, body)
    if stored:
        assert real[0] == fake[0] == 200
        for _, created in (real, fake):
            assert [d["name"] for d in created["spec"]["devices"]] == devices
        return
    assert real[0] == 422, real
    assert fake == real


def test_a_patch_to_a_dotted_name_is_refused_alike(
    kube_cluster: KubeCluster, stand_in: Client
) -> None:
    name = unique("names-patch")
    body = slice_of(name, unique("node"), ["gpu-0-mig-9-0-4"])
    patch = {"spec": {"devices": [objects.gpu_device("gpu-0-mig-3g.40gb-9-0", "MIG-0")]}}
    answers = []
    for client in (kube_cluster.admin, stand_in):
        client.create(SLICES, body)
        kind = "application/merge-patch+json"
        answers.append(answer(client, "PATCH", f"{SLICES}/{name}", patch, content_type=kind))
    real, fake = answers
    assert real[0] == 422 and "must not contain dots" in real[1]["message"], real
    assert fake == real


def test_the_simulated_drivers_slice_is_stored(kube_cluster: KubeCluster) -> None:
    """`--simulate dra` publishes what a real API server takes: NVIDIA's device names."""
    node = unique("node")
    (published,) = dra_slices(dra_h100(node), node)
    published["metadata"]["name"] = unique("sim")
    created = kube_cluster.admin.create(SLICES, published)
    names = [d["name"] for d in created["spec"]["devices"]]
    assert [n for n in names if parse_dra_device(n).kind == "mig"] == [
        "gpu-0-mig-9-0-4",  # 3g.40gb at memory slice 0
        "gpu-0-mig-14-4-2",  # 2g.20gb at 4
        "gpu-0-mig-19-6-1",  # 1g.10gb at 6
    ]


async def test_the_stand_in_refuses_test_data_no_cluster_would_hold() -> None:
    """Objects a test stores directly are checked as requests are: no dotted device name can
    reach the agent from the stand-in."""
    async with FakeKube(resource_versions=("v1",)) as kube:
        dotted = slice_of("s1", "n1", ["gpu-0-mig-3g.40gb-9-0"])
        with pytest.raises(StatusError, match="must not contain dots"):
            kube.create(dotted)
        stored = kube.create(slice_of("s1", "n1", ["gpu-0-mig-9-0-4"]))
        stored["spec"]["devices"][0]["name"] = "gpu-0-mig-3g.40gb-9-0"
        with pytest.raises(StatusError):
            kube.update(stored)
        with pytest.raises(StatusError):
            kube.patch("ResourceSlice", "s1", {"spec": {"devices": [{"name": "a.b"}]}})
        kept = kube.get("ResourceSlice", "s1")
        assert kept is not None and kept["spec"]["devices"][0]["name"] == "gpu-0-mig-9-0-4"
