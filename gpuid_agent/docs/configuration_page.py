"""docs/configuration.md from the Settings model: every variable, its flag, default, type and
meaning, grouped by what it configures."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import annotated_types
from pydantic import AfterValidator, BeforeValidator, SecretStr
from pydantic.fields import FieldInfo

from gpuid_agent.docs.markdown import GENERATED, cell
from gpuid_agent.runtime.config import Settings, env_name, parse_duration

# Settings grouped by name; a field matching no group is listed under "Other".
SETTING_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Identity",
        ("cluster_name", "node_name", "pod_name", "pod_namespace", "namespace", "label_selector"),
    ),
    ("Collection", ("nvml_", "collect_", "heartbeat_", "simulate")),
    (
        "Pipeline",
        ("exporter_type", "batch_size", "flush_", "queue_", "retry_", "timeout", "shutdown_"),
    ),
    ("HTTP exporter", ("http_",)),
    ("PostgreSQL exporter", ("postgres_",)),
    ("S3 exporter", ("s3_",)),
    ("OTLP exporter", ("otel_",)),
    ("Spool", ("spool_",)),
    ("Pod attribution", ("pod_resources_", "gpu_resource_", "pod_label_", "kube_")),
    ("Accounting", ("accounting_",)),
    ("Node labels and machine identity", ("labels", "label_", "dmi_", "machine_")),
    ("Serving", ("server_", "metrics_", "log_")),
    ("Health", ("expected_gpu_", "node_conditions", "node_events", "health_", "xid_")),
)


def setting_group(name: str) -> str:
    """The heading a setting is listed under (docs/configuration.md, `run --help`)."""
    for title, prefixes in SETTING_GROUPS:
        if any(name == p or (p.endswith("_") and name.startswith(p)) for p in prefixes):
            return title
    return "Other"


def _validators(field: FieldInfo) -> list[Callable[..., Any]]:
    found = []
    for item in field.metadata:
        if isinstance(item, BeforeValidator | AfterValidator):
            found.append(item.func)
    return found


def format_seconds(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            parts.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"≤ {item.le}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
    return ", ".join(parts)


def describe_type(field: FieldInfo) -> str:
    annotation = field.annotation
    validators = _validators(field)
    bounds = _bounds(field)
    if annotation is SecretStr:
        return "secret"
    if parse_duration in validators:
        positive = any(getattr(v, "__name__", "") == "_positive" for v in validators)
        return "duration, > 0" if positive else "duration"
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return "comma-separated list"
    if annotation is bool:
        return "boolean"
    if annotation is int:
        return f"integer, {bounds}" if bounds else "integer"
    if annotation is float:
        return f"number, {bounds}" if bounds else "number"
    if isinstance(annotation, types.UnionType):
        return " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(annotation))
    return "string"


def describe_default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and parse_duration in _validators(field):
        return f"`{format_seconds(value)}`"
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    if value == "" or value is None:
        return "(empty)"
    return f"`{value}`"


def configuration_page() -> str:
    by_group: dict[str, list[tuple[str, FieldInfo]]] = {}
    for name, field in Settings.model_fields.items():
        by_group.setdefault(setting_group(name), []).append((name, field))
    order = [title for title, _ in SETTING_GROUPS] + ["Other"]
    lines = [
        GENERATED,
        "",
        "# Configuration reference",
        "",
        "Every setting is an environment variable and a flag of `gpuid-agent run` and",
        "`check-config` (`BATCH_SIZE` → `--batch-size`); a flag wins over the environment.",
        "`gpuid-agent` with no command is `gpuid-agent run`. The other commands take, and read",
        "from the environment, only the settings they use: `inventory` NVML's",
        "(`NVML_LIBRARY_PATH`, `SIMULATE`, `FAULT`, `NODE_NAME`), `health clear` `STATE_DIR`,",
        "and `history` the `POSTGRES_*` and `S3_*` settings that say where the records are",
        "([history](history.md)).",
        "`gpuid-agent check-config` prints the effective configuration with secrets redacted",
        "(the user, password and query values of `HTTP_ENDPOINT` and `S3_ENDPOINT_URL` too).",
        "",
        "All invalid variables are reported together, on one line of stderr naming each, and",
        "the agent exits with status 2. The checks go beyond the values: the token and CA files",
        "of the HTTP exporter must be readable (and the bundle hold a PEM certificate),",
        "`SERVER_ADDRESS` must be an IP address or a name this node resolves, a user and",
        "password in `HTTP_ENDPOINT` cannot be combined with a bearer token, and `FAULT` must",
        "name GPUs the `SIMULATE` profile has. `check-config` runs the same checks.",
        "Each message says what is wrong with a value, never the value itself (entries of a",
        "list by position): a password pasted into the wrong variable stays off the terminal",
        "and the pod's logs.",
        "",
        "| Exit status | Meaning |",
        "| --- | --- |",
        "| 0 | done (`run`: stopped by SIGTERM or SIGINT) |",
        "| 2 | invalid configuration, or a start it makes impossible (`SERVER_PORT` in use, "
        "`SERVER_ADDRESS` not on this node); one line names each variable |",
        "| 3 | `inventory`: NVML unavailable (no driver, or `NVML_LIBRARY_PATH` wrong); the "
        "message says what to try |",
        "",
        "Durations accept `250ms`, `30s`, `5m`, `1h`, `1d`, combinations such as `1h30m`, or a",
        "plain number of seconds. Booleans accept `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`.",
        "Secrets are never logged, exported as metrics or shown on `/status`.",
        "",
    ]
    for title in order:
        fields = by_group.get(title)
        if not fields:
            continue
        lines += [
            f"## {title}",
            "",
            "| Variable | Flag | Default | Type | Description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, field in fields:
            lines.append(
                f"| `{env_name(name)}` | `--{name.replace('_', '-')}` | "
                f"{cell(describe_default(field))} | {cell(describe_type(field))} | "
                f"{cell(field.description or '')} |"
            )
        lines.append("")
    return "\n".join(lines)
