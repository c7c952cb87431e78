"""The expected GPU count on a node that gets its GPUs only through DRA: the device plugin
reports none, so the DRA driver's ResourceSlices say how many GPUs the node has, and a GPU
that NVML loses fires the `gpu_count` check. /status says where the count came from.

The agent tests read this node's ResourceSlice from the real kube-apiserver (the agent's
pod-bound token, the chart's RBAC) and the kubelet's own pod-resources server (Go,
`real_kubelet`); no stand-in. `test_simulated_dra_node_with_a_lost_gpu` runs the agent's own
`--simulate dra` node, whose kubelet and slices are the simulation's."""

from __future__ import annotations

import io
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.kube.resourceslices import slice_devices
from gpuid_agent.state.attribution.dra import slice_gpu_count
from tests import conftest
from tests.conftest import node_health, running_agent
from tests.fakekube import objects
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.test_dra_agent import (
    NODE,
    DraNode,
    dra_node,  # noqa: F401  (fixture)
    get,
    kubelet_pods,
    make_agent,
    node_slice,
    nvml_config,
    samples,
)
from tests.waiting import eventually


def devices_of(*slices: dict[str, Any]) -> list[Any]:
    return [d for s in slices for d in slice_devices(s)[1]]


def test_each_physical_gpu_counts_once() -> None:
    gpu = objects.gpu_device
    node = objects.resource_slice(
        "s1",
        NODE,
        [
            gpu("gpu-0", "GPU-0"),
            gpu("gpu-1", "GPU-1"),
            # GPU 2 in MIG mode: listed only through its MIG devices
            gpu("gpu-2-mig-19-0-1", "MIG-a", parent_uuid="GPU-2"),
            gpu("gpu-2-mig-19-1-1", "MIG-b", parent_uuid="GPU-2"),
            # GPU 0 again, with one of its MIG devices (dynamic MIG lists both)
            gpu("gpu-0-mig-9-0-4", "MIG-c", parent_uuid="GPU-0"),
            gpu("not-a-gpu", "GPU-9"),
        ],
    )
    other_pool = objects.resource_slice("s2", NODE, [gpu("gpu-1", "GPU-1")])
    nic = objects.resource_slice("s3", NODE, [gpu("gpu-7", "GPU-7")])
    nic["spec"]["driver"] = "dra.net"
    assert slice_gpu_count(devices_of(node, other_pool, nic)) == 3
    assert slice_gpu_count([]) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.booleans()), max_size=24))
def test_the_count_is_the_distinct_minor_numbers(rows: list[tuple[int, bool, bool]]) -> None:
    """Whatever mix of full-GPU and MIG devices, in one pool or two, names a GPU's minor."""
    devices = [
        objects.gpu_device(
            f"gpu-{minor}-mig-19-{n}-1" if mig else f"gpu-{minor}",
            f"MIG-{n}" if mig else f"GPU-{minor}",
            parent_uuid=f"GPU-{minor}" if mig else None,
        )
        for n, (minor, mig, _) in enumerate(rows)
    ]
    first = objects.resource_slice(
        "a", NODE, [d for d, r in zip(devices, rows, strict=True) if r[2]]
    )
    second = objects.resource_slice(
        "b", NODE, [d for d, r in zip(devices, rows, strict=True) if not r[2]]
    )
    assert slice_gpu_count(devices_of(first, second)) == len({minor for minor, _, _ in rows})


async def test_a_gpu_lost_on_a_dra_only_node_fires_the_count_check(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    dra_node: DraNode,  # noqa: F811
) -> None:
    config = nvml_config()  # 3 GPUs, the first in MIG mode; the device plugin has none
    fake_nvml.apply(config)
    real_kubelet.pods = kubelet_pods(dra_node.node)
    assert real_kubelet.allocatable == ()
    real_kubelet.publish()
    dra_node.publish(node_slice(config, dra_node.node))
    agent = make_agent(
        fake_nvml, real_kubelet, io.BytesIO(), node_name=dra_node.node, kube_api="auto"
    )
    async with running_agent(agent):

        def count_check() -> Any:
            return node_health(agent).node_checks.get("gpu_count")

        async def counted_from_slices() -> Any:
            # Once the device plugin was asked (it has no GPUs) and the slices were listed; until
            # their first list arrives the kubelet's 0 is all the agent knows.
            status = orjson.loads(await get(agent, "/status"))
            asked = status["attribution"]["kubelet"]["gpu_devices_allocatable"] is not None
            listed = status["health"]["expected_gpus"]["source"] == "DRA ResourceSlices"
            return status if asked and listed else None

        status = await eventually(counted_from_slices)
        assert status["health"]["expected_gpus"] == {
            "count": 3,
            "source": "DRA ResourceSlices",
        }
        assert status["attribution"]["kubelet"]["gpu_devices_allocatable"] == 0
        await eventually(lambda: (c := count_check()) is not None and c.state == "healthy")

        config.gpus[2].lost = True  # NVML loses GPU 2
        fake_nvml.apply(config)
        check = await eventually(
            lambda: (c := count_check()) is not None and c.state == "unhealthy" and c
        )
        assert check.reason == "2 of 3 expected GPUs usable (DRA ResourceSlices)"
        assert check.action == "reboot"

        async def node_state() -> tuple[str, str] | None:
            # /gpu/metrics is rendered off the loop: the snapshot with the change follows
            [node] = samples(await get(agent, "/gpu/metrics"), "gpuid_node_health_state")
            state = (node["check"], node["state"])
            return state if state == ("gpu_count", "unhealthy") else None

        assert await eventually(node_state) == ("gpu_count", "unhealthy")


async def test_the_device_plugin_count_wins_when_it_has_gpus(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    dra_node: DraNode,  # noqa: F811
) -> None:
    """A node with GPUs from both the device plugin and DRA: the kubelet's count is the one."""
    config = nvml_config()
    fake_nvml.apply(config)
    real_kubelet.allocatable = [("nvidia.com/gpu", (config.gpus[1].uuid or "",))]
    real_kubelet.publish()
    dra_node.publish(node_slice(config, dra_node.node))
    agent = make_agent(
        fake_nvml, real_kubelet, io.BytesIO(), node_name=dra_node.node, kube_api="auto"
    )
    async with running_agent(agent):
        await eventually(
            lambda: (
                (last := agent.bus.latest) is not None
                and last.expected_gpus == (1, "kubelet allocatable")
            )
        )
        await eventually(lambda: agent.attributor.dra_gpu_count() == 3)
        # a collection that knew the slices' count too
        seq = agent.bus.latest.seq  # type: ignore[union-attr]
        await eventually(lambda: agent.bus.latest.seq > seq)  # type: ignore[union-attr]
        status = orjson.loads(await get(agent, "/status"))
        assert status["health"]["expected_gpus"]["source"] == "kubelet allocatable"


async def test_simulated_dra_node_with_a_lost_gpu() -> None:
    """`--simulate dra --fault lost:gpu3`: four GPUs in the driver's slice, one lost."""
    agent = Agent(
        conftest.settings(simulate="dra", fault="lost:gpu3", pod_resources_interval=0.05),
        exporters=[StdoutExporter(io.BytesIO())],
    )
    async with running_agent(agent):
        check = await eventually(
            lambda: (
                (c := node_health(agent).node_checks.get("gpu_count")) is not None
                and c.state == "unhealthy"
                and c
            )
        )
        assert check.reason == "3 of 4 expected GPUs usable (DRA ResourceSlices)"
        status = orjson.loads(await get(agent, "/status"))
        assert status["health"]["expected_gpus"] == {"count": 4, "source": "DRA ResourceSlices"}
