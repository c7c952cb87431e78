"""Counters the alerts use exist at 0 from the agent's start, for every label value the code
can give them: `increase()` cannot see the first event of a series that appears with it.
"""

from __future__ import annotations

import ast
import io
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.node.labels.policy import REASONS
from gpuid_agent.runtime.metrics import COLLECTION_ERROR_REASONS, DROP_REASONS
from tests.conftest import running_agent, settings
from tests.waiting import eventually

PACKAGE = Path(__file__).resolve().parent.parent / "gpuid_agent"


def _calls(directory: Path) -> Iterator[ast.AST]:
    for path in sorted(directory.rglob("*.py")):
        yield from ast.walk(ast.parse(path.read_text(), str(path)))


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _const(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _owner(func: ast.expr) -> str:
    """`x.dropped_records.labels` → dropped_records."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
        return func.value.attr
    return ""


def drop_reasons_in_code() -> set[str]:
    found: set[str] = set()
    for node in _calls(PACKAGE / "delivery"):
        if isinstance(node, ast.Call):
            name, args = _name(node.func), node.args
            if name == "count_dropped" and len(args) > 1:
                found.add(_const(args[1]) or "?")
            elif name == "trim_memory" and len(args) > 4:
                found.add(_const(args[4]) or "?")
            elif name == "labels" and _owner(node.func) == "dropped_records":
                found.add(_const(args[1]) or "?")
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "dropped_for" for t in node.targets
        ):
            found.add(_const(node.value) or "?")
        elif (
            isinstance(node, ast.BoolOp)
            and isinstance(node.values[0], ast.Attribute)
            and node.values[0].attr == "dropped_for"
        ):
            found.add(_const(node.values[1]) or "?")
    found.discard("?")  # passed through from a caller, whose literal is found on its own
    return found


def test_every_drop_reason_in_the_code_starts_at_zero() -> None:
    found = drop_reasons_in_code()
    assert {"rejected", "shutdown", "intake_full", "spool_full"} <= found, found
    assert found <= set(DROP_REASONS), found - set(DROP_REASONS)


def test_every_collection_error_reason_in_the_code_starts_at_zero() -> None:
    found: set[str] = set()
    for node in _calls(PACKAGE / "state"):
        if not isinstance(node, ast.Call):
            continue
        if _name(node.func) == "labels" and _owner(node.func) == "collection_errors":
            found.add(_const(node.args[0]) or "?")
        elif _name(node.func) == "_nvml_down" and len(node.args) > 1:
            stage = node.args[1]
            branches = [stage.body, stage.orelse] if isinstance(stage, ast.IfExp) else [stage]
            found.update(_const(b) or "?" for b in branches)
    found.discard("?")
    assert {"gpu_lost", "field", "init", "read", "stalled"} <= found
    assert found <= set(COLLECTION_ERROR_REASONS), found - set(COLLECTION_ERROR_REASONS)


def test_every_label_failure_reason_starts_at_zero() -> None:
    found = set()
    for node in _calls(PACKAGE / "node" / "labels"):
        if isinstance(node, ast.Call) and _name(node.func) == "Failure" and node.args:
            found.add(_const(node.args[0]) or "?")
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
            first, second = (_const(e) for e in node.elts)
            if second in ("now", "backoff", "resync") and first:
                found.add(first)  # the by-status table
    found.discard("?")
    assert {"forbidden", "conflict", "timeout", "connection"} <= found
    assert found <= set(REASONS), found - set(REASONS)


async def test_alert_counters_are_at_zero_on_a_fresh_agent() -> None:
    out = io.BytesIO()
    agent = Agent(settings(simulate="h100x8"), exporters=[StdoutExporter(out)])
    async with running_agent(agent) as running, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.bound_port}/metrics"

        async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            async with http.get(url) as resp:
                text = await resp.text()
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
            }

        samples = await scrape()
        for reason in DROP_REASONS:
            key = ("gpuid_dropped_records_total", (("exporter", "stdout"), ("reason", reason)))
            assert samples.get(key) == 0, key
        for name in ("gpuid_export_success_total", "gpuid_export_set_aside_batches_total"):
            assert (name, (("exporter", "stdout"),)) in samples, name
        for reason in COLLECTION_ERROR_REASONS:
            assert ("gpuid_collection_errors_total", (("reason", reason),)) in samples, reason

        async def gpus_counted() -> bool:  # after the first collection
            return (await scrape()).get(("gpuid_gpus", ())) == 8

        await eventually(gpus_counted)
        samples = await scrape()
        assert samples[("gpuid_gpus", ())] == 8
        assert samples[("gpuid_gpu_count", ())] == 8, "the deprecated alias still served"
        assert samples[("gpuid_collection_errors_total", (("reason", "gpu_lost"),))] == 0
