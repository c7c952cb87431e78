"""A pod template turned into `podman run` arguments, as the kubelet would run it.

What the kubelet (with a CRI runtime) does with each field the chart renders: the pod's and the
container's securityContext merged (container wins), runAsNonRoot verified, volumes made on the
node (hostPath checked or created by its type, emptyDir as a fresh directory, the projected
service-account token with the API server's CA and the namespace), env with fieldRef values
and $(VAR) references filled in, the KUBERNETES_SERVICE_* variables every pod gets, resource
limits, and probes resolved against the container's named ports. A field it does not know is
an error, so a chart change cannot be silently left out of the run.

The node is a directory: hostPath `/x` is `<node.root>/x`. The pod has its own network
namespace (slirp4netns); its ports are published on 127.0.0.1 only and the API server on the
host's loopback is reached at slirp4netns's host address.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# slirp4netns's address for the host's loopback, as seen from inside the pod.
HOST_FROM_POD = "10.0.2.2"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Fields of the pod spec that only the scheduler, the controllers or the API server act on.
SCHEDULING = {
    "affinity",
    "nodeSelector",
    "tolerations",
    "priorityClassName",
    "imagePullSecrets",
    "serviceAccountName",
}
POD_FIELDS = SCHEDULING | {
    "automountServiceAccountToken",
    "terminationGracePeriodSeconds",
    "enableServiceLinks",
    "securityContext",
    "initContainers",
    "containers",
    "volumes",
    "runtimeClassName",
}
CONTAINER_FIELDS = {
    "name",
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "ports",
    "env",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "resources",
    "securityContext",
    "volumeMounts",
}
SECURITY_FIELDS = {
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "allowPrivilegeEscalation",
    "privileged",
    "readOnlyRootFilesystem",
    "capabilities",
    "seccompProfile",
}
POD_SECURITY_FIELDS = {
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "fsGroup",
    "supplementalGroups",
    "seccompProfile",
}
PULL = {"IfNotPresent": "missing", "Always": "always", "Never": "never"}


class Unsupported(ValueError):
    """A field this translation does not carry out."""


class Refused(RuntimeError):
    """What the kubelet refuses to start (CreateContainerConfigError and the like)."""


@dataclass(frozen=True)
class Node:
    """The node the pod lands on: its name, its filesystem, the API server pods are told
    about, and what the device runtime injects into every container (bind mounts, env)."""

    name: str
    root: Path
    api_port: int
    api_ca: bytes
    token: str
    injected: tuple[str, ...] = ()

    def host_path(self, path: str) -> Path:
        return self.root / path.lstrip("/")


@dataclass(frozen=True)
class Probe:
    kind: str
    path: str
    port: int  # the container port
    initial_delay: float
    period: float
    timeout: float
    failure_threshold: int
    success_threshold: int


@dataclass
class ContainerRun:
    name: str
    args: list[str]  # after `podman run`
    ports: dict[str, int] = field(default_factory=dict)
    probes: dict[str, Probe] = field(default_factory=dict)


@dataclass
class PodRun:
    name: str
    namespace: str
    init: list[ContainerRun]
    containers: list[ContainerRun]
    grace_seconds: int


def _check_fields(kind: str, obj: dict[str, Any], known: set[str]) -> None:
    unknown = set(obj) - known
    if unknown:
        raise Unsupported(f"{kind}: {', '.join(sorted(unknown))} not translated")


def _field_ref(path: str, pod: dict[str, str]) -> str:
    values = {
        "metadata.name": pod["name"],
        "metadata.namespace": pod["namespace"],
        "metadata.uid": pod["uid"],
        "spec.nodeName": pod["node"],
        "spec.serviceAccountName": pod["serviceAccountName"],
        "status.hostIP": HOST_FROM_POD,
    }
    if path not in values:
        raise Unsupported(f"fieldRef {path}")
    return values[path]


_REF = re.compile(r"\$\((\w+)\)|\$\$")


def _expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) of an earlier variable is replaced, $$ is a literal $, anything else stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, value)


def container_env(
    container: dict[str, Any], pod: dict[str, str], api_port: int, secrets: dict[str, str]
) -> dict[str, str]:
    """The kubelet's order: the API server's variables first, then the container's own."""
    env = {
        "KUBERNETES_SERVICE_HOST": HOST_FROM_POD,
        "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
    }
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            env[name] = _expand(str(var["value"]), env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[name] = _field_ref(var["valueFrom"]["fieldRef"]["fieldPath"], pod)
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            key = f"{ref['name']}/{ref['key']}"
            if key not in secrets:
                raise Refused(f"secret {key} not found (CreateContainerConfigError)")
            env[name] = secrets[key]
        else:
            raise Unsupported(f"env {name}: {var}")
    return env


def effective_security(pod_sc: dict[str, Any], sc: dict[str, Any]) -> dict[str, Any]:
    _check_fields("pod securityContext", pod_sc, POD_SECURITY_FIELDS)
    _check_fields("container securityContext", sc, SECURITY_FIELDS)
    merged = {k: v for k, v in pod_sc.items() if k in SECURITY_FIELDS}
    merged.update(sc)
    return merged


def security_args(
    merged: dict[str, Any], pod_sc: dict[str, Any], image_user: str, name: str
) -> list[str]:
    user = merged.get("runAsUser")
    if user is None:
        user = image_user.split(":", maxsplit=1)[0] or "0"
    if merged.get("runAsNonRoot"):
        if not str(user).isdigit():
            raise Refused(f"{name}: image has non-numeric user {user!r}, runAsNonRoot")
        if int(user) == 0:
            raise Refused(f"{name}: container has runAsNonRoot and image will run as root")
    group = merged.get("runAsGroup")
    args = ["--user", f"{user}:{group}" if group is not None else str(user)]
    groups = list(pod_sc.get("supplementalGroups", []))
    if "fsGroup" in pod_sc:
        groups.append(pod_sc["fsGroup"])
    for gid in groups:
        args += ["--group-add", str(gid)]
    if merged.get("privileged"):
        args.append("--privileged")
    if merged.get("readOnlyRootFilesystem"):
        # As a CRI runtime does: no tmpfs of podman's own on /tmp, /var/tmp, /run.
        args += ["--read-only", "--read-only-tmpfs=false"]
    caps = merged.get("capabilities", {})
    _check_fields("capabilities", caps, {"drop", "add"})
    args += [f"--cap-drop={c.lower()}" for c in caps.get("drop", [])]
    args += [f"--cap-add={c.lower()}" for c in caps.get("add", [])]
    if merged.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    seccomp = merged.get("seccompProfile", {}).get("type", "Unconfined")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":  # RuntimeDefault: podman's default profile
        raise Unsupported(f"seccompProfile {seccomp}")
    return args


def _host_path_volume(volume: dict[str, Any], node: Node) -> Path:
    spec = volume["hostPath"]
    path = node.host_path(spec["path"])
    kind = spec.get("type", "")
    if kind == "DirectoryOrCreate":
        if not path.exists():
            path.mkdir(mode=0o755, parents=True)
        kind = "Directory"
    if kind == "Directory" and not path.is_dir():
        raise Refused(f"hostPath {spec['path']} is not a directory (volume {volume['name']})")
    if kind == "File" and not path.is_file():
        raise Refused(f"hostPath {spec['path']} is not a file (volume {volume['name']})")
    if kind not in ("", "Directory", "File"):
        raise Unsupported(f"hostPath type {kind}")
    return path


def _chgrp(path: Path, gid: int | None) -> None:
    """fsGroup: the kubelet hands volumes it makes to the pod's group."""
    if gid is not None:
        os.chown(path, 0, gid)
        for child in path.iterdir():
            os.chown(child, 0, gid)


def make_volumes(
    spec: dict[str, Any], pod_dir: Path, node: Node, namespace: str
) -> dict[str, Path]:
    """Each volume's directory or file on the node; the service-account one added."""
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    made: dict[str, Path] = {}
    for volume in spec.get("volumes", []):
        name = volume["name"]
        kinds = set(volume) - {"name"}
        if kinds == {"hostPath"}:
            made[name] = _host_path_volume(volume, node)
        elif kinds == {"emptyDir"}:
            _check_fields("emptyDir", volume["emptyDir"], {"sizeLimit"})
            path = pod_dir / "empty-dir" / name
            path.mkdir(parents=True)
            path.chmod(0o777)
            _chgrp(path, fs_group)
            made[name] = path
        else:
            raise Unsupported(f"volume {name}: {sorted(kinds)}")
    if spec.get("automountServiceAccountToken", True):
        path = pod_dir / "kube-api-access"
        path.mkdir(parents=True)
        for file, content in (
            ("token", node.token.encode()),
            ("ca.crt", node.api_ca),
            ("namespace", namespace.encode()),
        ):
            (path / file).write_bytes(content)
            (path / file).chmod(0o644)
        _chgrp(path, fs_group)
        made["kube-api-access"] = path
    return made


def mount_args(container: dict[str, Any], volumes: dict[str, Path], automount: bool) -> list[str]:
    args = []
    mounts = list(container.get("volumeMounts", []))
    if automount:
        mounts.append({"name": "kube-api-access", "mountPath": SA_DIR, "readOnly": True})
    for mount in mounts:
        _check_fields("volumeMount", mount, {"name", "mountPath", "readOnly"})
        source = volumes.get(mount["name"])
        if source is None:
            raise Refused(f"volumeMount {mount['name']}: no such volume")
        mode = "ro" if mount.get("readOnly") else "rw"
        args += ["--volume", f"{source}:{mount['mountPath']}:{mode}"]
    return args


def probe(kind: str, spec: dict[str, Any], ports: dict[str, int]) -> Probe:
    get = spec.get("httpGet")
    if get is None or get.get("scheme", "HTTP") != "HTTP" or "host" in get:
        raise Unsupported(f"{kind}: only httpGet to the pod over HTTP")
    port = get["port"]
    if isinstance(port, str):
        if port not in ports:
            raise Refused(f"{kind}: no container port named {port!r}")
        port = ports[port]
    return Probe(
        kind,
        get["path"],
        int(port),
        initial_delay=spec.get("initialDelaySeconds", 0),
        period=spec.get("periodSeconds", 10),
        timeout=spec.get("timeoutSeconds", 1),
        failure_threshold=spec.get("failureThreshold", 3),
        success_threshold=spec.get("successThreshold", 1),
    )


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi)?$")


