"""The chart's RBAC as the real API server grants it: what the agent's ServiceAccount may do
(SelfSubjectRulesReview with its pod-bound token) is exactly the table in docs/security.md,
which is exactly what the agent asks of the API server with every feature on; it can neither
read Secrets nor change Pods."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.pods import pod as kubelet_pod
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekube import objects as build
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.chart import AgentIdentity, agent_identity, chart_values, install, render_for
from tests.realkube.cluster import ApiError, Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.realkube.objects import create_pod, pod, unique, workload
from tests.waiting import eventually

SECURITY = Path(__file__).resolve().parent.parent / "docs" / "security.md"
CORE_RESOURCES = {"nodes", "pods"}
Grant = tuple[str, str, str]  # (API group, resource, verb)


def documented_grants(only_default_namespace: bool = False) -> set[Grant]:
    """The rows of the RBAC table: `resource` (or `group/resource`, or `resource/sub`); with
    `only_default_namespace` those granted in the `default` namespace only (a Role there)."""
    section = SECURITY.read_text().split("## Kubernetes API: RBAC", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    grants: set[Grant] = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if only_default_namespace and "`default` namespace only" not in cells[2]:
            continue
        target = cells[0].strip("`")
        head, _, tail = target.partition("/")
        group, resource = ("", target) if not tail or head in CORE_RESOURCES else (head, tail)
        for verb in re.findall(r"`(\w+)`", cells[1]):
            grants.add((group, resource, verb))
    return grants


def granted(client: Client, namespace: str) -> set[Grant]:
    review = client.create(
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectRulesReview",
            "spec": {"namespace": namespace},
        },
    )
    assert not review["status"].get("incomplete"), review["status"]
    return {
        (group, resource, verb)
        for rule in review["status"]["resourceRules"]
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }


def allowed(
    client: Client, verb: str, resource: str, namespace: str = "default", group: str = ""
) -> bool:
    review = client.create(
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "verb": verb,
                    "resource": resource,
                    "group": group,
                    "namespace": namespace,
                }
            },
        },
    )
    return bool(review["status"]["allowed"])


@pytest.fixture(scope="module")
def every_feature(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[AgentIdentity, Client, str]:
    """An install with every permission-bearing feature on (labels, Node conditions, pod
    attribution, DRA as this cluster serves it); its agent and a bare ServiceAccount beside it,
    whose rules are what any authenticated caller gets."""
    namespace = "gpu-rbac"
    chart = render_for(
        kube_cluster,
        chart_values(health={"nodeConditions": True}),
        release="gpuid-rbac",
        namespace=namespace,
    )
    installed = install(kube_cluster.admin, chart)
    identity = agent_identity(
        kube_cluster, installed, unique("node"), tmp_path_factory.mktemp("rbac")
    )
    kube_cluster.admin.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}},
    )
    token = kube_cluster.admin.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/nobody/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 600},
        },
    )["status"]["token"]
    return identity, kube_cluster.as_token(token), namespace


def test_rules_review_is_the_documented_table(
    every_feature: tuple[AgentIdentity, Client, str],
) -> None:
    identity, nobody, namespace = every_feature
    baseline = granted(nobody, namespace)
    everywhere = documented_grants() - documented_grants(only_default_namespace=True)
    assert everywhere < documented_grants()
    for where in (namespace, "kube-system"):  # cluster-wide: the same everywhere
        assert granted(identity.client, where) - baseline == everywhere
    assert granted(identity.client, "default") - baseline == documented_grants()


GROUPS = {
    "replicasets": "apps",
    "jobs": "batch",
    "resourceslices": "resource.k8s.io",
    "events": "events.k8s.io",
}


def used_grants(agent: Agent) -> set[tuple[Grant, str]]:
    """(group, resource, verb) and answer code of every request the agent made."""
    used = set()
    for family in agent.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "gpuid_kube_api_requests_total" and sample.value:
                labels = sample.labels
                grant = (GROUPS.get(labels["resource"], ""), labels["resource"], labels["verb"])
                used.add((grant, labels["code"]))
    return used


async def test_the_agent_asks_for_exactly_what_it_is_granted(
    kube_cluster: KubeCluster,
    every_feature: tuple[AgentIdentity, Client, str],
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    identity, _, _ = every_feature
    admin, node = kube_cluster.admin, identity.node
    config = fakenvml.h100x8()
    # An XID that comes, goes (XID_HOLD) and comes again: an Event, then its series patched.
    config.gpus[0].xids += [(13, 0), (13, 60)]
    fake_nvml.apply(config)
    # Workloads whose owners the agent walks, and this node's ResourceSlice.
    namespace = unique("team")
    deploy = workload(admin, build.deployment("web", namespace=namespace))
    rs = workload(
        admin, build.replicaset("web-5d9c", namespace=namespace, owners=[build.owner(deploy)])
    )
    job = workload(admin, build.job("batch-1", namespace=namespace))
    create_pod(admin, pod(namespace, "web-5d9c-x1", node, owner=build.owner(rs)))
    create_pod(admin, pod(namespace, "batch-1-y2", node, owner=build.owner(job)))
    devices = [build.gpu_device(f"gpu-{i}", g.uuid or "") for i, g in enumerate(config.gpus)]
    admin.create(
        "/apis/resource.k8s.io/v1/resourceslices",
        build.resource_slice(f"{node}-gpu", node, devices),
    )
    real_kubelet.pods = [
        kubelet_pod(namespace, "web-5d9c-x1", "main", "nvidia.com/gpu", str(config.gpus[0].uuid))
    ]
    real_kubelet.publish()
    # A condition left by an earlier run on a GPU since replaced: the agent clears it.
    stale = {
        "type": "GpuXidError",
        "status": "True",
        "reason": "GpuRebootSuggested",
        "message": "GPU 1: XID 79",
    }
    admin.strategic_patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [stale]}})
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    s = settings(
        node_name=node,
        kube_api="auto",
        labels="on",
        label_startup_jitter=0,
        node_conditions=True,
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        xid_hold=1.0,
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    documented = documented_grants()
    async with running_agent(agent):
        await eventually(
            lambda: {grant for grant, _ in used_grants(agent)} >= documented, within=30
        )
    used = used_grants(agent)
    assert {grant for grant, _ in used} == documented
    assert {grant for grant, code in used if code in ("200", "201")} == documented
    # A 409 may come back when the conditions write moved the Node between the labeller's read
    # and its patch (retried at once); a refusal never.
    assert not [(grant, code) for grant, code in used if code in ("401", "403")], used


def test_agent_cannot_read_secrets_or_change_pods(
    every_feature: tuple[AgentIdentity, Client, str],
) -> None:
    identity, _, namespace = every_feature
    client = identity.client
    for verb in ("get", "list", "watch"):
        assert not allowed(client, verb, "secrets", namespace)
        assert not allowed(client, verb, "configmaps", namespace)
    for verb in ("create", "update", "patch", "delete"):
        assert not allowed(client, verb, "pods", namespace)
    assert not allowed(client, "create", "pods/exec", namespace)
    assert allowed(client, "watch", "pods", namespace)
    with pytest.raises(ApiError) as refused:
        client.get(f"/api/v1/namespaces/{namespace}/secrets")
    assert refused.value.status == 403
