"""Objects the tests create on the real API server, as a kubelet or a controller would have."""

from __future__ import annotations

import uuid
from typing import Any

from tests.realkube.cluster import ApiError, Client


def unique(prefix: str) -> str:
    """A name no other test of the session uses (tests share one cluster)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def ensure_namespace(admin: Client, name: str) -> None:
    """The namespace and its `default` ServiceAccount (the ServiceAccount admission plugin
    refuses pods without it, and no controller creates it here)."""
    for path, obj in (
        (
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        ),
        (
            f"/api/v1/namespaces/{name}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
        ),
    ):
        try:
            admin.create(path, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise


def node(
    name: str, *, labels: dict[str, str] | None = None, provider_id: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"providerID": provider_id} if provider_id else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
    }


def pod(
    namespace: str,
    name: str,
    node_name: str,
    *,
    containers: tuple[str, ...] = ("main",),
    labels: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": c, "image": "registry.invalid/workload:1"} for c in containers],
        },
    }


def create_pod(admin: Client, obj: dict[str, Any], *, phase: str = "Running") -> dict[str, Any]:
    """Create the pod and set its status as the kubelet would once its containers run."""
    namespace = obj["metadata"]["namespace"]
    ensure_namespace(admin, namespace)
    created = admin.create(f"/api/v1/namespaces/{namespace}/pods", obj)
    status = {
        "phase": phase,
        "containerStatuses": [
            {
                "name": c["name"],
                "ready": phase == "Running",
                "restartCount": 0,
                "image": c["image"],
                "imageID": "",
                "containerID": f"containerd://{uuid.uuid4().hex}",
                "state": {"running": {}} if phase == "Running" else {"terminated": {"exitCode": 0}},
            }
            for c in obj["spec"]["containers"]
        ],
    }
    path = f"/api/v1/namespaces/{namespace}/pods/{obj['metadata']['name']}/status"
    admin.merge_patch(path, {"status": status})
    return created


_API_VERSIONS = {
    "Deployment": "apps/v1",
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1",
    "Job": "batch/v1",
    "CronJob": "batch/v1",
}


def workload(admin: Client, obj: dict[str, Any]) -> dict[str, Any]:
    """Create a workload object built by `tests.fakekube.objects` on the real server: its
    apiVersion set, and the restart policy a Job's pods must have."""
    real = {"apiVersion": _API_VERSIONS[obj["kind"]], **obj}
    spec = real["spec"]
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template")
    if obj["kind"] in ("Job", "CronJob") and template is not None:
        template["spec"]["restartPolicy"] = "Never"
    namespace = real["metadata"].get("namespace", "default")
    ensure_namespace(admin, namespace)
    group = _API_VERSIONS[obj["kind"]]
    plural = obj["kind"].lower() + "s"
    return admin.create(f"/apis/{group}/namespaces/{namespace}/{plural}", real)  # type: ignore[no-any-return]


def remove_pod(admin: Client, namespace: str, name: str) -> None:
    """Delete a pod as it ends on a node: a pod bound to a node only gets a deletionTimestamp
    until its kubelet confirms the containers stopped (a delete with no grace), which no
    kubelet does here."""
    admin.request(
        "DELETE",
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )
