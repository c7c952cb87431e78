"""An answer as one self-contained HTML page: inline CSS, SVG and a few lines of script, nothing
fetched. The timeline has a row per GPU serial grouped by chassis and node, a bar per
allocation coloured by namespace, marks for health transitions, XIDs, replacements and moves,
the exact times and pod names on hover (SVG titles, so without script too), and a legend.
At 72 GPUs over 30 days it is about 1,900 pixels tall and 1,400 wide."""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from html import escape

from gpuid_agent.history import render_data
from gpuid_agent.history.answers import Answer
from gpuid_agent.history.facts import Holding, Mark
from gpuid_agent.history.render_table import to_table
from gpuid_agent.history.timeline import NODE_ROW, Row, Timeline, layout
from gpuid_agent.history.times import show

WIDTH = 1400
LABEL = 250
PLOT = WIDTH - LABEL - 20
ROW = 18
GROUP = 26
AXIS = 34
# Distinct colours for namespaces (more namespaces reuse them; the legend says which is which).
PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
    "#1f77b4", "#8cd17d", "#d37295", "#86bcb6", "#499894", "#b6992d", "#a0cbe8", "#ffbe7d",
    "#6b6ecf", "#bcbd22", "#17becf", "#8c564b",
)  # fmt: skip
IDLE = "#bab0ac"
MARKS = {
    "xid": ("XID", "#d62728"),
    "health": ("health transition", "#ff7f0e"),
    "replaced": ("GPU replaced", "#222222"),
    "added": ("GPU added", "#555555"),
    "moved": ("moved here", "#1f4e9c"),
}
_STATE = {"unhealthy": "#d62728", "degraded": "#ff7f0e", "healthy": "#2ca02c"}

_STYLE = """
body { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 16px;
       color: #222; }
h1 { font-size: 18px; margin: 0 0 4px; }
.meta { color: #555; margin-bottom: 10px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 8px 0; max-width: 1400px; }
.legend span { white-space: nowrap; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: -2px;
          margin-right: 4px; border-radius: 2px; }
svg { display: block; background: #fff; }
.grid { stroke: #e6e6e6; }
.axis text, .label, .group text { font-size: 11px; fill: #333; }
.group rect { fill: #f3f3f3; }
.group text { font-weight: 600; }
.stay { fill: #eef2f7; }
.alloc { stroke: #fff; stroke-width: 0.5; }
.alloc.open { fill-opacity: 0.6; }
.alloc.hl { stroke: #000; stroke-width: 1.5; }
.mark { stroke: #fff; stroke-width: 1.2; paint-order: stroke; }
#info { position: sticky; top: 0; background: #fffbe6; border: 1px solid #e8dca0;
        padding: 4px 8px; min-height: 18px; white-space: pre-wrap; max-width: 1380px; z-index: 1; }
table.usage { border-collapse: collapse; margin-top: 12px; }
table.usage td, table.usage th { padding: 3px 10px; border-bottom: 1px solid #eee;
                                 text-align: left; }
table.usage td.n { text-align: right; font-variant-numeric: tabular-nums; }
.bar { display: inline-block; height: 10px; background: #4e79a7; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; }
"""

_SCRIPT = """
(function () {
  var info = document.getElementById("info");
  function lit(pod, on) {
    var bars = document.querySelectorAll(".alloc");
    for (var i = 0; i < bars.length; i++) {
      if (bars[i].getAttribute("data-pod") === pod) { bars[i].classList.toggle("hl", on); }
    }
  }
  function hover(e, on) {
    var item = e.currentTarget;
    if (on) {
      var t = item.querySelector("title");
      info.textContent = t ? t.textContent : "";
    }
    if (item.classList.contains("alloc")) { lit(item.getAttribute("data-pod"), on); }
  }
  var shown = document.querySelectorAll(".alloc, .mark");
  for (var i = 0; i < shown.length; i++) {
    shown[i].addEventListener("mouseenter", function (e) { hover(e, true); });
    shown[i].addEventListener("mouseleave", function (e) { hover(e, false); });
  }
  document.body.setAttribute("data-ready", "1");
})();
"""


def colours(namespaces: tuple[str, ...]) -> dict[str, str]:
    return {ns: IDLE if not ns else PALETTE[i % len(PALETTE)] for i, ns in enumerate(namespaces)}


