"""`gpuid-agent history`: its arguments, where the records are, and one answer printed.

The records are read from `--records DIR` (files of JSON lines), else PostgreSQL when
POSTGRES_HOST is set, else S3 when S3_BUCKET is (`--source` chooses when both are).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING

from gpuid_agent.history import questions, times
from gpuid_agent.history.answers import Answer
from gpuid_agent.runtime.errors import ConfigError, NotFoundError, RecordsUnreachableError

if TYPE_CHECKING:
    from gpuid_agent.history.source import Source
    from gpuid_agent.runtime.config import Settings

EXIT_NOT_FOUND = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 4
# The settings history reads: where the records are.
SETTINGS = (
    "postgres_host",
    "postgres_port",
    "postgres_db",
    "postgres_user",
    "postgres_password",
    "postgres_sslmode",
    "postgres_table",
    "postgres_allocations_table",
    "postgres_events_table",
    "s3_bucket",
    "s3_prefix",
    "s3_region",
    "s3_endpoint_url",
    "s3_path_style",
    "s3_partition_pattern",
)
EPILOG = """\
The records are read from --records DIR (the stdout exporter's JSON lines), else from
PostgreSQL when POSTGRES_HOST is set, else from S3 (through DuckDB: pip install
'gpuid-agent[history-s3]') when S3_BUCKET is. Times are read and shown in UTC unless --tz
names a zone; a time is 2025-03-01, 2025-03-01T12:00, 2025-03-01T12:00Z or now.

exit codes:
  0  answered
  1  no record of the serial, node or pod (or no usage) asked about
  2  invalid arguments or settings; one line names each to fix
  4  the records cannot be read (database, bucket or directory); the line names the setting
"""
USAGE_DAYS = 30


def add_parser(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    add_settings: Callable[[argparse.ArgumentParser], None],
) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("where the records are")
    where.add_argument(
        "--records", metavar="DIR", help="a directory of records (JSON lines, as stdout writes)"
    )
    where.add_argument(
        "--source",
        choices=("postgres", "s3"),
        help="the store to read when both POSTGRES_HOST and S3_BUCKET are set",
    )
    shown = common.add_argument_group("output (default: aligned tables)")
    out = shown.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--csv", action="store_true", help="print CSV")
    out.add_argument("--html", metavar="FILE", help="write one self-contained page with a timeline")
    shown.add_argument("--tz", default="UTC", help="time zone of times given and shown (UTC)")
    common.add_argument("--cluster", help="only records of this cluster")
    add_settings(common)
    history = commands.add_parser(
        "history",
        help="which GPUs, chassis, nodes and pods were together, when (from the records)",
        description="Answer break-fix, audit and billing questions from the fleet's records.",
        epilog=EPILOG,
        formatter_class=raw,
    )
    asked = history.add_subparsers(dest="question", required=True, metavar="QUESTION")
    gpu = asked.add_parser(
        "gpu", parents=[common], epilog=EPILOG, formatter_class=raw,
        help="every node, slot and chassis a GPU was under, the pods that held it, its events",
    )  # fmt: skip
    gpu.add_argument("serial", help="the GPU's serial")
    node = asked.add_parser(
        "node", parents=[common], epilog=EPILOG, formatter_class=raw,
        help="the GPUs (serials, chassis) and pods on a node at a time, or over a range",
    )  # fmt: skip
    node.add_argument("node", nargs="+", help="the node's name (several: one timeline)")
    node.add_argument("--at", metavar="TIME", help="the moment (default: now)")
    node.add_argument("--since", metavar="TIME", help="a range's start (with --until)")
    node.add_argument("--until", metavar="TIME", help="a range's end (default: now)")
    pod = asked.add_parser(
        "pod", parents=[common], epilog=EPILOG, formatter_class=raw,
        help="the physical GPUs a pod held, when, with GPU-seconds and energy",
    )  # fmt: skip
    pod.add_argument("pod", metavar="NAMESPACE/NAME", help="the pod")
    usage = asked.add_parser(
        "usage", parents=[common], epilog=EPILOG, formatter_class=raw,
        help="GPU-hours and kWh per namespace, workload or team (docs/accounting.md)",
    )  # fmt: skip
    usage.add_argument("--by", choices=("namespace", "workload", "team"), default="namespace")
    usage.add_argument(
        "--teams",
        metavar="FILE",
        help="`NAMESPACE[/WORKLOAD] TEAM` lines mapping namespaces (or one workload) to teams",
    )
    usage.add_argument("--since", metavar="TIME", help=f"default: {USAGE_DAYS} days before --until")
    usage.add_argument("--until", metavar="TIME", help="default: the current hour")


def _moment(args: argparse.Namespace, name: str, tz: tzinfo, now: datetime) -> datetime | None:
    value = getattr(args, name, None)
    if value is None:
        return None
    try:
        return times.parse(value, tz, now)
    except ValueError as exc:
        raise ConfigError({f"--{name}": str(exc)}, headline="invalid arguments") from None


def _teams(path: str | None) -> dict[str, str]:
    if path is None:
        raise ConfigError({"--teams": "--by team needs a file mapping namespaces to teams"},
                          headline="invalid arguments")  # fmt: skip
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError({"--teams": f"cannot read {path}: {exc}"}, "invalid arguments") from None
    teams = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            why = f"line {number}: expected `NAMESPACE[/WORKLOAD] TEAM`"
            raise ConfigError({"--teams": why}, headline="invalid arguments")
        teams[words[0]] = words[1]
    return teams


def open_source(args: argparse.Namespace, settings: Settings) -> Source:
    if args.records:
        from gpuid_agent.history.records_dir import RecordsDirectory

        return RecordsDirectory(args.records)
    choice = args.source
    if choice is None:
        if settings.postgres_host and settings.s3_bucket:
            raise ConfigError(
                {"--source": "both POSTGRES_HOST and S3_BUCKET are set: choose postgres or s3"},
                headline="invalid arguments",
            )
        choice = "postgres" if settings.postgres_host else "s3" if settings.s3_bucket else None
    if choice == "postgres":
        from gpuid_agent.history.postgres_source import PostgresSource

        return PostgresSource(settings)
    if choice == "s3":
        from gpuid_agent.history.s3_source import S3Source

        return S3Source(settings)
    raise ConfigError(
        {"--records": "say where the records are: --records DIR, POSTGRES_HOST or S3_BUCKET"},
        headline="invalid arguments",
    )


def answer(args: argparse.Namespace, source: Source, tz: tzinfo, now: datetime) -> Answer:
    cluster = args.cluster
    if args.question == "gpu":
        return questions.gpu(source, args.serial, cluster)
    if args.question == "pod":
        namespace, _, name = args.pod.partition("/")
        if not namespace or not name:
            raise ConfigError({"NAMESPACE/NAME": "give the pod as namespace/name"},
                              headline="invalid arguments")  # fmt: skip
        return questions.pod(source, namespace, name, cluster)
    if args.question == "node":
        at = _moment(args, "at", tz, now)
        since, until = _moment(args, "since", tz, now), _moment(args, "until", tz, now)
        if at is not None and (since or until):
            raise ConfigError({"--at": "give --at, or --since and --until, not both"},
                              headline="invalid arguments")  # fmt: skip
        if since is None:
            return questions.node(source, args.node, at=at or now, cluster=cluster)
        until = until or now
        if until < since:
            raise ConfigError({"--until": "is before --since"}, headline="invalid arguments")
        return questions.node(source, args.node, since=since, until=until, cluster=cluster)
    until = _moment(args, "until", tz, now) or now.replace(minute=0, second=0, microsecond=0)
    since = _moment(args, "since", tz, now) or until - timedelta(days=USAGE_DAYS)
    for name, moment in (("--since", since), ("--until", until)):
        if not times.whole_hour(moment):
            why = "usage is kept by the hour (UTC): give a whole hour"
            raise ConfigError({name: why}, headline="invalid arguments")
    if until <= since:
        raise ConfigError({"--until": "is not after --since"}, headline="invalid arguments")
    teams = _teams(args.teams) if args.by == "team" else None
    return questions.usage(source, args.by, since, until, teams=teams, cluster=cluster)


def run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        tz = times.zone(args.tz)
    except ValueError as exc:
        print(f"gpuid-agent: invalid arguments: --tz: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    now = datetime.now(UTC)
    try:
        source = open_source(args, settings)
        try:
            found = answer(args, source, tz, now)
        finally:
            source.close()
            _say_skipped(source)
    except ConfigError as exc:
        print(f"gpuid-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except NotFoundError as exc:
        print(f"gpuid-agent: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except RecordsUnreachableError as exc:
        print(f"gpuid-agent: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return _print(args, found, tz)


def _say_skipped(source: Source) -> None:
    skipped = getattr(source, "skipped", 0)
    if skipped:
        first = getattr(source, "first_skipped", "")
        print(
            f"gpuid-agent: skipped {skipped} line(s) that are no record (first: {first})",
            file=sys.stderr,
        )


def _print(args: argparse.Namespace, found: Answer, tz: tzinfo) -> int:
    if args.html:
        from gpuid_agent.history.render_html import to_html

        try:
            Path(args.html).write_text(to_html(found, tz), encoding="utf-8")
        except OSError as exc:
            print(f"gpuid-agent: invalid arguments: --html: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"wrote {args.html}")
        return 0
    if args.json:
        from gpuid_agent.history.render_data import to_json

        sys.stdout.write(to_json(found, tz))
    elif args.csv:
        from gpuid_agent.history.render_data import to_csv

        sys.stdout.write(to_csv(found, tz))
    else:
        from gpuid_agent.history.render_table import to_table

        sys.stdout.write(to_table(found, tz))
    return 0
