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
