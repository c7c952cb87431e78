"""Run every benchmark module (or those named on the command line) and print one table."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import sys

import benchmarks
from benchmarks.common import Row


def _modules(selected: list[str]) -> list[str]:
    names = sorted(
        m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_")
    )
    if selected:
        names = [n for n in names if any(s in n for s in selected)]
    return names


def _print(rows: list[Row]) -> None:
    header = ("group", "benchmark", "value", "unit", "note")
    cells = [header] + [
        (r.group, r.name, f"{r.value:,.3f}".rstrip("0").rstrip("."), r.unit, r.note) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    rows: list[Row] = []
    # Names select modules; `--option=value` arguments are read by the modules that take them.
    for name in _modules([a for a in sys.argv[1:] if not a.startswith("--")]):
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"running {name} …", file=sys.stderr, flush=True)
        rows.extend(asyncio.run(module.run()))
    _print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
