"""Operators' requests to clear a GPU's latched health state, as files in STATE_DIR.

`gpuid-agent health clear <uuid|index>`, run inside the agent's pod (`kubectl exec`, so
Kubernetes RBAC on pods/exec decides who may), drops one small JSON file into
STATE_DIR/health-clear/; the running agent takes each at its next collection and removes it.
A request that does not read back is renamed `*.rejected` and logged, and changes nothing; one
of a newer format (`runtime.formats`) is left where it is for the version that wrote it, logged
once. Kept this low so the command starts without loading the agent.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

import orjson

from gpuid_agent.runtime import formats, log
from gpuid_agent.runtime.errors import NewerFormatError, RefusedFileError
from gpuid_agent.runtime.regular_file import read_regular_file

_log = log.get("health.state")
CLEAR_DIR = "health-clear"
SELECTOR_LIMIT = 128
REQUEST_LIMIT = 4096  # a request is a few dozen bytes; anything larger is not one


def write_clear_request(state_dir: str, gpu: str) -> Path:
    """Drop a request to clear `gpu`'s latched state where the running agent will take it
    (written beside and renamed, so the agent never reads half a request)."""
    if not 0 < len(gpu) <= SELECTOR_LIMIT or not gpu.isprintable():
        raise ValueError(f"not a GPU UUID or index: {gpu!r}")
    directory = Path(state_dir) / CLEAR_DIR
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".request.", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(
            orjson.dumps(formats.stamped(formats.CLEAR_REQUEST, {"gpu": gpu, "pid": os.getpid()}))
        )
    path = directory / f"{uuid.uuid4().hex}.json"
    os.replace(tmp, path)
    return path


def take_clear_requests(directory: Path, kept: set[str]) -> list[str]:
    """The GPU selectors (UUID or index) of the pending requests, oldest first; each request
    file is removed once read. A request of a newer format stays, its name added to `kept`
    (those already there are not logged again)."""
    try:
        files = sorted(
            (p for p in directory.iterdir() if p.suffix == ".json"),
            key=lambda p: (p.stat().st_mtime_ns, p.name),
        )
    except OSError:
        return []
    selectors = []
    for path in files:
        try:
            doc = orjson.loads(read_regular_file(path, REQUEST_LIMIT))
            formats.readable_format(formats.CLEAR_REQUEST, doc)
            gpu = doc.get("gpu")
            if not isinstance(gpu, str) or not 0 < len(gpu) <= SELECTOR_LIMIT:
                raise ValueError("no GPU named")
            path.unlink()
        except NewerFormatError as exc:
            if path.name not in kept:
                kept.add(path.name)
                _log.warning(
                    "health clear request kept for a newer version",
                    extra={"path": str(path), "error": str(exc)},
                )
            continue
        except (OSError, RefusedFileError, orjson.JSONDecodeError, ValueError) as exc:
            _log.warning(
                "rejected health clear request", extra={"path": str(path), "error": str(exc)}
            )
            with contextlib.suppress(OSError):
                path.rename(path.with_suffix(".rejected"))
            continue
        selectors.append(gpu)
    return selectors