def _ticks(start: datetime, end: datetime, tz: tzinfo) -> list[tuple[datetime, str]]:
    span = end - start
    step = next(
        (s for s in (timedelta(hours=h) for h in (1, 2, 3, 6, 12, 24, 48, 168, 720))
         if span / s <= 40),
        timedelta(days=30),
    )  # fmt: skip
    local = start.astimezone(tz)
    first = local.replace(minute=0, second=0, microsecond=0)
    if step >= timedelta(days=1):
        first = first.replace(hour=0)
    ticks = []
    moment = first
    while moment <= end:
        if moment >= start:
            fmt = "%m-%d" if step >= timedelta(days=1) else "%m-%d %H:%M"
            ticks.append((moment, moment.strftime(fmt)))
        moment = (moment + step).astimezone(tz)
    return ticks


class _Plot:
    def __init__(self, timeline: Timeline) -> None:
        self.t = timeline
        self.span = max((timeline.end - timeline.start).total_seconds(), 1.0)

    def x(self, moment: datetime | None, default: datetime) -> float:
        seconds = ((moment or default) - self.t.start).total_seconds()
        return LABEL + max(0.0, min(PLOT, PLOT * seconds / self.span))


def _holding_title(h: Holding, tz: tzinfo) -> str:
    lines = [
        f"{h.namespace}/{h.pod} ({h.container})" if h.container else f"{h.namespace}/{h.pod}",
        f"from {show(h.started_at, tz)} to {show(h.ended_at, tz) if h.ended_at else '(open)'}",
        f"GPU {h.serial} {h.uuid} on {h.node}" + (f" slot {h.slot}" if h.slot else ""),
    ]
    if h.workload:
        lines.append(f"workload {h.workload}")
    if h.gpu_seconds is not None:
        energy = render_data.kwh(h.energy_joules)
        lines.append(f"{render_data.hours(h.gpu_seconds)} GPU-hours, {energy} kWh")
    return "\n".join(lines)


def _mark_title(m: Mark, tz: tzinfo) -> str:
    return f"{show(m.time, tz)} {m.node} {m.serial}\n{m.describe()}"


def _mark(m: Mark, x: float, y: float, tz: tzinfo) -> str:
    _, colour = MARKS[m.kind]
    if m.kind == "health":
        colour = _STATE.get(m.state, colour)
    title = f"<title>{escape(_mark_title(m, tz))}</title>"
    cls = f'class="mark {m.kind}" data-kind="{m.kind}"'
    if m.kind == "xid":  # a triangle pointing down onto the row
        points = f"{x - 6:.1f},{y - 8:.1f} {x + 6:.1f},{y - 8:.1f} {x:.1f},{y + 4:.1f}"
        return f'<polygon {cls} points="{points}" fill="{colour}">{title}</polygon>'
    if m.kind in ("replaced", "added"):
        fill = colour if m.kind == "replaced" else "#fff"
        return (f'<rect {cls} x="{x - 4:.1f}" y="{y - 5:.1f}" width="8" height="8" '
                f'fill="{fill}" stroke="{colour}">{title}</rect>')  # fmt: skip
    if m.kind == "moved":
        corners = ((x, y - 6), (x + 5, y - 1), (x, y + 4), (x - 5, y - 1))
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in corners)
        return f'<polygon {cls} points="{points}" fill="{colour}">{title}</polygon>'
    return f'<circle {cls} cx="{x:.1f}" cy="{y - 1:.1f}" r="4" fill="{colour}">{title}</circle>'


def _row(row: Row, y: float, plot: _Plot, palette: dict[str, str], tz: tzinfo) -> list[str]:
    end = plot.t.end
    out = [f'<g class="gpu-row" data-serial="{escape(row.serial)}">']
    label = "node events" if row.serial == NODE_ROW else row.label
    out.append(f'<text class="label" x="6" y="{y + 13:.1f}">{escape(label)}</text>')
    for first, last in row.stays:
        x0, x1 = plot.x(first, first), plot.x(last, last)
        out.append(f'<rect class="stay" x="{x0:.1f}" y="{y + 1:.1f}" '
                   f'width="{max(x1 - x0, 1):.1f}" height="{ROW - 2}"/>')  # fmt: skip
    for h in row.bars:
        x0, x1 = plot.x(h.started_at, plot.t.start), plot.x(h.ended_at, end)
        state = "alloc" if h.ended_at else "alloc open"
        pod = escape(f"{h.namespace}/{h.pod}")
        out.append(
            f'<rect class="{state}" data-pod="{pod}" data-namespace="{escape(h.namespace)}" '
            f'x="{x0:.1f}" y="{y + 3:.1f}" width="{max(x1 - x0, 1.5):.1f}" height="{ROW - 6}" '
            f'fill="{palette.get(h.namespace, IDLE)}">'
            f"<title>{escape(_holding_title(h, tz))}</title></rect>"
        )
    out += [_mark(m, plot.x(m.time, m.time), y + ROW / 2, tz) for m in row.marks]
    out.append("</g>")
    return out


