"""Rendering the Helm chart with the real Helm engine, as a given cluster would see it.

Shared by the chart tests. No cluster and no network: Helm's Capabilities (Kubernetes version
and the API kinds discovery would report) are passed in, as `helm template --kube-version
--api-versions` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpuid-agent"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "gpuid"
NAMESPACE = "gpu-system"

SERVICE_MONITOR = "monitoring.coreos.com/v1/ServiceMonitor"
POD_MONITOR = "monitoring.coreos.com/v1/PodMonitor"
PROMETHEUS_RULE = "monitoring.coreos.com/v1/PrometheusRule"
PROMETHEUS_OPERATOR = (SERVICE_MONITOR, POD_MONITOR, PROMETHEUS_RULE)
ADMISSION_POLICY = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
POLICY_MIN_VERSION = (1, 30)


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = re.findall(r"\d+", version)[:2]
    return int(major), int(minor)


def oldest_supported() -> str:
    """The lower bound of Chart.yaml's kubeVersion (">=1.28.0-0" → "1.28.0")."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*v?(\d+\.\d+\.\d+)(-0)?", constraint.strip())
    assert match, f"kubeVersion {constraint!r} is not a plain lower bound"
    return match.group(1)


def newest_supported() -> str:
    """The newest Kubernetes whose schemas the installed kubernetes-validate ships."""
    return str(kubernetes_validate.utils.latest_version())


def versions() -> list[str]:
    return [oldest_supported(), newest_supported()]


def cluster_apis(version: str) -> list[str]:
    """What discovery reports on a cluster with prometheus-operator installed."""
    apis = list(PROMETHEUS_OPERATOR)
    if _version_tuple(version) >= POLICY_MIN_VERSION:
        apis.append(ADMISSION_POLICY)
    return apis


def load_values(path: Path) -> dict[str, Any]:
    values = yaml.safe_load(path.read_text()) or {}
    assert isinstance(values, dict), f"{path.name} is not a mapping"
    return values


@dataclass(frozen=True)
class Rendered:
    objects: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}


def render(
    values: dict[str, Any] | None = None,
    *,
    kube_version: str | None = None,
    api_versions: Iterable[str] = (),
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    """Render offline. helm-python-sdk 0.2.2's Chart.render does not forward kube_version
    and api_versions, which its native render call accepts; call that directly."""
    opts: dict[str, Any] = {"name": release, "namespace": namespace, "is_install": True}
    if kube_version:
        opts["kube_version"] = f"v{kube_version.removeprefix('v')}"
    if api_versions:
        opts["api_versions"] = list(api_versions)
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        raw = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)
        )
    manifests: dict[str, str] = json.loads(raw)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(objects, notes)


def containers(daemonset: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = daemonset["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def agent_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (agent,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]]
    assert agent["name"] == "agent"
    return agent
