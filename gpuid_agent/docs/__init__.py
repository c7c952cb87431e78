"""Reference pages generated from the code, so they cannot drift from it.

docs/configuration.md comes from the Settings model, docs/metrics.md from the agent's metric
registry and the /gpu/metrics field table, and the XID table in docs/health.md from the XID
catalogue's data file. `python -m gpuid_agent.docs` writes them;
`--check` exits 1 when a committed page differs from what the code says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpuid_agent.docs.configuration_page import configuration_page, describe_default, format_seconds
from gpuid_agent.docs.health_page import health_page, xid_table
from gpuid_agent.docs.metrics_page import metric_wrappers, metrics_page, own_metrics_rows

__all__ = [
    "PAGES",
    "SPLICED",
    "configuration_page",
    "describe_default",
    "format_seconds",
    "health_page",
    "main",
    "metric_wrappers",
    "metrics_page",
    "own_metrics_rows",
    "xid_table",
]

PAGES: dict[str, Callable[[], str]] = {
    "configuration.md": configuration_page,
    "metrics.md": metrics_page,
}

# Hand-written pages with a generated part: built from the page as it is.
SPLICED: dict[str, Callable[[str], str]] = {"health.md": health_page}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuid_agent.docs", description="Write the generated reference pages."
    )
    parser.add_argument("directory", nargs="?", default="docs", help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a page differs instead of writing it"
    )
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    stale = []
    for name in [*PAGES, *SPLICED]:
        path = directory / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if name in PAGES:
            text = PAGES[name]()
        elif current is None:
            continue  # a hand-written page is not created here, only kept current
        else:
            text = SPLICED[name](current)
        if current == text:
            continue
        if args.check:
            stale.append(str(path))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python -m gpuid_agent.docs`", file=sys.stderr)
        return 1
    return 0
