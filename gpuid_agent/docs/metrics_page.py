"""docs/metrics.md from the agent's metric registry and the /gpu/metrics field table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.metrics import MetricWrapperBase

from gpuid_agent.docs.markdown import GENERATED, cell
from gpuid_agent.runtime.metrics import DEPRECATED_ALIASES, AgentMetrics
from gpuid_agent.serving import gpu_metrics

_SERIES_SUFFIX = {"counter": "_total", "info": "_info"}


def metric_wrappers(metrics: object) -> dict[str, MetricWrapperBase]:
    """Every metric of the agent by name, the groups' (labels, attribution) included."""
    found: dict[str, MetricWrapperBase] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            found[value._name] = value
        elif type(value).__module__ == AgentMetrics.__module__:
            found |= metric_wrappers(value)
    return found


def own_metrics_rows() -> Iterable[str]:
    metrics = AgentMetrics()
    wrappers = metric_wrappers(metrics)
    for family in metrics.registry.collect():
        wrapper = wrappers.get(family.name)
        if wrapper is not None:
            labels: Sequence[str] = wrapper._labelnames
        else:
            labels = sorted({k for s in family.samples for k in s.labels})
        series = family.name + _SERIES_SUFFIX.get(family.type, "")
        label_text = ", ".join(f"`{label}`" for label in labels) or "—"
        yield (f"| `{series}` | {family.type} | {label_text} | {cell(family.documentation)} |")


def _unit(scale: float, naming: str, field: gpu_metrics.FieldSpec) -> str:
    if naming == "dcgm" and scale == 1 / gpu_metrics.MIB:
        return "MiB"
    if naming == "prometheus" and scale == 0.01:
        return "ratio 0-1"
    name = field.prom_name
    for suffix, unit in (("_bytes", "bytes"), ("_celsius", "°C"), ("_watts", "W")):
        if name.endswith(suffix):
            return unit
    return "percent" if naming == "dcgm" and name.endswith("_ratio") else "—"


_SUMS = (
    "### Sums and averages over GPUs",
    "",
    "Under dcgm naming every telemetry series of a GPU is repeated once per container holding",
    "it, with that holder's `namespace`, `pod` and `container`: dcgm-exporter's layout, kept",
    'for compatibility so its dashboards\' `pod` selectors (`DCGM_FI_DEV_GPU_UTIL{pod="x"}`)',
    "keep working. A GPU time-shared by three pods has three identical series, so a plain",
    "`sum` counts it three times (NVIDIA's dcgm-exporter dashboard does). In either naming a",
    "MIG GPU has a series of its own and one per instance. Keep one series per whole GPU",
    "before adding up:",
    "",
    "```promql",
    'sum by (node) (max by (node, UUID) (DCGM_FI_DEV_POWER_USAGE{GPU_I_ID=""}))',
    'sum by (node) (max by (node, uuid) (gpuid_gpu_power_watts{gpu_instance_id=""}))',
    "```",
    "",
    "`max` and `min` need nothing. The chart's dashboard does this in every GPU panel. Under",
    "Prometheus naming a GPU has one series and its holders are in",
    "`gpuid_gpu_allocation_info` (see [attribution.md](attribution.md) for the join).",
    "",
)


def metrics_page() -> str:
    lines = [
        GENERATED,
        "",
        "# Metrics reference",
        "",
        "## `/metrics`: the agent itself",
        "",
        "One registry per agent. Scrapes read it as is; nothing is computed per scrape.",
        "",
        "| Series | Type | Labels | Description |",
        "| --- | --- | --- | --- |",
        *own_metrics_rows(),
        "",
        "Histograms also expose `_bucket`, `_sum` and `_count` series. The `_created` series of",
        "counters and histograms are left out unless `METRICS_CREATED_SERIES=true`. Every",
        "counter an alert uses exists at 0 from the start for each label value the agent can",
        "give it (each exporter and drop reason, each collection error reason, each label",
        "reconciliation failure reason), so `increase()` sees the first event.",
        "",
        "### Deprecated names",
        "",
        "Served with the same value for one more release, then removed: move queries, alerts",
        "and dashboards to the new name.",
        "",
        "| Deprecated | Use instead |",
        "| --- | --- |",
        *(f"| `{old}` | `{new}` |" for old, new in DEPRECATED_ALIASES.items()),
        "",
        "## `/gpu/metrics`: per-GPU telemetry",
        "",
        "Rendered from the latest snapshot when scraped (or just before a scrape is due), once",
        "per snapshot and format; later scrapes of that snapshot get the same bytes.",
        "`METRICS_NAMING=prometheus` (default) uses base units; `METRICS_NAMING=dcgm` keeps",
        "dcgm-exporter's names and units so existing dashboards keep working.",
        "",
        "| Prometheus naming | Unit | dcgm naming | Unit | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    documented = set()
    for spec in gpu_metrics.FIELDS:
        lines.append(
            f"| `{spec.prom_name}` | {_unit(spec.prom_scale, 'prometheus', spec)} | "
            f"`{spec.dcgm_name}` | {_unit(spec.dcgm_scale, 'dcgm', spec)} | {cell(spec.help)} |"
        )
        documented |= {spec.prom_name, spec.dcgm_name}
    info = {"prometheus": "gpuid_gpu_info", "dcgm": "DCGM_FI_DEV_INFO"}
    lines.append(
        f"| `{info['prometheus']}` | 1 | `{info['dcgm']}` | 1 | GPU identity; the value is always"
        " 1, the labels carry serial, chassis, module id and driver version. |"
    )
    documented |= set(info.values())
    others = [
        (naming, name)
        for naming in ("prometheus", "dcgm")
        for name in gpu_metrics.metric_names(naming)
        if name not in documented
    ]
    if others:
        lines += ["", "Further series:", ""]
        lines += [f"- `{name}` ({naming} naming)" for naming, name in others]
    lines += [
        "",
        "### Labels",
        "",
        "| Prometheus naming | dcgm naming |",
        "| --- | --- |",
        *(f"| `{prom}` | `{dcgm}` |" for prom, dcgm in gpu_metrics.LABELS),
        "",
        "`gpuid_gpu_info` / `DCGM_FI_DEV_INFO` add `chassis`, `module_id` and `driver_version`.",
        "The dcgm names apply to the `DCGM_FI_*` families only: our own `gpuid_*` families keep",
        "the snake_case names in either naming.",
        "",
        "### Types under dcgm naming",
        "",
        "As dcgm-exporter's counter file declares them: "
        + ", ".join(f"`{f.dcgm_name}`" for f in gpu_metrics.FIELDS if f.dcgm_counter)
        + " are counters under their bare names (no `_total`); the rest are gauges. OpenMetrics",
        "requires `_total` on counters, so under dcgm naming `/gpu/metrics` is served in the",
        "Prometheus text format only, as dcgm-exporter serves it.",
        "",
        *_SUMS,
    ]
    return "\n".join(lines)
