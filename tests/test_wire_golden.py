"""Every exporter's wire output is pinned byte for byte: what stdout prints, the HTTP and OTLP
request bodies and headers a real receiver gets, PostgreSQL's COPY text, each S3 object's key,
body and metadata, and the disk spool's file. `tests/data/wire_golden/` was written by this
module from the exporters as they were before records travelled typed through delivery; a
change of code may change how records get there, never what arrives.

Inputs (`records.json`) are wire dicts of every kind with hostile values (tabs, newlines,
backslashes, NUL, non-BMP text, absent optionals, DRA claims, an unseen end, holders).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import sys
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.exporters.otlp.exporter import OtlpExporter
from gpuid_agent.delivery.exporters.postgres import PostgresExporter
from gpuid_agent.delivery.exporters.s3.exporter import S3Exporter
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.serialize import from_wire
from gpuid_agent.records.types import AnyRecord
from tests import golden_manifest

GOLDEN = Path(__file__).parent / "data" / "wire_golden"
META = BatchMeta("0123456789abcdef0123456789abcdef", datetime(2025, 3, 1, 23, 59, 59, tzinfo=UTC))
# Headers that name the batch and its content: the rest (Date, Host, User-Agent…) are not ours.
PINNED_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Idempotency-Key",
    "X-Records-Count",
    "X-Batch-Created",
    "Authorization",
)


def wire_inputs() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = orjson.loads((GOLDEN / "records.json").read_bytes())
    return records


def exported(wire: Sequence[dict[str, Any]]) -> list[AnyRecord]:
    """The records as delivery hands them to an exporter: typed, read back from the wire."""
    return [from_wire(w) for w in wire]


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")


class Capture:
    """A real HTTP server that keeps each request's decoded body and pinned headers."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp undoes Content-Encoding: gzip
        headers = {k: request.headers[k] for k in PINNED_HEADERS if k in request.headers}
        self.requests.append({"path": request.path, "headers": headers, "body": body})
        if request.path.endswith("/v1/logs"):
            return web.Response(body=b"", content_type="application/x-protobuf")
        return web.Response(text="ok")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def capture() -> AsyncIterator[Capture]:
    server = Capture()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _request_form(request: dict[str, Any]) -> dict[str, Any]:
    return {"path": request["path"], "headers": request["headers"]}


async def current_outputs(capture: Capture, spool_dir: Path) -> dict[str, bytes]:
    """Every exporter's output for the pinned inputs, by golden file name."""
    batch = exported(wire_inputs())
    out: dict[str, bytes] = {}

    stream = io.BytesIO()
    await StdoutExporter(stream).export(batch, META)
    out["stdout.ndjson"] = stream.getvalue()

    for gzip_body in (False, True):
        http = HttpExporter(f"{capture.url}/ingest", token="t0ken", gzip_body=gzip_body)
        try:
            await http.export(batch, META)
        finally:
            await http.close()
        request = capture.requests.pop()
        suffix = "gzip" if gzip_body else "plain"
        out[f"http-{suffix}.json"] = request["body"]
        out[f"http-{suffix}.headers.json"] = orjson.dumps(
            _request_form(request), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
        )

    for compression in ("none", "gzip"):
        otlp = OtlpExporter(
            f"{capture.url}/v1/logs",
            headers={"x-tenant": "a"},
            compression=compression,
            resource_attributes={"k8s.cluster.name": "c1", "service.name": "gpuid-agent"},
        )
        try:
            await otlp.export(batch, META)
        finally:
            await otlp.close()
        request = capture.requests.pop()
        out[f"otlp-{compression}.pb"] = request["body"]
        out[f"otlp-{compression}.headers.json"] = orjson.dumps(
            _request_form(request), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
        )

    form = PostgresExporter.stored_form
    assert form is not None
    out["postgres.pgcopy"] = form.encode(batch)

    for fmt, header, gz in (("csv", False, False), ("csv", True, False), ("ndjson", False, True)):
        s3 = S3Exporter("bucket", prefix="gp/id", fmt=fmt, csv_header=header, gzip_objects=gz)
        listing = []
        for obj in s3.objects(batch, META):
            body = gzip.decompress(obj.body) if gz else obj.body
            listing.append(
                {
                    "key": obj.key,
                    "content_type": obj.content_type,
                    "metadata": obj.metadata,
                    "body": _text(body),
                }
            )
        name = f"s3-{fmt}{'-header' if header else ''}{'-gzip' if gz else ''}.json"
        out[name] = orjson.dumps(listing, option=orjson.OPT_INDENT_2)

    for exporter_form, label in ((None, "ndjson"), (form, "pgcopy")):
        directory = spool_dir / label
        spool = DiskSpool(directory, 1 << 24, form=exporter_form)
        assert await spool.add(batch) == []
        stored = spool.oldest()
        assert stored is not None and stored.path is not None
        out[f"spool-{label}.bin"] = stored.path.read_bytes()
        await spool.settle()
    return out


async def test_every_exporter_writes_what_it_wrote_before(capture: Capture, tmp_path: Path) -> None:
    outputs = await current_outputs(capture, tmp_path)
    pinned = {p.name for p in GOLDEN.iterdir() if p.name != "records.json"}
    assert set(outputs) == pinned
    for name, data in sorted(outputs.items()):
        assert data == (GOLDEN / name).read_bytes(), name


def test_inputs_cover_every_record_kind() -> None:
    kinds = {r["kind"] for r in wire_inputs()}
    assert kinds == {"reading", "allocation", "health", "hardware"}


async def _regenerate(target: Path) -> None:  # only when the wire format is meant to change
    import tempfile

    server = Capture()
    await server.start()
    try:
        with tempfile.TemporaryDirectory() as spool_dir:
            for name, data in (await current_outputs(server, Path(spool_dir))).items():
                (target / name).write_bytes(data)
    finally:
        await server.stop()


def test_golden_files_match_their_manifest() -> None:
    """Rewriting a golden file (running a module as a script) shows here, not only in review;
    tests/golden_manifest.py says how a meant change of the wire format updates the manifest."""
    assert golden_manifest.digests() == golden_manifest.recorded()


if __name__ == "__main__":
    asyncio.run(_regenerate(GOLDEN))
    golden_manifest.after_regenerating(sys.argv[1:])
