"""Settings from the environment (gpuid-compatible names plus ours) and CLI overrides.

Every invalid value is collected and reported at once, naming the variable, so an operator
fixes a bad DaemonSet spec in one round instead of one variable per crash loop.
"""

from __future__ import annotations

import math
import re
import socket
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
)
from pydantic_settings import NoDecode, SettingsConfigDict

from gpuid_agent.runtime.fault_spec import parse_faults
from gpuid_agent.runtime.otel_settings import OtelSettings
from gpuid_agent.runtime.redact import REDACTED, redact_url

# GPUs of each simulated profile, kept in step with gpuid_agent.simulate.profiles (a test
# checks), so a FAULT naming a GPU the profile lacks is a configuration error.
SIMULATION_GPUS = {"h100x8": 8, "gb200x4": 4, "mig": 2, "timesliced": 8, "dra": 4}
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

# URLs that may carry credentials in their userinfo or query: shown redacted.
_URL_FIELDS = frozenset({"http_endpoint", "s3_endpoint_url"})
EXPORTER_NAMES = ("stdout", "http", "postgres", "s3", "otlp")
# A typo in SIMULATE fails at start with the other configuration errors.
SIMULATION_PROFILES = tuple(SIMULATION_GPUS)


def parse_duration(value: object) -> float:
    """Seconds from `30`, `2.5`, `30s`, `5m`, `1h`, `1h30m`, `250ms`; never negative."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 5m, 1h or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for match in _DURATION_PART.finditer(text):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if pos != len(text) or not text:
                raise ValueError(
                    "expected a duration such as 30s, 5m, 1h or a number of seconds"
                ) from None
    else:
        raise ValueError("expected a duration such as 30s, 5m, 1h or a number of seconds")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("duration must be a finite number of seconds ≥ 0")
    return seconds


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("duration must be greater than 0")
    return value


def _split_list(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _exporters(value: list[str]) -> list[str]:
    names = [v.lower() for v in value]
    unknown = [str(i) for i, n in enumerate(names, 1) if n not in EXPORTER_NAMES]
    if unknown:  # named by position: a value in the wrong variable may be a secret
        raise ValueError(
            f"entry {', '.join(unknown)} is no exporter; choose from {', '.join(EXPORTER_NAMES)}"
        )
    if not names:
        raise ValueError("at least one exporter is required")
    return list(dict.fromkeys(names))


def _faults(value: list[str]) -> list[str]:
    return [str(f) for f in parse_faults(value)]


Duration = Annotated[float, BeforeValidator(parse_duration)]
PositiveDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_positive)]
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_list)]
_LABEL_PREFIX = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


def _label_prefix(value: str) -> str:
    value = value.strip().rstrip("/")
    if not _LABEL_PREFIX.match(value):
        raise ValueError("must be a DNS subdomain such as gpuid.github.com")
    return value


class Settings(OtelSettings):
    """Effective configuration. Field `foo_bar` is read from env `FOO_BAR` and `--foo-bar`;
    the OpenTelemetry exporter variables come from `OtelSettings`."""

    model_config = SettingsConfigDict(
        case_sensitive=False, extra="ignore", validate_default=True, frozen=True
    )

    # identity of this node and pod (downward API)
    cluster_name: str = Field("default", description="Cluster name written into every record.")
    node_name: str = Field("", description="Node name (downward API); defaults to the hostname.")
    pod_name: str = Field("", description="This pod's name (downward API).")
    pod_namespace: str = Field("", description="This pod's namespace (downward API).")
    namespace: str = Field(
        "", description="Accepted for gpuid compatibility; not used (a warning at start if set)."
    )
    label_selector: str = Field(
        "", description="Accepted for gpuid compatibility; not used (a warning at start if set)."
    )

    # collection
    nvml_library_path: str = Field(
        "", description="Path of libnvidia-ml.so.1 (e.g. under a GPU-operator driver root)."
    )
    collect_interval: PositiveDuration = Field(10.0, description="NVML collection period.")
    stall_timeout: Duration = Field(
        0.0,
        description="A collection or NVML call running longer than this marks the collector "
        "stalled and fails /healthz; 0: three COLLECT_INTERVALs, at least 30s.",
    )
    heartbeat_interval: PositiveDuration = Field(
        3600.0, description="Re-emit reading records this often even without change."
    )
    simulate: Literal["", *SIMULATION_PROFILES] = Field(  # type: ignore[valid-type]
        "", description="Run on a simulated node profile: " + ", ".join(SIMULATION_PROFILES) + "."
    )

    # pipeline
    exporter_type: Annotated[CommaList, AfterValidator(_exporters)] = Field(
        default_factory=lambda: ["stdout"],
        description="Exporters, one name or a comma list: stdout, http, postgres, s3, otlp.",
    )
    batch_size: int = Field(10, ge=1, le=100_000, description="Records per batch.")
    flush_interval: PositiveDuration = Field(
        2.0, description="Send a partial batch after this long."
    )
    queue_size: int = Field(10_000, ge=1, description="Records buffered per exporter in memory.")
    retry_count: int = Field(2, ge=0, le=100, description="Retries per batch attempt cycle.")
    timeout: PositiveDuration = Field(30.0, description="Timeout of one export attempt.")
    retry_backoff: PositiveDuration = Field(
        0.5, description="First retry pause of an export (doubles, with jitter)."
    )
    retry_backoff_max: PositiveDuration = Field(30.0, description="Longest retry pause.")
    health_probe_interval: PositiveDuration = Field(
        30.0,
        description="How often an idle exporter's sink is probed (a delivery counts as a "
        "probe); HTTP handlers never probe.",
    )
    shutdown_grace: Duration = Field(
        20.0, description="Time allowed to flush pending batches on SIGTERM."
    )

    # http exporter
    http_endpoint: str = Field("", description="URL that receives POSTed record batches.")
    http_timeout: PositiveDuration = Field(30.0, description="HTTP request timeout.")
    http_auth_token: SecretStr = Field(SecretStr(""), description="Bearer token (secret).")
    http_auth_token_file: str = Field("", description="File holding the bearer token.")
    http_gzip: bool = Field(False, description="Gzip request bodies.")
    http_ca_bundle: str = Field("", description="CA bundle file for TLS verification.")

    # postgres exporter
    postgres_host: str = Field("", description="PostgreSQL host.")
    postgres_port: int = Field(5432, ge=1, le=65535, description="PostgreSQL port.")
    postgres_db: str = Field("gpuid", description="PostgreSQL database.")
    postgres_user: str = Field("gpuid", description="PostgreSQL user.")
    postgres_password: SecretStr = Field(SecretStr(""), description="PostgreSQL password (secret).")
    postgres_sslmode: Literal[
        "disable", "allow", "prefer", "require", "verify-ca", "verify-full"
    ] = Field("require", description="PostgreSQL SSL mode.")
    postgres_idle_timeout: PositiveDuration = Field(
        30.0,
        description="Close the PostgreSQL connection after this long without a delivery "
        "(an idle node holds none).",
    )
    postgres_table: str = Field("gpu_readings", description="Readings table name.")
    postgres_auto_migrate: bool = Field(True, description="Create tables at start.")
    postgres_allocations_table: str = Field(
        "gpu_allocations", description="Allocations table (in POSTGRES_TABLE's schema if bare)."
    )
    postgres_events_table: str = Field(
        "gpu_events",
        description="Table of other record kinds (in POSTGRES_TABLE's schema if bare).",
    )

    # s3 exporter
    s3_bucket: str = Field("", description="S3 bucket.")
    s3_prefix: str = Field("gpuid", description="Key prefix.")
    s3_region: str = Field("", description="S3 region.")
    s3_partition_pattern: str = Field(
        "year=%Y/month=%m/day=%d/hour=%H", description="strftime pattern of the partition."
    )
    s3_endpoint_url: str = Field("", description="Endpoint of an S3-compatible store.")
    s3_path_style: bool = Field(False, description="Path-style addressing.")
    s3_format: Literal["csv", "ndjson"] = Field(
        "csv", description="Format of reading objects; other kinds are always NDJSON."
    )
    s3_csv_header: bool = Field(
        False, description="Write a header line in reading CSV objects (gpuid writes none)."
    )
    s3_gzip: bool = Field(False, description="Gzip objects.")

    # durable spool
    spool_dir: str = Field("", description="Directory of the on-disk batch spool.")
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="Spool size bound.")

    # kubelet pod-resources and kube API
    pod_resources_socket: str = Field(
        "/var/lib/kubelet/pod-resources/kubelet.sock", description="kubelet pod-resources socket."
    )
    pod_resources_interval: PositiveDuration = Field(5.0, description="pod-resources poll period.")
    pod_resources_timeout: PositiveDuration = Field(
        5.0, description="Deadline of one kubelet pod-resources call."
    )
    pod_resources_stale_after: PositiveDuration = Field(
        60.0, description="Serve the last good pod mapping this long while the kubelet is down."
    )
    state_dir: str = Field(
        "",
        description="Directory for small state kept across restarts (open allocations, "
        "latched GPU health) and operators' `health clear` requests.",
    )
    accounting_interval: PositiveDuration = Field(
        3600.0,
        description="Period of the usage records of long allocations (GPU-seconds, energy), "
        "aligned to multiples of it since the epoch (UTC).",
    )
    accounting_per_pod: bool = Field(
        False, description="Also expose workload GPU-seconds and energy per pod on /gpu/metrics."
    )
    accounting_retention: PositiveDuration = Field(
        3600.0,
        description="How long a workload's (and a pod's) accounting series stay once it holds "
        "no GPU; its end and usage records already carry its final counts.",
    )
    gpu_resource_names: CommaList = Field(
        default_factory=list, description="Extra resource names that carry GPUs."
    )
    pod_label_allowlist: CommaList = Field(
        default_factory=list, description="Pod labels copied onto /gpu/metrics series."
    )
    kube_api: Literal["auto", "off"] = Field(
        "auto", description="Use the Kubernetes API (auto: when config is found)."
    )
    process_attribution: bool = Field(
        False,
        description="Per-process GPU shares mapped to pods (reads NVML's process lists and "
        "HOST_PROC); off: neither is touched.",
    )
    host_proc: str = Field(
        "/proc",
        description="The host's /proc (mounted read-only) for PROCESS_ATTRIBUTION; the boot "
        "id under it tells health state (STATE_DIR) a reboot.",
    )
    dra_resource_slices: bool = Field(
        True,
        description="Join DRA claim devices to GPUs through the node's ResourceSlices "
        "(list/watch resource.k8s.io); off: node-local fallback, full GPUs only.",
    )

    # node labels and machine identity
    labels: Literal["on", "off", "dry-run"] = Field("on", description="Node labelling mode.")
    label_prefix: Annotated[str, AfterValidator(_label_prefix)] = Field(
        "gpuid.github.com", description="Prefix of the node labels."
    )
    label_resync_interval: PositiveDuration = Field(600.0, description="Label resync period.")
    label_startup_jitter: Duration = Field(
        30.0, description="Random delay (0 to this) before the first label patch."
    )
    label_annotation: bool = Field(True, description="Also write a JSON detail annotation.")
    dmi_product_uuid_path: str = Field(
        "/sys/class/dmi/id/product_uuid", description="DMI product UUID file."
    )
    machine_id_path: str = Field("/etc/machine-id", description="machine-id file.")

    # serving
    server_address: str = Field("0.0.0.0", description="Address of the HTTP server.")
    server_port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP server.")
    server_idle_timeout: PositiveDuration = Field(
        30.0,
        description="An HTTP connection that sends nothing for this long is closed, and so is "
        "a request whose line and headers are not complete this long after they began.",
    )
    server_max_connections: int = Field(
        512,
        ge=1,
        description="Open HTTP connections at most (and at most half the file-descriptor limit); "
        "one more closes the longest quiet connection not serving a request.",
    )
    metrics_naming: Literal["prometheus", "dcgm"] = Field(
        "prometheus", description="Field and label names of /gpu/metrics."
    )
    metrics_created_series: bool = Field(
        False, description="Serve the `_created` series of /metrics counters and histograms."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    # health
    expected_gpu_count: int = Field(
        -1,
        ge=-1,
        description="Expected GPUs on the node; -1 takes the kubelet's allocatable count, or "
        "on a node with GPUs only through DRA the DRA driver's ResourceSlices.",
    )
    node_conditions: bool = Field(False, description="Write a Node condition per unhealthy GPU.")
    node_events: bool = Field(
        True,
        description="Post Kubernetes Events on the Node for GPU health changes, GPUs replaced "
        "and latched XIDs cleared (with API access).",
    )
    health_window: PositiveDuration = Field(
        300.0, description="Window of the ECC-growth and clock-slowdown rate checks."
    )
    xid_hold: PositiveDuration = Field(
        600.0, description="How long a non-latching XID keeps its GPU degraded."
    )
    xid_repeat_count: int = Field(
        3,
        ge=0,
        description="The same XID this many times within XID_REPEAT_WINDOW raises its action "
        "one step (0: never).",
    )
    xid_repeat_window: PositiveDuration = Field(
        3600.0, description="Window in which repeats of one XID are counted."
    )
    pcie_replay_threshold: int = Field(
        40,
        ge=0,
        description="PCIe replays within HEALTH_WINDOW that degrade the link check (0: never).",
    )
    kernel_log: str = Field(
        "",
        pattern=r"^(/.*)?$",
        description="Kernel log device read for NVIDIA driver lines (/dev/kmsg): XID detail, "
        "GPUs fallen off the bus, NVSwitch SXIDs; empty: not read.",
    )
    fault: Annotated[CommaList, AfterValidator(_faults)] = Field(
        default_factory=list,
        description="Faults a simulated node injects: <kind>:gpu<N>[@<delay>], comma list "
        "(xid79:gpu2, lost:gpu3, remap-pending:gpu1, ecc-growth:gpu0, thermal:gpu1, ...).",
    )

    def effective_stall_timeout(self) -> float:
        """The bound on one collection or NVML call before the collector counts as stalled."""
        if self.stall_timeout > 0:
            return self.stall_timeout
        return max(30.0, 3 * self.collect_interval)

    def effective_node_name(self) -> str:
        return self.node_name or socket.gethostname()

    def redacted(self) -> dict[str, Any]:
        """The effective config with every secret replaced, safe for logs and /status."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                out[name] = REDACTED if value.get_secret_value() else ""
            elif name in _URL_FIELDS:
                out[name] = redact_url(value)
            else:
                out[name] = value
        return out


def env_name(field: str) -> str:
    return field.upper()
