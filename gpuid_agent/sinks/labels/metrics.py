"""Label reconciliation metrics, registered in the agent's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class LabelMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.attempts = Counter(
            "gpuid_label_reconcile_attempts_total",
            "Node label reconciliations started (a read of the Node, maybe a patch).",
            registry=r,
        )
        self.patches = Counter(
            "gpuid_label_patches_total",
            "Node label patches by result (applied, dry_run).",
            ["result"],
            registry=r,
        )
        self.errors = Counter(
            "gpuid_label_reconcile_errors_total",
            "Failed Node API calls of the labeller by reason.",
            ["reason"],
            registry=r,
        )
        self.last_success = Gauge(
            "gpuid_label_last_success_timestamp_seconds",
            "Unix time the Node's labels were last confirmed or made correct.",
            registry=r,
        )
        self.in_sync = Gauge(
            "gpuid_labels_in_sync",
            "1 when the Node's labels matched the inventory at the last reconciliation.",
            registry=r,
        )
        self.desired = Gauge(
            "gpuid_labels_desired", "Labels the agent wants on its Node.", registry=r
        )
        self.rewritten = Gauge(
            "gpuid_label_rewritten_serials",
            "Serials that are not valid label values and were rewritten (see the annotation).",
            registry=r,
        )
