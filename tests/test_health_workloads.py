"""Health joined to workloads: records and /status name who held a GPU when it went bad.

Real parts: the fake libnvidia-ml delivers the XID, the kubelet's own pod-resources server (Go,
`real_kubelet`) maps the devices, and the real kube-apiserver gives the pods' owners (real
Deployment, ReplicaSet and StatefulSet objects, read with the agent's pod-bound token under the
chart's RBAC). No stand-in: nothing here is a fault.
"""

from __future__ import annotations

import io
from typing import Any

import aiohttp
import orjson
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekube import objects as build
from tests.fakekubelet import pod
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube import objects as real
from tests.realkube.chart import AgentIdentity
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually


def _health(out: io.BytesIO) -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
    return [r for r in rows if r["kind"] == "health"]


def workloads(admin: Client, namespace: str, node: str) -> dict[str, dict[str, Any]]:
    """A Deployment's pod and a StatefulSet's pod on `node`, by name."""
    deploy = real.workload(admin, build.deployment("web", namespace=namespace))
    rs = build.replicaset("web-7d4b9c8f6d", namespace=namespace, owners=[build.owner(deploy)])
    sts = real.workload(admin, build.statefulset("db", namespace=namespace))
    owners = {
        "web-7d4b9c8f6d-abcde": build.owner(real.workload(admin, rs)),
        "db-0": build.owner(sts),
    }
    return {
        name: real.create_pod(admin, real.pod(namespace, name, node, owner=ref))
        for name, ref in owners.items()
    }


async def test_an_xid_record_and_status_name_the_pods_and_workloads_on_the_gpu(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    ns = real.unique("team")
    pods = workloads(kube_cluster.admin, ns, agent_node.node)
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:3]
    fake_nvml.apply(config)
    gpu1 = config.gpus[1].uuid or ""
    real_kubelet.pods = [
        pod(ns, "web-7d4b9c8f6d-abcde", "main", "nvidia.com/gpu", config.gpus[0].uuid or ""),
        pod(ns, "db-0", "main", "nvidia.com/gpu", gpu1),
        pod(ns, "ghost", "side", "nvidia.com/gpu", gpu1),  # unknown to the API
    ]
    real_kubelet.publish()
    out = io.BytesIO()
    s = settings(
        node_name=agent_node.node,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        nvml_library_path=str(fake_nvml.lib_path),
    )
    agent = Agent(s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(out)])
    async with running_agent(agent), aiohttp.ClientSession() as http:
        await eventually(lambda: out.getvalue().count(b'"kind":"allocation"') >= 3)
        await eventually(lambda: agent.collector.health.xid.alive)
        config.gpus[1].xids.append((79, 0))
        fake_nvml.apply(config)
        [record] = await eventually(lambda: [r for r in _health(out) if r["check"] == "xid"])
        async with http.get(f"http://127.0.0.1:{agent.bound_port}/status") as resp:
            status = await resp.json()
    assert (record["index"], record["state"], record["reason"]) == (
        1,
        "unhealthy",
        "XID 79: GPU has fallen off the bus",
    )
    assert record["holders"] == [
        {
            "namespace": ns,
            "pod": "db-0",
            "container": "main",
            "pod_uid": pods["db-0"]["metadata"]["uid"],
            "workload_kind": "StatefulSet",
            "workload_name": "db",
        },
        {"namespace": ns, "pod": "ghost", "container": "side"},
    ]
    gpus = status["health"]["gpus"]
    assert gpus[1]["state"] == "unhealthy" and gpus[1]["holders"] == record["holders"]
    assert "holders" not in gpus[0]  # healthy: nothing to join
    # the transition's log line names them too
    logged = [
        getattr(r, "holders", None)
        for r in caplog.records
        if r.getMessage() == "GPU health: xid is unhealthy"
    ]
    assert logged == [[f"{ns}/db-0/main", f"{ns}/ghost/side"]]
    # a record of a GPU nobody held carries no holders at all (its id is as before)
    assert all("holders" not in r for r in _health(out) if r["index"] != 1)
