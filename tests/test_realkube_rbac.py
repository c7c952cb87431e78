"""The chart's RBAC as the real API server grants it: what the agent's ServiceAccount may do
(SelfSubjectRulesReview with its pod-bound token) is exactly the table in docs/security.md,
and it can neither read Secrets nor change Pods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.realkube.chart import AgentIdentity, agent_identity, chart_values, install, render_for
from tests.realkube.cluster import ApiError, Client, KubeCluster
from tests.realkube.objects import unique

SECURITY = Path(__file__).resolve().parent.parent / "docs" / "security.md"
CORE_RESOURCES = {"nodes", "pods"}
Grant = tuple[str, str, str]  # (API group, resource, verb)


def documented_grants() -> set[Grant]:
    """The rows of the RBAC table: `resource` (or `group/resource`, or `resource/sub`)."""
    section = SECURITY.read_text().split("## Kubernetes API: RBAC", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    grants: set[Grant] = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        target = cells[0].strip("`")
        head, _, tail = target.partition("/")
        group, resource = ("", target) if not tail or head in CORE_RESOURCES else (head, tail)
        for verb in re.findall(r"`(\w+)`", cells[1]):
            grants.add((group, resource, verb))
    return grants


def granted(client: Client, namespace: str) -> set[Grant]:
    review = client.create(
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": namespace}},
    )
    assert not review["status"].get("incomplete"), review["status"]
    return {
        (group, resource, verb)
        for rule in review["status"]["resourceRules"]
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }


def allowed(client: Client, verb: str, resource: str, namespace: str = "default", group: str = "") -> bool:
    review = client.create(
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "group": group, "namespace": namespace}},
        },
    )
    return bool(review["status"]["allowed"])


@pytest.fixture(scope="module")
def every_feature(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[AgentIdentity, Client, str]:
    """An install with every permission-bearing feature on (labels, Node conditions, pod
    attribution, DRA as this cluster serves it); its agent and a bare ServiceAccount beside it,
    whose rules are what any authenticated caller gets."""
    namespace = "gpu-rbac"
    chart = render_for(kube_cluster, chart_values(health={"nodeConditions": True}), release="gpuid-rbac", namespace=namespace)
    installed = install(kube_cluster.admin, chart)
    identity = agent_identity(kube_cluster, installed, unique("node"), tmp_path_factory.mktemp("rbac"))
    kube_cluster.admin.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}},
    )
    token = kube_cluster.admin.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/nobody/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    return identity, kube_cluster.as_token(token), namespace


def test_rules_review_is_the_documented_table(every_feature: tuple[AgentIdentity, Client, str]) -> None:
    identity, nobody, namespace = every_feature
    baseline = granted(nobody, namespace)
    for where in (namespace, "default", "kube-system"):  # cluster-wide: the same everywhere
        assert granted(identity.client, where) - baseline == documented_grants()


def test_agent_cannot_read_secrets_or_change_pods(every_feature: tuple[AgentIdentity, Client, str]) -> None:
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