def resource_args(resources: dict[str, Any]) -> list[str]:
    args = []
    limits = resources.get("limits", {})
    if "memory" in limits:
        number, unit = _QUANTITY.fullmatch(str(limits["memory"])).groups()  # type: ignore[union-attr]
        scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[unit]
        args += ["--memory", str(int(float(number) * scale))]
    if "cpu" in limits:
        number, unit = _QUANTITY.fullmatch(str(limits["cpu"])).groups()  # type: ignore[union-attr]
        cpus = float(number) / (1000 if unit == "m" else 1)
        args += ["--cpus", f"{cpus:g}"]
    return args


def translate(
    template: dict[str, Any],
    node: Node,
    pod_dir: Path,
    *,
    name: str,
    namespace: str,
    image_user: str,
    published: dict[int, int] | None = None,
    secrets: dict[str, str] | None = None,
) -> PodRun:
    """The podman runs of a pod template on `node`; `published` maps a container port to
    the 127.0.0.1 port it is published on."""
    spec = template["spec"]
    _check_fields("pod spec", spec, POD_FIELDS)
    pod_sc = spec.get("securityContext", {})
    pod = {
        "name": name,
        "namespace": namespace,
        "uid": "0d9f3a52-5b3e-4c1e-9a57-3d2f2f7f0c11",
        "node": node.name,
        "serviceAccountName": spec.get("serviceAccountName", "default"),
    }
    automount = spec.get("automountServiceAccountToken", True)
    volumes = make_volumes(spec, pod_dir, node, namespace)

    def one(container: dict[str, Any], is_init: bool) -> ContainerRun:
        _check_fields(f"container {container['name']}", container, CONTAINER_FIELDS)
        merged = effective_security(pod_sc, container.get("securityContext", {}))
        run = ContainerRun(container["name"], [f"--name={name}-{container['name']}"])
        run.args += ["--hostname", name, "--pull", PULL[container.get("imagePullPolicy", "Always")]]
        run.args += security_args(merged, pod_sc, image_user, container["name"])
        run.args += mount_args(container, volumes, automount)
        env = container_env(container, pod, node.api_port, secrets or {})
        for key, value in env.items():
            run.args += ["--env", f"{key}={value}"]
        run.args += resource_args(container.get("resources", {}))
        run.args += ["--network", "slirp4netns:allow_host_loopback=true"]
        for port in container.get("ports", []):
            if port.get("protocol", "TCP") != "TCP":
                raise Unsupported(f"port {port}")
            run.ports[port.get("name", str(port["containerPort"]))] = port["containerPort"]
            host_port = (published or {}).get(port["containerPort"])
            if host_port is not None:
                run.args += ["--publish", f"127.0.0.1:{host_port}:{port['containerPort']}"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in container:
                if is_init:
                    raise Refused(f"{container['name']}: an init container takes no {kind}")
                run.probes[kind] = probe(kind, container[kind], run.ports)
        run.args += list(node.injected)
        command = container.get("command")
        if command:
            run.args += ["--entrypoint", command[0]]
        run.args.append(container["image"])
        run.args += [_expand(a, env) for a in (command or [])[1:] + container.get("args", [])]
        return run

    return PodRun(
        name,
        namespace,
        [one(c, True) for c in spec.get("initContainers", [])],
        [one(c, False) for c in spec["containers"]],
        int(spec.get("terminationGracePeriodSeconds", 30)),
    )
