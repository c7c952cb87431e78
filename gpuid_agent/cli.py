"""Command line: run, inventory, check-config, health clear, --version.

Every setting is also a flag (`BATCH_SIZE` → `--batch-size`); flags win over the environment.
`run` is the default: `gpuid-agent --simulate gb200x4` runs the agent. A start that cannot
work ends with one line on stderr naming the variable to fix, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import orjson
from pydantic_settings import NoDecode

from gpuid_agent import __version__
from gpuid_agent.docs.configuration_page import setting_group
from gpuid_agent.history import command as history_command
from gpuid_agent.history.command import SETTINGS as HISTORY_SETTINGS
from gpuid_agent.runtime import log
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.config_checks import unused_settings
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ConfigError, NvmlUnavailableError

EXIT_CONFIG = 2
EXIT_NVML = 3
COMMANDS = ("run", "inventory", "check-config", "health", "history")
EXIT_CODES = """\
With no command, runs the agent: `gpuid-agent --simulate gb200x4` is `gpuid-agent run ...`.

exit codes:
  0  done (run: stopped by SIGTERM or SIGINT)
  2  invalid configuration, or a start it makes impossible (a port in use, an unreadable
     token or CA file); one line on stderr names each variable to fix
  3  NVML unavailable (inventory): no driver, or its library not found
"""
NVML_HINT = (
    "Without an NVIDIA driver try --simulate gb200x4 (SIMULATE=gb200x4); with the driver "
    "installed elsewhere set NVML_LIBRARY_PATH (--nvml-library-path) to its libnvidia-ml.so.1"
)
_log = log.get("cli")


# The settings each command reads and so takes as flags (None: every one); the environment's
# other variables do not apply to it.
COMMAND_SETTINGS: dict[str, tuple[str, ...] | None] = {
    "run": None,
    "check-config": None,
    "inventory": ("nvml_library_path", "simulate", "fault", "node_name"),
    "health": ("state_dir",),
    "history": HISTORY_SETTINGS,
}
SETTINGS_GROUP = "settings (each also read from its environment variable)"
RUN_SETTINGS = """\
Every setting is also read from its environment variable (--batch-size: BATCH_SIZE); a flag
wins. docs/configuration.md describes each, with its default and type.
"""


def _add_setting_flags(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...] | None = None,
    *,
    grouped: bool = False,
) -> None:
    """A flag per setting in `names` (None: all), under one heading, or (`grouped`) under a
    heading per component as docs/configuration.md groups them."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        title = setting_group(name) if grouped else SETTINGS_GROUP
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        # comma-list settings may also be given as a repeated flag (--fault a --fault b)
        repeatable = NoDecode in field.metadata
        groups[title].add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"setting_{name}",
            metavar=name.upper(),
            default=None,
            action="append" if repeatable else "store",
            help=field.description,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuid-agent",
        description="GPU inventory and pod attribution agent.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuid-agent {__version__}")
    commands = parser.add_subparsers(dest="command")
    raw = argparse.RawDescriptionHelpFormatter  # keeps the exit-code table as written
    run = commands.add_parser(
        "run",
        help="run the agent (default)",
        description=RUN_SETTINGS,
        epilog=EXIT_CODES,
        formatter_class=raw,
    )
    _add_setting_flags(run, grouped=True)
    inventory = commands.add_parser(
        "inventory",
        help="print what NVML shows on this node",
        epilog=EXIT_CODES,
        formatter_class=raw,
    )
    inventory.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_setting_flags(inventory, COMMAND_SETTINGS["inventory"])
    check = commands.add_parser(
        "check-config",
        help="print the effective config, secrets redacted",
        description=RUN_SETTINGS,
        epilog=EXIT_CODES,
        formatter_class=raw,
    )
    _add_setting_flags(check, grouped=True)
    health = commands.add_parser(
        "health",
        help="act on the running agent's GPU health (run inside its pod: kubectl exec)",
        epilog=EXIT_CODES,
        formatter_class=raw,
    )
    actions = health.add_subparsers(dest="health_command", required=True)
    clear = actions.add_parser(
        "clear",
        help="clear one GPU's latched XIDs after a repair (taken at the next collection)",
    )
    clear.add_argument("gpu", help="the GPU's UUID or index")
    _add_setting_flags(clear, COMMAND_SETTINGS["health"])
    history_command.add_parser(
        commands, lambda p: _add_setting_flags(p, COMMAND_SETTINGS["history"])
    )
    return parser


