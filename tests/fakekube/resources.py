"""Which resources the fake API serves, and the validation the API server applies to metadata."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    has_status: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "nodes", "Node", namespaced=False),
    Resource("", "v1", "namespaces", "Namespace", namespaced=False),
    Resource("", "v1", "pods", "Pod", namespaced=True),
    Resource("", "v1", "configmaps", "ConfigMap", namespaced=True, has_status=False),
    Resource("", "v1", "events", "Event", namespaced=True, has_status=False),
    Resource("apps", "v1", "replicasets", "ReplicaSet", namespaced=True),
    Resource("apps", "v1", "deployments", "Deployment", namespaced=True),
    Resource("apps", "v1", "statefulsets", "StatefulSet", namespaced=True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", namespaced=True),
    Resource("batch", "v1", "jobs", "Job", namespaced=True),
    Resource("batch", "v1", "cronjobs", "CronJob", namespaced=True),
    # DRA: served in the versions a FakeKube is told to serve (all by default)
    Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False, False),
    Resource("resource.k8s.io", "v1beta2", "resourceslices", "ResourceSlice", False, False),
    Resource("resource.k8s.io", "v1beta1", "resourceslices", "ResourceSlice", False, False),
)
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
BY_KIND = {r.kind: r for r in reversed(RESOURCES)}  # a kind's first (newest) version
BY_API_VERSION = {(r.api_version, r.kind): r for r in RESOURCES}
RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1")

_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = re.compile(rf"^({_NAME})?$")
_QUALIFIED_NAME = re.compile(rf"^{_NAME}$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ANNOTATIONS_MAX_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Cause:
    field: str
    message: str
    reason: str = "FieldValueInvalid"


def _key_problems(key: str) -> list[str]:
    problems: list[str] = []
    prefix, _, name = key.rpartition("/")
    if "/" in prefix:
        return ["a qualified name must consist of a name and an optional prefix separated by '/'"]
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        problems.append("prefix part must be a lowercase RFC 1123 subdomain")
    if not name:
        problems.append("name part must be non-empty")
    elif len(name) > 63:
        problems.append("name part must be no more than 63 characters")
    elif not _QUALIFIED_NAME.match(name):
        problems.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character"
        )
    return problems


def validate_metadata(obj: dict[str, Any]) -> list[Cause]:
    """What the API server would reject in labels and annotations (HTTP 422)."""
    causes: list[Cause] = []
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        return [Cause("metadata.labels", "must be a map of strings")]
    for key, value in labels.items():
        for problem in _key_problems(key):
            causes.append(Cause("metadata.labels", f'Invalid value: "{key}": {problem}'))
        if not isinstance(value, str):
            causes.append(Cause(f"metadata.labels.{key}", "must be a string"))
        elif len(value) > 63:
            causes.append(
                Cause(
                    "metadata.labels",
                    f'Invalid value: "{value}": must be no more than 63 characters',
                )
            )
        elif not _LABEL_VALUE.match(value):
            causes.append(
                Cause(
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid label must be an empty string or consist '
                    "of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character",
                )
            )
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        return [*causes, Cause("metadata.annotations", "must be a map of strings")]
    size = 0
    for key, value in annotations.items():
        for problem in _key_problems(key):
            causes.append(Cause("metadata.annotations", f'Invalid value: "{key}": {problem}'))
        if not isinstance(value, str):
            causes.append(Cause(f"metadata.annotations.{key}", "must be a string"))
        else:
            size += len(key) + len(value.encode())
    if size > ANNOTATIONS_MAX_BYTES:
        causes.append(
            Cause(
                "metadata.annotations",
                f"Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes",
                reason="FieldValueTooLong",
            )
        )
    return causes


# apimachinery's IsDNS1123Label, worded as the API server words it
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)


def dns_label_problems(value: str) -> list[str]:
    problems: list[str] = []
    if len(value) > 63:
        problems.append("must be no more than 63 characters")
    if not _DNS_LABEL.fullmatch(value):
        # a valid subdomain that is no label can only have dots in it
        dotted = _DNS_SUBDOMAIN.fullmatch(value) is not None
        problems.append("must not contain dots" if dotted else DNS_LABEL_MESSAGE)
    return problems


def validate_resource_slice(obj: dict[str, Any]) -> list[Cause]:
    """What the API server refuses in a ResourceSlice's devices (HTTP 422): a name that is no
    DNS label, a name listed twice. Other spec fields are not checked."""
    spec = obj.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    if not isinstance(devices, list):
        return []
    causes: list[Cause] = []
    duplicates: list[Cause] = []  # after every name's own causes, as the API server lists them
    seen: set[str] = set()
    for i, device in enumerate(devices):
        name = device.get("name", "") if isinstance(device, dict) else ""
        if not isinstance(name, str):
            continue  # the API server refuses that while decoding, before validation
        causes += [
            Cause(f"spec.devices[{i}].name", f'Invalid value: "{name}": {problem}')
            for problem in dns_label_problems(name)
        ]
        if name in seen:
            duplicates.append(
                Cause(f"spec.devices[{i}]", f'Duplicate value: "{name}"', "FieldValueDuplicate")
            )
        seen.add(name)
    return causes + duplicates


def validate_spec(resource: Resource, obj: dict[str, Any]) -> list[Cause]:
    """What the API server refuses in an object beyond its metadata, as far as the stand-in
    checks it: a ResourceSlice's device names."""
    return validate_resource_slice(obj) if resource.kind == "ResourceSlice" else []


def invalid(resource: Resource, name: str, causes: list[Cause]) -> tuple[str, dict[str, Any]]:
    """The message and details of the API server's 422 Invalid for `causes`: several causes
    are bracketed in the message, one is not."""
    errors = [f"{c.field}: {c.message}" for c in causes]
    listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    qualified = f"{resource.kind}.{resource.group}" if resource.group else resource.kind
    details: dict[str, Any] = {"name": name}
    if resource.group:
        details["group"] = resource.group
    details["kind"] = resource.kind
    details["causes"] = [
        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
    ]
    return f'{qualified} "{name}" is invalid: {listed}', details
