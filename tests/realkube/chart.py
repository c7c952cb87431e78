"""The chart applied to the real API server as `helm install` would apply it (the objects a
cluster enforces: ServiceAccount, ClusterRole and its binding, the own-node admission policy),
and the agent's identity as the chart's pod on a node gets it: a token from the TokenRequest API
bound to that Pod, which carries the node's name."""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chart_render import NAMESPACE, RELEASE, Rendered, render
from tests.realkube.cluster import ApiError, Client, KubeCluster, collection_path
from tests.realkube.objects import ensure_namespace, node

# What a cluster enforces of the chart; nothing runs the DaemonSet here.
ENFORCED_KINDS = (
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def chart_values(validation_actions: tuple[str, ...] = ("Deny",), **more: Any) -> dict[str, Any]:
    """Default values with the own-node policy forced on, as the suite's cluster runs it."""
    return {"ownNodePolicy": {"force": True, "validationActions": list(validation_actions)}, **more}


@dataclass
class Installed:
    rendered: Rendered
    namespace: str

    @property
    def service_account(self) -> str:
        return str(self.rendered.one("ServiceAccount")["metadata"]["name"])

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    @property
    def cluster_role(self) -> dict[str, Any]:
        return self.rendered.one("ClusterRole")

    def enforced(self) -> list[dict[str, Any]]:
        return [o for o in self.rendered.objects if o["kind"] in ENFORCED_KINDS]

    def pod_template(self) -> dict[str, Any]:
        return copy.deepcopy(self.rendered.one("DaemonSet")["spec"]["template"])


def render_for(
    cluster: KubeCluster,
    values: dict[str, Any],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Installed:
    """The chart as `helm install <release> -n <namespace>` renders it for this cluster: its
    version and the APIs its discovery reports."""
    rendered = render(
        values,
        kube_version=str(cluster.admin.get("/version")["gitVersion"]),
        api_versions=cluster.api_versions(),
        release=release,
        namespace=namespace,
    )
    return Installed(rendered, namespace)


def install(admin: Client, chart: Installed) -> Installed:
    """Create what a cluster enforces of the rendered chart."""
    ensure_namespace(admin, chart.namespace)
    for obj in chart.enforced():
        admin.apply(_placed(obj, chart.namespace))
    return chart


def uninstall(admin: Client, chart: Installed) -> None:
    for obj in reversed(chart.enforced()):
        placed = _placed(obj, chart.namespace)
        try:
            admin.delete(f"{collection_path(placed)}/{placed['metadata']['name']}")
        except ApiError as exc:
            if exc.status != 404:
                raise


def _placed(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    """`obj` with the release namespace helm would give it (charts may leave it out)."""
    return {**obj, "metadata": {"namespace": namespace, **obj["metadata"]}}


@dataclass
class AgentIdentity:
    """The agent of one node: its Pod, the pod-bound token, a kubeconfig holding that token and
    the cluster's CA (the in-cluster configuration, as a file), and a client acting as it."""

    node: str
    pod: dict[str, Any]
    token: str
    kubeconfig: Path
    client: Client

    def service_account_dir(self, directory: Path, ca: Path) -> Path:
        """The files a pod finds in /var/run/secrets/kubernetes.io/serviceaccount."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(self.token)
        (directory / "ca.crt").write_bytes(ca.read_bytes())
        (directory / "namespace").write_text(str(self.pod["metadata"]["namespace"]))
        return directory


def agent_identity(
    cluster: KubeCluster, chart: Installed, node_name: str, directory: Path
) -> AgentIdentity:
    """The chart's pod scheduled on `node_name` (created if missing) and its bound token."""
    admin = cluster.admin
    try:
        admin.create("/api/v1/nodes", node(node_name))
    except ApiError as exc:
        if exc.status != 409:
            raise
    template = chart.pod_template()
    pod_name = f"gpuid-agent-{uuid.uuid4().hex[:8]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": pod_name, "namespace": chart.namespace},
        "spec": {**template["spec"], "nodeName": node_name},
    }
    created = admin.create(f"/api/v1/namespaces/{chart.namespace}/pods", pod)
    bound = {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": created["metadata"]["uid"]}
    answer = admin.create(
        f"/api/v1/namespaces/{chart.namespace}/serviceaccounts/{chart.service_account}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600, "boundObjectRef": bound},
        },
    )
    token = answer["status"]["token"]
    kubeconfig = write_kubeconfig(directory / "kubeconfig", cluster.url, cluster.ca_path, token)
    return AgentIdentity(node_name, created, token, kubeconfig, cluster.as_token(token))


PROBE_NODE = "policy-probe"


def write_kubeconfig(path: Path, server: str, ca: Path, token: str) -> Path:
    """A kubeconfig that authenticates with `token` alone (what in-cluster configuration is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cluster_entry = {"server": server, "certificate-authority": str(ca)}
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "real", "cluster": cluster_entry}],
                "users": [{"name": "agent", "user": {"token": token}}],
                "contexts": [{"name": "real", "context": {"cluster": "real", "user": "agent"}}],
                "current-context": "real",
            }
        )
    )
    path.chmod(0o600)
    return path


def wait_policy_enforced(
    cluster: KubeCluster, identity: AgentIdentity, timeout: float = 30.0
) -> None:
    """Until the admission policy refuses `identity` a dry-run label on another Node (a policy
    takes effect once the API server's informer has it and its binding)."""
    try:
        cluster.admin.create("/api/v1/nodes", node(PROBE_NODE))
    except ApiError as exc:
        if exc.status != 409:
            raise
    deadline = time.monotonic() + timeout
    while True:
        try:
            identity.client.strategic_patch(
                f"/api/v1/nodes/{PROBE_NODE}?dryRun=All",
                {"metadata": {"labels": {"gpuid.github.com/probe": "x"}}},
            )
        except ApiError as exc:
            if "may only modify its own Node" in str(exc):
                return
        if time.monotonic() > deadline:
            raise TimeoutError("own-node admission policy not enforced")
        time.sleep(0.2)
