"""Settings loaded once at start: the environment and CLI overrides validated, then checked
across settings and against the files and addresses they name (`config_checks`); every
problem is reported at once, naming its variable (ConfigError, exit 2)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

from gpuid_agent.runtime.config import Settings, env_name
from gpuid_agent.runtime.config_checks import cross_checks
from gpuid_agent.runtime.errors import ConfigError


def _describe(error: Mapping[str, Any]) -> str:
    """What is wrong with a value, never the value: one pasted into the wrong variable (a
    password in POSTGRES_PORT) would reach the terminal and the pod's logs."""
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def _problems(exc: ValidationError) -> dict[str, str]:
    problems: dict[str, str] = {}
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        problems.setdefault(env_name(field), _describe(error))
    return problems


def _unechoed(problems: dict[str, str], given: Mapping[str, Any]) -> dict[str, str]:
    """Each message with its variable's own value cut out, should a check have quoted it."""
    out = {}
    for name, why in problems.items():
        raw = str(given.get(name.lower()) or os.environ.get(name) or "").strip()
        out[name] = why.replace(raw, "<the value>") if len(raw) >= 6 else why
    return out


def load_settings(
    overrides: Mapping[str, Any] | None = None, fields: Collection[str] | None = None
) -> Settings:
    """Read env and apply overrides (CLI flags); raise ConfigError naming every bad variable.

    `fields`: the settings a command reads (None: all). The others keep their defaults,
    whatever the environment says, so a variable meant for another command neither applies
    nor stops this one."""
    init = {k: v for k, v in (overrides or {}).items() if v is not None}
    if fields is not None:
        unread = {
            name: field.get_default(call_default_factory=True)
            for name, field in Settings.model_fields.items()
            if name not in fields
        }
        loaded = load_settings(init | unread)
        # as if only the read settings had been given: "set explicitly" keeps its meaning
        return Settings.model_construct(
            loaded.model_fields_set - unread.keys(),
            **{name: getattr(loaded, name) for name in Settings.model_fields},
        )
    try:
        settings = Settings(**init)
    except ValidationError as exc:
        problems = _problems(exc)
        # Check the rest with each bad value at its default, so one message names every
        # variable to fix (BATCH_SIZE=0 and a missing POSTGRES_HOST together).
        bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        defaults = {
            name: field.get_default(call_default_factory=True)
            for name, field in Settings.model_fields.items()
            if name in bad
        }
        try:
            rest = Settings(**(init | defaults))
        except ValidationError:
            rest = None
        if rest is not None:
            for name, why in cross_checks(rest).items():
                if not (name == "FAULT" and "simulate" in bad):  # FAULT depends on SIMULATE
                    problems.setdefault(name, why)
        raise ConfigError(_unechoed(problems, init)) from None
    problems = cross_checks(settings)
    if problems:
        raise ConfigError(_unechoed(problems, init))
    return settings
