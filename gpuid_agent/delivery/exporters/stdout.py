"""JSON lines on stdout, one record a line (logs go to stderr)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import BinaryIO

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter
from gpuid_agent.records.serialize import json_lines
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError


class StdoutExporter(Exporter):
    name = "stdout"

    def __init__(self, stream: BinaryIO | None = None) -> None:
        self._stream = stream or sys.stdout.buffer

    def _write(self, payload: bytes) -> None:
        self._stream.write(payload)
        self._stream.flush()

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        payload = json_lines(batch)
        try:
            # A write to a pipe blocks when its reader is slow: keep it off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, self._write, payload)
        except OSError as exc:
            raise ExportError(f"stdout write failed: {exc}", error_type="io") from exc
