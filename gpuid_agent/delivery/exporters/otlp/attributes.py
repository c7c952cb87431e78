"""Which record field becomes which OpenTelemetry attribute (docs/exporters/otlp.md lists them).

Names follow OpenTelemetry's semantic conventions where one exists (`k8s.*`, `host.id`,
`service.*`); GPU facts use a `gpu.*` namespace and the agent's own facts `gpuid.*`. A field
not listed here still reaches the backend: the log body is the whole record as JSON.
"""

from __future__ import annotations

from typing import Final

SERVICE_NAME: Final = "gpuid-agent"
SCOPE_NAME: Final = "gpuid_agent"

# Record field -> resource attribute; records are grouped into one ResourceLogs per value set.
RESOURCE: Final = {
    "cluster": "k8s.cluster.name",
    "node": "k8s.node.name",
    "machine": "host.id",
}

COMMON: Final = {
    "record_id": "gpuid.record.id",
    "kind": "gpuid.record.kind",
    "schema_version": "gpuid.schema.version",
    "source": "gpuid.source",
    "machine_source": "gpuid.machine.source",
    "gpu": "gpu.serial",
    "chassis": "gpu.chassis.serial",
    "uuid": "gpu.uuid",
}

BY_KIND: Final[dict[str, dict[str, str]]] = {
    "reading": {
        "index": "gpu.index",
        "model": "gpu.model",
        "pci_bus_id": "gpu.pci.bus_id",
        "module_id": "gpu.module.id",
        "board_part_number": "gpu.board.part_number",
        "driver_version": "gpu.driver.version",
        "mig_devices": "gpu.mig.uuids",
        "reason": "gpuid.reading.reason",
        "change": "gpuid.reading.change",
    },
    "allocation": {
        "event": "gpuid.allocation.event",
        "allocation_id": "gpuid.allocation.id",
        "serial": "gpu.serial",
        "namespace": "k8s.namespace.name",
        "pod": "k8s.pod.name",
        "pod_uid": "k8s.pod.uid",
        "container": "k8s.container.name",
        "gpu_index": "gpu.index",
        "mig_uuid": "gpu.mig.uuid",
        "mig_gpu_instance_id": "gpu.mig.gpu_instance_id",
        "mig_profile": "gpu.mig.profile",
        "resource_name": "gpuid.resource.name",
        "device_id": "gpuid.device.id",
        "replica": "gpuid.device.replica",
        "workload_kind": "gpuid.workload.kind",
        "workload_name": "gpuid.workload.name",
        "started_at": "gpuid.allocation.started_at",
        "ended_at": "gpuid.allocation.ended_at",
        "start_observed": "gpuid.allocation.start_observed",
        "end_observed": "gpuid.allocation.end_observed",
        "last_seen_at": "gpuid.allocation.last_seen_at",
        "gpu_seconds": "gpuid.allocation.gpu_seconds",
        "energy_joules": "gpuid.allocation.energy_joules",
        "usage_start": "gpuid.allocation.usage_start",
    },
    "health": {
        "index": "gpu.index",
        "check": "gpuid.health.check",
        "state": "gpuid.health.state",
        "previous_state": "gpuid.health.previous_state",
        "action": "gpuid.health.action",
        "reason": "gpuid.health.reason",
        "gpu_state": "gpuid.health.gpu_state",
    },
}

# An allocation's owning workload also under the semantic-convention name of its kind.
WORKLOAD_KINDS: Final = {
    "Deployment": "k8s.deployment.name",
    "StatefulSet": "k8s.statefulset.name",
    "DaemonSet": "k8s.daemonset.name",
    "ReplicaSet": "k8s.replicaset.name",
    "Job": "k8s.job.name",
    "CronJob": "k8s.cronjob.name",
}

# Health states to OpenTelemetry severities (number, text); other kinds are INFO.
SEVERITY: Final = {
    "healthy": (9, "INFO"),
    "not_supported": (9, "INFO"),
    "degraded": (13, "WARN"),
    "unknown": (13, "WARN"),
    "unhealthy": (17, "ERROR"),
}
INFO: Final = (9, "INFO")