def _health_clear(settings: Settings, gpu: str) -> int:
    from gpuid_agent.runtime.clear_requests import write_clear_request

    if not settings.state_dir:
        print("gpuid-agent: STATE_DIR is not set: the agent keeps no health state", file=sys.stderr)
        return EXIT_CONFIG
    try:
        path = write_clear_request(settings.state_dir, gpu)
    except (OSError, ValueError) as exc:
        print(f"gpuid-agent: cannot request the clear: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"clear of GPU {gpu} requested ({path.name}); the agent takes it at its next collection")
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        key.removeprefix("setting_"): ",".join(value) if isinstance(value, list) else value
        for key, value in vars(args).items()
        if key.startswith("setting_") and value is not None
    }


def _run(settings: Settings) -> int:
    from gpuid_agent.agent import run_agent

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_agent(settings, stop)

    asyncio.run(main())
    return 0


def _inventory(settings: Settings, as_json: bool) -> int:
    from gpuid_agent.setup.environment import node_environment
    from gpuid_agent.sources.nvml.source import NvmlSource

    async def read() -> Any:
        environment = node_environment(settings)
        source = NvmlSource(environment.nvml_api)
        try:
            await source.init()
            return await source.read()
        finally:
            await source.close()
            await environment.stop()

    try:
        reading = asyncio.run(read())
    except NvmlUnavailableError as exc:
        reason = " ".join(str(exc).split()).rstrip(".")
        print(f"gpuid-agent: NVML unavailable: {reason}. {NVML_HINT}", file=sys.stderr)
        return EXIT_NVML
    if as_json:
        body = {
            "driver_version": reading.driver_version,
            "cuda_driver_version": reading.cuda_driver_version,
            "gpus": [dataclasses.asdict(g) for g in reading.gpus],
            "unreadable": {str(k): v for k, v in reading.lost.items()},
        }
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"driver {reading.driver_version or '-'}  cuda {reading.cuda_driver_version or '-'}")
    columns = ("IDX", "UUID", "SERIAL", "MODEL", "PCI BUS ID", "MODULE", "CHASSIS", "MIG")
    rows = [
        (
            str(g.index),
            g.uuid,
            g.serial or "-",
            g.name or "-",
            g.pci_bus_id or "-",
            "-" if g.module_id is None else str(g.module_id),
            g.chassis_serial or "-",
            str(len(g.mig_devices)) if g.mig_enabled else "off" if g.mig_enabled is False else "-",
        )
        for g in reading.gpus
    ]
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    for row in [columns, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for index, why in sorted(reading.lost.items()):
        print(f"GPU {index} unreadable: {why}", file=sys.stderr)
    return 0


def _with_command(argv: Sequence[str]) -> list[str]:
    """`run` when no command is given (`gpuid-agent --simulate gb200x4`)."""
    args = list(argv)
    if args and (args[0] in COMMANDS or args[0] in ("-h", "--help", "--version")):
        return args
    return ["run", *args]


def _warn_unused(settings: Settings) -> None:
    unused = unused_settings(settings)
    if unused:
        _log.warning(
            "gpuid settings set but not used: this agent reads only its own node's pods",
            extra={"settings": unused},
        )


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC core logs to stderr in its own format, where the agent's lines are JSON; keep only
    # its errors. Read once, when grpc is first imported (after this, by the agent).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(_with_command(sys.argv[1:] if argv is None else argv))
    try:
        settings = load_settings(_overrides(args), COMMAND_SETTINGS[args.command or "run"])
    except ConfigError as exc:
        print(f"gpuid-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    log.configure(settings.log_level)
    _warn_unused(settings)
    if args.command == "history":
        return history_command.run(args, settings)
    if args.command == "check-config":
        body = orjson.dumps(settings.redacted(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        sys.stdout.write(body.decode() + "\n")
        return 0
    if args.command == "health":
        return _health_clear(settings, args.gpu)
    try:
        if args.command == "inventory":
            return _inventory(settings, args.json)
        return _run(settings)
    except ConfigError as exc:  # found only on trying: a port in use
        print(f"gpuid-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
