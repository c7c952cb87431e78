"""The agent's own metrics (/metrics), in one registry per agent instance.

A registry per instance (not prometheus_client's global one) lets several agents run in one
process, which the tests and the benchmark rely on.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gpuid_agent import __version__

_EXPORT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RENDER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Every label value the agent can give these counters. Their series exist at 0 from the
# start: `increase()` cannot see the first event of a series that appears with it, so an
# alert on the first dropped record needs the 0 before it.
DROP_REASONS = (
    "intake_full",
    "buffer_full",
    "spool_full",
    "spool_unwritable",
    "store_full",
    "rejected",
    "unreadable",
    "shutdown",
)
COLLECTION_ERROR_REASONS = ("field", "gpu_lost", "init", "read", "stalled", "duplicate_uuid")
# old name → new name; served alongside for one release (docs/metrics.md says so)
DEPRECATED_ALIASES = {"gpuid_gpu_count": "gpuid_gpus"}


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Gauge(
            "gpuid_build_info", "Agent build information.", ["version", "python"], registry=r
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.gpus = Gauge("gpuid_gpus", "GPUs NVML reports on this node.", registry=r)
        # the old name ends in _count, which reads as a histogram's; kept one more release
        self.gpu_count_deprecated = Gauge(
            "gpuid_gpu_count", "Deprecated: use gpuid_gpus (same value).", registry=r
        )
        self.nvml_up = Gauge(
            "gpuid_nvml_up", "1 when NVML is initialised and readable.", registry=r
        )
        self.collection_duration = Histogram(
            "gpuid_collection_duration_seconds", "Duration of one NVML collection.", registry=r
        )
        self.render_duration = Histogram(
            "gpuid_gpu_metrics_render_duration_seconds",
            "Duration of one /gpu/metrics render, by format (text, openmetrics); a snapshot "
            "is rendered when scraped or just before a scrape is due, never otherwise.",
            ["format"],
            buckets=_RENDER_BUCKETS,
            registry=r,
        )
        for fmt in ("text", "openmetrics"):
            self.render_duration.labels(fmt)
        self.collection_errors = Counter(
            "gpuid_collection_errors_total", "Failed NVML reads by reason.", ["reason"], registry=r
        )
        for reason in COLLECTION_ERROR_REASONS:
            self.collection_errors.labels(reason)
        self.records_emitted = Counter(
            "gpuid_records_emitted_total", "Records handed to the exporters.", ["kind"], registry=r
        )
        self.export_success = Counter(
            "gpuid_export_success_total", "Batches delivered.", ["exporter"], registry=r
        )
        self.exported_records = Counter(
            "gpuid_exported_records_total", "Records delivered.", ["exporter"], registry=r
        )
        self.export_failure = Counter(
            "gpuid_export_failure_total",
            "Failed export attempts by error type.",
            ["exporter", "error_type"],
            registry=r,
        )
        self.export_duration = Histogram(
            "gpuid_export_duration_seconds",
            "Duration of one export attempt.",
            ["exporter"],
            buckets=_EXPORT_BUCKETS,
            registry=r,
        )
        self.dropped_records = Counter(
            "gpuid_dropped_records_total",
            "Records given up on, by exporter and reason.",
            ["exporter", "reason"],
            registry=r,
        )
        self.discarded_records = Counter(
            "gpuid_export_discarded_records_total",
            "Records a sink accepted but did not keep, by exporter and reason (`constraint`: "
            "a unique constraint other than the record id's dropped the row).",
            ["exporter", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "gpuid_queue_depth", "Records waiting for an exporter.", ["exporter"], registry=r
        )
        self.last_export_success = Gauge(
            "gpuid_last_export_success_timestamp_seconds",
            "Unix time of the last delivered batch.",
            ["exporter"],
            registry=r,
        )
        self.export_retries = Counter(
            "gpuid_export_retries_total",
            "Export attempts that repeated a failed one.",
            ["exporter"],
            registry=r,
        )
        self.set_aside_batches = Counter(
            "gpuid_export_set_aside_batches_total",
            "Batches a sink rejected (not retried; kept under the spool's rejected/ if any).",
            ["exporter"],
            registry=r,
        )
        self.export_rejected_records = Counter(
            "gpuid_export_rejected_records_total",
            "Records of delivered batches that the sink declined to keep (OTLP partial success).",
            ["exporter"],
            registry=r,
        )
        self.state_files_rejected = Counter(
            "gpuid_state_files_rejected_total",
            "State files under STATE_DIR set aside unread or unused (moved to rejected/), by "
            "file and reason (symlink, not_regular, too_large, unreadable, invalid).",
            ["file", "reason"],
            registry=r,
        )
        self.state_files_newer = Gauge(
            "gpuid_state_files_newer",
            "1 while a state file under STATE_DIR is of a newer format than this version reads: "
            "kept in place for that version, neither read nor written (the agent runs without it).",
            ["file"],
            registry=r,
        )
        self.spool_newer_batches = Gauge(
            "gpuid_spool_newer_batches",
            "Batch files in the spool of a newer format than this version reads, found at start: "
            "kept for that version to send, outside SPOOL_MAX_BYTES.",
            ["exporter"],
            registry=r,
        )
        self.spool_bytes = Gauge(
            "gpuid_spool_bytes",
            "Bytes of batch files in the durable spool.",
            ["exporter"],
            registry=r,
        )
        self.spool_batches = Gauge(
            "gpuid_spool_batches",
            "Undelivered batches in the durable spool.",
            ["exporter"],
            registry=r,
        )
        self.exporter_state = Gauge(
            "gpuid_exporter_state",
            "1 for the exporter's current state (ok, degraded, unavailable).",
            ["exporter", "state"],
            registry=r,
        )
        self.labels = LabelMetrics(r)
        self.attribution = AttributionMetrics(r)
        self.server = ServerMetrics(r)
        self.kube_api_requests = Counter(
            "gpuid_kube_api_requests_total",
            "Kubernetes API requests by verb, resource and HTTP code (timeout/connection/error).",
            ["verb", "resource", "code"],
            registry=r,
        )
        self.health_check_success = Gauge(
            "gpuid_health_check_success", "1 when the agent is ready (/readyz).", registry=r
        )
        self.node_events = NodeEventMetrics(r)

    def set_gpus(self, count: int) -> None:
        self.gpus.set(count)
        self.gpu_count_deprecated.set(count)

    def add_exporter(self, name: str) -> None:
        """Create the exporter's counter series at 0, so alerts see its first event."""
        for counter in (
            self.export_success,
            self.exported_records,
            self.export_retries,
            self.set_aside_batches,
            self.export_rejected_records,
        ):
            counter.labels(name)
        for reason in DROP_REASONS:
            self.dropped_records.labels(name, reason)