def svg(timeline: Timeline, tz: tzinfo) -> str:
    plot = _Plot(timeline)
    palette = colours(timeline.namespaces)
    height = AXIS * 2 + timeline.rows * ROW + len(timeline.groups) * GROUP
    ticks = _ticks(timeline.start, timeline.end, tz)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" role="img">']  # fmt: skip
    for moment, text in ticks:
        x = plot.x(moment, moment)
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{AXIS - 6}" x2="{x:.1f}" '
                     f'y2="{height - AXIS + 6}"/>')  # fmt: skip
        for at in (AXIS - 12, height - AXIS + 20):
            parts.append(f'<g class="axis"><text x="{x:.1f}" y="{at}" text-anchor="middle">'
                         f"{escape(text)}</text></g>")  # fmt: skip
    y = float(AXIS)
    for group in timeline.groups:
        heading = f"node {group.node}" + (f"  chassis {group.chassis}" if group.chassis else "")
        parts.append(f'<g class="group" data-node="{escape(group.node)}">'
                     f'<rect x="0" y="{y + 2:.1f}" width="{WIDTH}" height="{GROUP - 4}"/>'
                     f'<text x="6" y="{y + 17:.1f}">{escape(heading)}</text></g>')  # fmt: skip
        y += GROUP
        for row in group.rows.values():
            parts += _row(row, y, plot, palette, tz)
            y += ROW
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(timeline: Timeline) -> str:
    palette = colours(timeline.namespaces)
    items = [
        f'<span><i class="swatch" style="background:{palette[ns]}"></i>'
        f"{escape(ns or '(idle)')}</span>"
        for ns in timeline.namespaces
    ]
    items += [
        f'<span><i class="swatch" style="background:{colour}"></i>{escape(name)}</span>'
        for name, colour in MARKS.values()
    ]
    items.append('<span><i class="swatch" style="background:#eef2f7"></i>GPU on the node</span>')
    return f'<div class="legend">{"".join(items)}</div>'


def _usage(answer: Answer) -> str:
    top = max((r.gpu_seconds for r in answer.usage), default=1.0) or 1.0
    head = "".join(f"<th>{escape(c)}</th>" for c in answer.usage_columns)
    rows = []
    for r in answer.usage:
        cells = "".join(f"<td>{escape(g or '(idle)')}</td>" for g in r.group)
        width = 300 * r.gpu_seconds / top
        bar = f'<span class="bar" style="width:{width:.1f}px"></span>'
        rows.append(f'<tr class="usage-row">{cells}<td class="n">{r.gpu_hours:,.3f}</td>'
                    f'<td class="n">{r.kwh:,.3f}</td><td>{bar}</td></tr>')  # fmt: skip
    return (f'<table class="usage"><tr>{head}<th>GPU-hours</th><th>kWh</th><th></th></tr>'
            f'{"".join(rows)}</table>')  # fmt: skip


def to_html(answer: Answer, tz: tzinfo) -> str:
    title = to_table(answer, tz).split("\n", 1)[0]
    if answer.question == "usage":
        body = _usage(answer)
        meta = f"{len(answer.usage)} groups"
    else:
        timeline = layout(answer)
        body = (f'<div id="info">hover over a bar or mark</div>{_legend(timeline)}'
                f"{svg(timeline, tz)}")  # fmt: skip
        meta = (f"{timeline.rows} GPU rows, {timeline.bars} allocations, "
                f"{len(answer.marks)} events; {show(timeline.start, tz)} to "
                f"{show(timeline.end, tz)}")  # fmt: skip
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gpuid-agent history: {escape(title)}</title>
<style>{_STYLE}</style></head>
<body data-question="{answer.question}">
<h1>{escape(title)}</h1>
<div class="meta">{escape(meta)}</div>
{body}
<script>{_SCRIPT}</script>
</body></html>
"""
