"""Checks across settings, and against the files and addresses they name, made once at start
(and by `check-config`), so a setting that can never work stops the agent with a message
naming it instead of failing every export or the server bind later."""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl

from gpuid_agent.runtime.config import SIMULATION_GPUS, Settings
from gpuid_agent.runtime.fault_spec import parse_faults
from gpuid_agent.runtime.redact import has_userinfo

# gpuid settings this agent accepts and ignores: a value set there is logged once at start.
UNUSED_GPUID_SETTINGS = ("namespace", "label_selector")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
_EXPORTER_NEEDS = {
    "http": ("http_endpoint", "required when EXPORTER_TYPE includes http"),
    "postgres": ("postgres_host", "required when EXPORTER_TYPE includes postgres"),
    "s3": ("s3_bucket", "required when EXPORTER_TYPE includes s3"),
}


def _env(field: str) -> str:
    return field.upper()


def exporter_problems(settings: Settings) -> dict[str, str]:
    problems: dict[str, str] = {}
    for exporter, (field, why) in _EXPORTER_NEEDS.items():
        if exporter in settings.exporter_type and not getattr(settings, field):
            problems[_env(field)] = why
    for field in ("postgres_table", "postgres_allocations_table", "postgres_events_table"):
        if not _IDENTIFIER.fullmatch(getattr(settings, field)):
            problems[_env(field)] = "must be an SQL identifier, optionally schema-qualified"
    return problems


def _unreadable(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        return f"cannot read the file it names: {exc.strerror or type(exc).__name__}"
    return None


def http_problems(settings: Settings) -> dict[str, str]:
    """The HTTP exporter's endpoint, token and CA bundle, checked only when it is enabled."""
    endpoint = settings.http_endpoint
    problems: dict[str, str] = {}
    if endpoint and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", endpoint):
        # never echo the value: it may hold credentials
        problems["HTTP_ENDPOINT"] = "must be an http:// or https:// URL"
    if "http" not in settings.exporter_type:
        return problems
    token_set = settings.http_auth_token.get_secret_value() or settings.http_auth_token_file
    if endpoint and token_set and has_userinfo(endpoint):
        problems["HTTP_ENDPOINT"] = (
            "holds a user and password while HTTP_AUTH_TOKEN or HTTP_AUTH_TOKEN_FILE sets a "
            "bearer token; a request carries one Authorization: keep one of them"
        )
    if settings.http_auth_token_file:
        why = _unreadable(settings.http_auth_token_file)
        if why:
            problems["HTTP_AUTH_TOKEN_FILE"] = why
    if settings.http_ca_bundle:
        why = _unreadable(settings.http_ca_bundle)
        if why is None:
            try:
                ssl.create_default_context(cafile=settings.http_ca_bundle)
            except (ssl.SSLError, ValueError) as exc:
                why = f"the file it names holds no usable PEM certificate ({exc})"
        if why:
            problems["HTTP_CA_BUNDLE"] = why
    return problems


def server_problems(settings: Settings) -> dict[str, str]:
    address = settings.server_address
    if not address:
        return {}
    try:
        ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        return {}
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return {
            "SERVER_ADDRESS": "not an IP address or a host name this node resolves "
            f"({type(exc).__name__}); e.g. 0.0.0.0, :: or 127.0.0.1"
        }
    return {}


def simulation_problems(settings: Settings) -> dict[str, str]:
    if not settings.fault:
        return {}
    if not settings.simulate:
        return {"FAULT": "faults are injected into a simulated node only: set SIMULATE too"}
    count = SIMULATION_GPUS.get(settings.simulate)
    if count is None:
        return {}
    faults = parse_faults(settings.fault)
    beyond = [f"entry {i} names GPU {f.gpu}" for i, f in enumerate(faults, 1) if f.gpu >= count]
    if beyond:
        return {"FAULT": f"{', '.join(beyond)}: profile {settings.simulate} has GPUs 0-{count - 1}"}
    return {}


def otlp_problems(settings: Settings) -> dict[str, str]:
    return settings.otel_problems("otlp" in settings.exporter_type)


def cross_checks(settings: Settings) -> dict[str, str]:
    """Every problem found, by variable name (empty: the settings can work)."""
    problems: dict[str, str] = {}
    checks = (exporter_problems, http_problems, otlp_problems, server_problems, simulation_problems)
    for check in checks:
        problems.update(check(settings))
    return problems


def unused_settings(settings: Settings) -> list[str]:
    """gpuid settings set here that this agent ignores (names of the variables)."""
    return [_env(f) for f in UNUSED_GPUID_SETTINGS if getattr(settings, f)]
