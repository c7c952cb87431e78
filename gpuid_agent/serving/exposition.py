"""/gpu/metrics families, and their two exposition formats written straight from rows.

A `Family` is a name, help text, type (gauge or counter) and label names; its builder appends
one row per series, the label values and the value, with `add_metric`: the call shape of
prometheus_client's families, so a builder written against those ports by its constructors:

    GaugeMetricFamily(name, help, labels=names)    -> Family(name, help, "gauge", names)
    CounterMetricFamily(name, help, labels=names)  -> Family(name, help, "counter", names)
    (dcgm-exporter's counters without `_total`)    -> Family(..., "counter", names, bare=True)
    if family.samples: ...                          -> if family.rows: ...

(`add_metrics` puts one value on several label sets at once: dcgm naming's per-holder rows.)

`write_text` and `write_openmetrics` write byte for byte what prometheus_client's two
`generate_latest` write for the same families (tests/test_serving_exposition.py checks that
against prometheus_client), but without one library object per sample, which at 1,024 pods
under dcgm naming (~28,000 series) cost more than the writing itself. The repetition of that
layout is what makes it cheap: every telemetry family repeats the same per-holder label sets,
so a label set is formatted once per write and reused; and one device's value, repeated on
the consecutive rows of its holders, is formatted once.
Only what /gpu/metrics makes is handled: gauges and counters, no timestamps, no units, and
names in Prometheus' classic character set (checked when a family is made, so nothing needs
escaping but label values and help texts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import Literal

from prometheus_client.utils import floatToGoString

FamilyType = Literal["gauge", "counter"]
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
Row = tuple[tuple[str, ...], float]


@functools.cache
def _valid(name: str) -> bool:
    return _NAME.fullmatch(name) is not None  # the same few names, family after family


class Family:
    """One metric family of a snapshot: its rows are (label values, value), in order."""

    __slots__ = ("bare", "help", "labelnames", "name", "rows", "type")

    def __init__(
        self,
        name: str,
        help: str,
        type: FamilyType,
        labelnames: Sequence[str],
        *,
        bare: bool = False,
    ) -> None:
        if type not in ("gauge", "counter") or (bare and type != "counter"):
            raise ValueError(f"{name}: {type} families are not handled here")
        if type == "counter" and name.endswith("_total") and not bare:
            name = name.removesuffix("_total")  # exposed with it, as prometheus_client does
        bad = [n for n in (name, *labelnames) if not _valid(n)]
        if bad:
            raise ValueError(f"{name}: invalid names {bad}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"{name}: repeated label names {list(labelnames)}")
        self.name = name
        self.help = help
        self.type = type
        # a counter under its bare name (dcgm-exporter's): the text format allows it,
        # OpenMetrics does not, so a page holding one is served as text only
        self.bare = bare
        self.labelnames = tuple(labelnames)
        self.rows: list[Row] = []

    @property
    def series_name(self) -> str:
        """The name its samples carry: a counter's ends in `_total` unless bare."""
        return self.name + "_total" if self.type == "counter" and not self.bare else self.name

    def add_metric(self, values: Sequence[str], value: float) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(values)} values for {self.labelnames}")
        self.rows.append((tuple(values), value))

    def add_metrics(self, label_sets: Iterable[Sequence[str]], value: float) -> None:
        """One value on several series: under dcgm naming, a device's on each holder's."""
        rows = [(tuple(values), value) for values in label_sets]
        width = len(self.labelnames)
        if any(len(values) != width for values, _ in rows):
            raise ValueError(f"{self.name}: a row without one value per {self.labelnames}")
        self.rows += rows


def encodable(value: str) -> str:
    """A label value that always encodes: API strings may carry lone surrogates, which become
    U+FFFD rather than failing the whole page."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _LabelSet:
    """The `{name="value",...} ` bytes of a family's label sets, each made once per write.

    Names are sorted as prometheus_client sorts them; the sorted pairs are one str.format
    template per tuple of names, and values are escaped only when one needs it."""

    __slots__ = ("_order", "_template", "done")

    def __init__(self, names: tuple[str, ...]) -> None:
        self._order = sorted(range(len(names)), key=names.__getitem__)
        pairs = ",".join(f'{names[i]}="{{{n}}}"' for n, i in enumerate(self._order))
        self._template = "{{" + pairs + "}} " if names else " "
        self.done: dict[tuple[str, ...], bytes] = {}

    def make(self, values: tuple[str, ...]) -> bytes:
        ordered = [values[i] for i in self._order]
        joined = "".join(ordered)
        if "\\" in joined or "\n" in joined or '"' in joined:
            ordered = [_escape_value(v) for v in ordered]
        text = self.done[values] = self._template.format(*ordered).encode("utf-8")
        return text


def _header(family: Family, openmetrics: bool) -> bytes:
    if openmetrics:
        if family.bare:
            raise ValueError(f"{family.name}: a counter without _total is not OpenMetrics")
        name, help = family.name, _escape_value(family.help)
    else:
        name, help = family.series_name, family.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {help}\n# TYPE {name} {family.type}\n".encode()


def _write(families: Iterable[Family], openmetrics: bool) -> bytes:
    # bytes pieces, joined once: ~40 % less than joining str pieces and encoding the result
    out: list[bytes] = []
    append = out.append
    label_sets: dict[tuple[str, ...], _LabelSet] = {}
    for family in families:
        append(_header(family, openmetrics))
        series = family.series_name.encode("utf-8")
        label_set = label_sets.get(family.labelnames)
        if label_set is None:
            label_set = label_sets[family.labelnames] = _LabelSet(family.labelnames)
        done, make = label_set.done, label_set.make
        last_value: object = None
        last_text = b""
        for values, value in family.rows:
            if value is not last_value:  # a device's value on its holders' rows: once
                last_value = value
                last_text = f"{floatToGoString(value)}\n".encode()  # type: ignore[no-untyped-call]
            append(series)
            append(done.get(values) or make(values))
            append(last_text)
    if openmetrics:
        append(b"# EOF\n")
    return b"".join(out)


def write_text(families: Iterable[Family]) -> bytes:
    """The Prometheus text format (0.0.4) of `families`."""
    return _write(families, openmetrics=False)


def write_openmetrics(families: Iterable[Family]) -> bytes:
    """OpenMetrics 1.0 of `families`; refused for a page with a bare counter."""
    return _write(families, openmetrics=True)
