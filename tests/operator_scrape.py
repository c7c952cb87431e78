"""The scrape configuration prometheus-operator generates from a ServiceMonitor or PodMonitor.

Without an API server there is no Kubernetes service discovery, so each target is a static
one carrying the `__meta_kubernetes_*` labels discovery would give the agent's pod; the
relabelings are the operator's own (in its order) followed by the monitor's, so the labels
Prometheus stores are the ones a real install stores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_KEYS = {
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "replacement": "replacement",
    "regex": "regex",
    "separator": "separator",
    "modulus": "modulus",
    "action": "action",
}


@dataclass(frozen=True)
class AgentPod:
    """What discovery knows about one agent pod."""

    address: str  # host:port Prometheus reaches it at
    name: str = "gpuid-gpuid-agent-7xk2p"
    namespace: str = "gpu-system"
    node: str = "node-a"
    container: str = "agent"
    port_name: str = "http"
    service: str = "gpuid-gpuid-agent"


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabeling(rule: dict[str, Any]) -> dict[str, Any]:
    """A monitor's relabeling (camelCase) as Prometheus' relabel_config."""
    out = {_KEYS[key]: value for key, value in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def _selector_keep(prefix: str, match_labels: dict[str, str]) -> dict[str, Any]:
    names = sorted(match_labels)
    sources = []
    for name in names:
        sources += [f"{prefix}_label_{_sanitize(name)}", f"{prefix}_labelpresent_{_sanitize(name)}"]
    regex = ";".join(f"({match_labels[name]});true" for name in names)
    return {"action": "keep", "source_labels": sources, "regex": regex}


def _meta(pod: AgentPod, labels: dict[str, str], service: bool) -> dict[str, str]:
    meta = {
        "__meta_kubernetes_namespace": pod.namespace,
        "__meta_kubernetes_pod_name": pod.name,
        "__meta_kubernetes_pod_container_name": pod.container,
        "__meta_kubernetes_pod_node_name": pod.node,
        "__meta_kubernetes_pod_phase": "Running",
    }
    kind = "service" if service else "pod"
    for name, value in labels.items():
        meta[f"__meta_kubernetes_{kind}_label_{_sanitize(name)}"] = value
        meta[f"__meta_kubernetes_{kind}_labelpresent_{_sanitize(name)}"] = "true"
    if service:
        meta |= {
            "__meta_kubernetes_service_name": pod.service,
            "__meta_kubernetes_endpoint_port_name": pod.port_name,
            "__meta_kubernetes_endpoint_address_target_kind": "Pod",
            "__meta_kubernetes_endpoint_address_target_name": pod.name,
        }
    else:
        meta["__meta_kubernetes_pod_container_port_name"] = pod.port_name
    return meta


def _operator_relabelings(monitor: dict[str, Any], port: str) -> list[dict[str, Any]]:
    selector = monitor["spec"]["selector"]["matchLabels"]
    rules: list[dict[str, Any]] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}
    ]
    if monitor["kind"] == "ServiceMonitor":
        rules += [
            _selector_keep("__meta_kubernetes_service", selector),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                "regex": port,
            },
            {
                "source_labels": [
                    "__meta_kubernetes_endpoint_address_target_kind",
                    "__meta_kubernetes_endpoint_address_target_name",
                ],
                "separator": ";",
                "regex": "Node;(.*)",
                "replacement": "${1}",
                "target_label": "node",
            },
            {
                "source_labels": [
                    "__meta_kubernetes_endpoint_address_target_kind",
                    "__meta_kubernetes_endpoint_address_target_name",
                ],
                "separator": ";",
                "regex": "Pod;(.*)",
                "replacement": "${1}",
                "target_label": "pod",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {
                "source_labels": ["__meta_kubernetes_pod_container_name"],
                "target_label": "container",
            },
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            {
                "source_labels": ["__meta_kubernetes_service_name"],
                "target_label": "job",
                "replacement": "${1}",
            },
        ]
    else:
        name = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
        rules += [
            _selector_keep("__meta_kubernetes_pod", selector),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": port,
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {
                "source_labels": ["__meta_kubernetes_pod_container_name"],
                "target_label": "container",
            },
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            {"target_label": "job", "replacement": name},
        ]
    rules.append({"target_label": "endpoint", "replacement": port})
    return rules


def scrape_configs(
    monitor: dict[str, Any],
    pod: AgentPod,
    target_labels: dict[str, str],
    interval: str = "1s",
) -> list[dict[str, Any]]:
    """One scrape job per endpoint, as the operator names and configures them.

    `target_labels` are the labels discovery sees on the Service (ServiceMonitor) or the pod
    (PodMonitor); `interval` replaces the monitor's so a test needs seconds, not minutes.
    """
    kind = monitor["kind"]
    service = kind == "ServiceMonitor"
    endpoints = monitor["spec"]["endpoints" if service else "podMetricsEndpoints"]
    prefix = "serviceMonitor" if service else "podMonitor"
    meta = _meta(pod, target_labels, service)
    jobs = []
    for index, endpoint in enumerate(endpoints):
        name = f"{prefix}/{monitor['metadata']['namespace']}/{monitor['metadata']['name']}/{index}"
        jobs.append(
            {
                "job_name": name,
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "metrics_path": endpoint.get("path", "/metrics"),
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": [{"targets": [pod.address], "labels": meta}],
                "relabel_configs": [
                    *_operator_relabelings(monitor, endpoint["port"]),
                    *(relabeling(r) for r in endpoint.get("relabelings", [])),
                ],
            }
        )
    return jobs
