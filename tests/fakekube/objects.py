"""Minimal valid objects (the real client refuses to deserialize objects missing required
fields, e.g. a Pod without containers), to hand to `FakeKube.create`."""

from __future__ import annotations

from typing import Any


def owner(obj: dict[str, Any], *, controller: bool = True) -> dict[str, Any]:
    """An ownerReference to a stored object (as returned by `FakeKube.create`)."""
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def _meta(
    name: str,
    namespace: str,
    labels: dict[str, str] | None,
    owners: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if owners:
        meta["ownerReferences"] = owners
    return meta


def _template(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"labels": dict(labels)},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }


def node(
    name: str, *, labels: dict[str, str] | None = None, provider_id: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"providerID": provider_id} if provider_id else {}
    return {"kind": "Node", "metadata": {"name": name, "labels": dict(labels or {})}, "spec": spec}


def pod(
    name: str,
    *,
    namespace: str = "default",
    node_name: str | None = None,
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
    containers: tuple[str, ...] = ("main",),
    phase: str = "Running",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": c, "image": "busybox"} for c in containers]}
    if node_name:
        spec["nodeName"] = node_name
    return {
        "kind": "Pod",
        "metadata": _meta(name, namespace, labels, owners),
        "spec": spec,
        "status": {"phase": phase},
    }


def _workload(
    kind: str,
    name: str,
    namespace: str,
    labels: dict[str, str] | None,
    owners: list[dict[str, Any]] | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    selector = {"app": name}
    spec: dict[str, Any] = {"selector": {"matchLabels": selector}, "template": _template(selector)}
    spec.update(extra or {})
    return {"kind": kind, "metadata": _meta(name, namespace, labels, owners), "spec": spec}


def deployment(
    name: str, *, namespace: str = "default", labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return _workload("Deployment", name, namespace, labels, None)


def replicaset(
    name: str,
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return _workload("ReplicaSet", name, namespace, labels, owners)


def statefulset(
    name: str, *, namespace: str = "default", labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return _workload("StatefulSet", name, namespace, labels, None, {"serviceName": name})


def daemonset(
    name: str, *, namespace: str = "default", labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return _workload("DaemonSet", name, namespace, labels, None)


def job(
    name: str,
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "kind": "Job",
        "metadata": _meta(name, namespace, labels, owners),
        "spec": {"template": _template({"job-name": name})},
    }


def cronjob(
    name: str, *, namespace: str = "default", labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "kind": "CronJob",
        "metadata": _meta(name, namespace, labels, None),
        "spec": {
            "schedule": "0 * * * *",
            "jobTemplate": {"spec": {"template": _template({"cron": name})}},
        },
    }


def gpu_device(
    name: str, uuid: str, *, parent_uuid: str | None = None, version: str = "v1"
) -> dict[str, Any]:
    """A device of NVIDIA's DRA driver as its ResourceSlices list it: attributes on the device
    in v1/v1beta2, under `basic` in v1beta1."""
    attributes: dict[str, Any] = {
        "type": {"string": "mig" if parent_uuid else "gpu"},
        "uuid": {"string": uuid},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "driverVersion": {"version": "580.65.6"},
    }
    if parent_uuid is not None:
        attributes["parentUUID"] = {"string": parent_uuid}
    body = {"attributes": attributes, "capacity": {"memory": {"value": "80Gi"}}}
    return {"name": name, "basic": body} if version == "v1beta1" else {"name": name, **body}


def resource_slice(
    name: str,
    node_name: str,
    devices: list[dict[str, Any]],
    *,
    version: str = "v1",
    driver: str = "gpu.nvidia.com",
    pool: str | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    """A node-local ResourceSlice of one driver (pool named after the node, as NVIDIA's)."""
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": pool or node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
