"""The chart's own pod, rendered by the real Helm engine and run under podman as the kubelet
would run it (tests/image/podspec.py), on a node that is a directory: the kubelet's own
pod-resources server on the socket, the real kube-apiserver (with the chart's RBAC and own-node
policy) reached through in-cluster configuration with a token bound to the pod, and the fake
NVML injected as the NVIDIA toolkit injects the driver's library.
Any disagreement between the chart (securityContext, mount paths, env, probe paths and ports)
and what the agent needs fails here."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import fakenvml
from tests.chart_render import CHART, load_values, render
from tests.conftest import free_port
from tests.fakekubelet import pod
from tests.image import kubelet
from tests.image.podspec import Node, translate
from tests.realkube.chart import AgentIdentity, Installed, agent_identity
from tests.realkube.cluster import KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.realkube.objects import unique
from tests.waiting import eventually

MACHINE_ID = "5f1e0c2d9b8a47d6a3c2b1e0f9d8c7b6"
PRODUCT_UUID = "4c4c4544-0042-3010-8052-b4c04f4d3232"
BATCH_FILE = re.compile(r"^\d{20}-")


@dataclass
class Cluster:
    api: KubeCluster
    node: Node
    agent: AgentIdentity

    def node_labels(self) -> dict[str, str]:
        found: dict[str, str] = self.api.admin.get(f"/api/v1/nodes/{self.node.name}")["metadata"]["labels"]
        return found


@pytest.fixture
async def cluster(
    tmp_path: Path,
    nvml_injection: tuple[str, ...],
    gpus: fakenvml.FakeNvmlConfig,
    kube_cluster: KubeCluster,
    chart_installed: Installed,
) -> AsyncIterator[Cluster]:
    """The node's files, its kubelet with a pod holding two GPUs, the API server with the chart
    installed and the agent's pod on this node. The node's root is short: a unix socket path
    must stay under 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix="node-"))
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "machine-id").write_text(MACHINE_ID + "\n")
    dmi = root / "sys" / "class" / "dmi" / "id"
    dmi.mkdir(parents=True)
    (dmi / "product_uuid").write_text(PRODUCT_UUID + "\n")
    (dmi / "product_uuid").chmod(0o400)
    sockets = root / "var" / "lib" / "kubelet" / "pod-resources"
    sockets.mkdir(parents=True)
    uuids = [g.uuid for g in gpus.gpus]
    assert all(uuids)
    held = pod("ml", "trainer-0", "main", "nvidia.com/gpu", str(uuids[0]), str(uuids[1]))
    kube_let = KubeletServer(
        str(sockets / "kubelet.sock"),
        pods=[held],
        allocatable=(("nvidia.com/gpu", tuple(str(u) for u in uuids)),),
    )
    kube_let.start()
    agent = agent_identity(kube_cluster, chart_installed, unique("gpu-node"), tmp_path / "agent")
    ca = kube_cluster.ca.pem
    node = Node(agent.node, root, kube_cluster.port, ca, agent.token, injected=nvml_injection)
    try:
        yield Cluster(kube_cluster, node, agent)
    finally:
        kube_let.stop()
        shutil.rmtree(root, ignore_errors=True)


def pod_template(values: dict[str, Any]) -> dict[str, Any]:
    values = {**values, "image": {"repository": "localhost/gpuid-agent", "tag": "dev"}}
    template: dict[str, Any] = render(values).one("DaemonSet")["spec"]["template"]
    return template


async def scrape(port: int, path: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}") as r:
        assert r.status == 200, (path, r.status)
        return await r.text()


def holders(text: str) -> set[tuple[str, str, str]]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        (s.labels["uuid"], s.labels["namespace"], s.labels["pod"])
        for s in families["gpuid_gpu_allocation_info"].samples
    }


def batch_files(spool: Path) -> list[str]:
    return [p.name for p in spool.rglob("*") if p.is_file() and BATCH_FILE.match(p.name)]


CASES = {
    "default": {},
    "nonroot": load_values(CHART / "ci" / "nonroot-values.yaml"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
async def test_chart_pod_runs_the_agent(
    case: str,
    cluster: Cluster,
    tmp_path: Path,
    image_config: dict[str, Any],
    gpus: fakenvml.FakeNvmlConfig,
    facts: dict[str, object],
) -> None:
    values = CASES[case]
    host_port = free_port()
    template = pod_template(values)
    agent_port = template["spec"]["containers"][0]["ports"][0]["containerPort"]
    plan = translate(
        template,
        cluster.node,
        tmp_path / "pod",
        name=cluster.agent.pod["metadata"]["name"],
        namespace=cluster.agent.pod["metadata"]["namespace"],
        image_user=str(image_config["User"]),
        published={agent_port: host_port},
    )
    for init in plan.init:
        await kubelet.run_init(init)
    (main,) = plan.containers
    started = await kubelet.start(main, {agent_port: host_port})
    try:

        async def agent_ready() -> bool:
            try:
                return bool(await scrape(host_port, "/readyz"))
            except (aiohttp.ClientError, AssertionError):
                return False

        await eventually(agent_ready, within=90, step=0.1, what="/readyz answering 200")
        start_to_ready = time.monotonic() - started.started
        ready_at = await eventually(
            lambda: started.probes["readinessProbe"].first_pass(),
            within=90,
            step=0.2,
            what="the readiness probe passing",
        )
        _, status = await kubelet.podman("exec", started.name, "cat", "/proc/1/status")
        rss = kubelet.rss_kib(status)
        await eventually(
            lambda: started.probes["livenessProbe"].passed(),
            within=90,
            step=0.2,
            what="the liveness probe passing",
        )
        if values.get("podResources", {}).get("enabled", True):
            expected = {(str(g.uuid), "ml", "trainer-0") for g in gpus.gpus[:2]}

            async def attributed() -> bool:
                return holders(await scrape(host_port, "/gpu/metrics")) >= expected

            await eventually(attributed, within=30, step=0.5, what="/gpu/metrics holders")
        if values.get("nodeLabels", {}).get("mode", "on") == "on":
            prefix = "gpuid.github.com/"
            await eventually(
                lambda: any(k.startswith(prefix) for k in cluster.node_labels()),
                within=30,
                step=0.5,
                what="labels patched on the Node",
            )
        for log in started.probes.values():
            assert not log.failed(), (log.probe.kind, log.results)
        code, took, logs = await started.stop(plan.grace_seconds)
    finally:
        await started.remove()
    assert code == 0, logs[-3000:]
    assert took < plan.grace_seconds
    serials = {g.serial for g in gpus.gpus}
    assert serials <= set(re.findall(r'"gpu":"([^"]+)","read_time"', logs))
    spool = cluster.node.host_path("/var/lib/gpuid-agent/spool")
    if spool.exists():
        assert batch_files(spool) == [], "batches left in the spool after SIGTERM"
        user = values.get("podSecurity", {}).get("runAsUser", 0)
        assert kubelet.node_owned(str(spool))[0] == user
    facts[f"pod {case}"] = {
        "start_to_ready_s": round(start_to_ready, 2),
        "kubelet_ready_s": ready_at,
        "probes": {k: v.results[:4] for k, v in started.probes.items()},
        "rss_at_ready_mib": round(rss / 1024, 1),
        "sigterm_to_exit_s": round(took, 2),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