class _WithoutCreated(Collector):
    """The registry's families minus the `_created` series of counters and histograms: a
    series per label set that says when the agent started, which nobody queries."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.name != created]
            yield kept


def exposition_registry(registry: CollectorRegistry, created: bool) -> CollectorRegistry:
    """What /metrics serves: the registry itself, or a view without `_created` series."""
    if created:
        return registry
    view = CollectorRegistry(auto_describe=False)
    view.register(_WithoutCreated(registry))
    return view


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


class AttributionMetrics:
    """Pod attribution: the kubelet poller, the API pod cache, unattributed device ids."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.pod_resources_up = Gauge(
            "gpuid_pod_resources_up", "1 when the last kubelet List worked.", registry=r
        )
        self.pod_resources_stale = Gauge(
            "gpuid_pod_resources_stale",
            "1 when the last good kubelet mapping is too old to be served.",
            registry=r,
        )
        self.pod_resources_polls = Counter(
            "gpuid_pod_resources_polls_total",
            "kubelet List calls by outcome (ok, socket_missing, unavailable, …).",
            ["outcome"],
            registry=r,
        )
        self.pod_resources_last_success = Gauge(
            "gpuid_pod_resources_last_success_timestamp_seconds",
            "Unix time of the last good kubelet List.",
            registry=r,
        )
        self.unmapped_now = Gauge(
            "gpuid_attribution_unmapped_devices",
            "kubelet GPU device ids not attributed now, by reason.",
            ["reason"],
            registry=r,
        )
        self.unmapped_total = Counter(
            "gpuid_attribution_unmapped_total",
            "kubelet GPU device ids found unattributable (each counted once when it appears).",
            ["reason"],
            registry=r,
        )
        self.holders = Gauge(
            "gpuid_attribution_holders",
            "Containers holding a GPU or MIG device of this node.",
            registry=r,
        )
        self.pod_cache_pods = Gauge(
            "gpuid_pod_cache_pods", "Pods of this node in the API pod cache.", registry=r
        )
        self.pod_cache_relists = Counter(
            "gpuid_pod_cache_relists_total", "Full LISTs of this node's pods.", registry=r
        )
        self.pod_cache_malformed = Counter(
            "gpuid_pod_cache_malformed_total",
            "Pod list items, watch lines and watch events skipped as malformed.",
            registry=r,
        )
        self.resource_slices_malformed = Counter(
            "gpuid_resource_slices_malformed_total",
            "ResourceSlice list items, watch lines and watch events skipped as malformed.",
            registry=r,
        )
        self.owner_lookups = Counter(
            "gpuid_owner_lookups_total",
            "Workload owner lookups by outcome (cached, api, forbidden, not_found, error).",
            ["outcome"],
            registry=r,
        )


class NodeEventMetrics:
    """Kubernetes Events on the agent's Node (docs/health.md): created, merged, held back."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.created = Counter(
            "gpuid_node_events",
            "Kubernetes Events created on the agent's Node, by reason (a repeat joins the "
            "Event's series instead: gpuid_node_event_repeats_total).",
            ["reason"],
            registry=r,
        )
        self.repeats = Counter(
            "gpuid_node_event_repeats",
            "Repeats of a Node Event merged into its series (count and last time, patched at "
            "most every 10 s), by reason.",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "gpuid_node_events_dropped",
            "Node Events not written, by reason and cause (budget: over the write budget; "
            "queue_full: the API unreachable too long; refused: the API server said no).",
            ["reason", "cause"],
            registry=r,
        )


class ServerMetrics:
    """The HTTP server's connections (idle ones closed by the keep-alive timer are not counted)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.connections = Gauge(
            "gpuid_http_connections", "Open connections to the HTTP server.", registry=registry
        )
        self.closed = Counter(
            "gpuid_http_connections_closed_total",
            "Connections the HTTP server closed to make room (limit: SERVER_MAX_CONNECTIONS "
            "reached; out_of_fds: no file descriptor left) or refused at once (refused).",
            ["reason"],
            registry=registry,
        )
        for reason in ("limit", "out_of_fds", "refused"):
            self.closed.labels(reason)
