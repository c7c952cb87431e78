"""The history page in a real browser: a rack's month (18 nodes, 72 GPUs, 30 days, generated
in the real PostgreSQL) written by `gpuid-agent history node … --html`, opened in headless
Chromium. It renders (its script ran to the end), fetches nothing, shows one row per GPU
serial of each node and one bar per allocation of the data set, and its screenshot is kept:
`.artifacts/history/rack-72-gpus-30-days.png` (`GPUID_TEST_ARTIFACTS` moves `.artifacts`)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.postgres.schema import Tables
from tests.history_fleet import RACK, START, Fleet, create, node_name
from tests.servers import chromium
from tests.servers.postgres import PostgresCluster

ARTIFACTS = Path(os.environ.get("GPUID_TEST_ARTIFACTS", Path(__file__).parents[1] / ".artifacts"))
SCREENSHOT = ARTIFACTS / "history" / "rack-72-gpus-30-days.png"
FLEET = Fleet(nodes=RACK, days=30)
NODES = [node_name(n) for n in range(RACK)]


@pytest.fixture(scope="module")
def browser() -> None:
    reason = chromium.unavailable()
    if reason:
        pytest.skip(f"the page is checked in Debian's chromium: {reason}")


@pytest.fixture(scope="module")
def rack(postgres_server: PostgresCluster) -> dict[str, Any]:
    """The fleet's first rack in PostgreSQL, and what the page must show of it."""
    schema = f"r_{uuid.uuid4().hex[:12]}"
    tables = Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")

    async def build() -> dict[str, Any]:
        await create(postgres_server, tables, FLEET)
        kwargs: Any = postgres_server.connect_kwargs()
        conn = await asyncpg.connect(**kwargs)
        try:
            gpus = await conn.fetchval(
                f"SELECT count(DISTINCT (node, gpu)) FROM {tables.readings} WHERE node = ANY($1)",
                NODES,
            )
            allocations = await conn.fetchval(
                f"SELECT count(*) FROM {tables.allocations} WHERE node = ANY($1)", NODES
            )
            return {"gpus": gpus, "allocations": allocations}
        finally:
            await conn.close()

    expected = asyncio.run(build())
    env = postgres_server.env() | {"POSTGRES_TABLE": tables.readings}
    return {"env": env, **expected}


def test_a_racks_month_in_chromium(
    browser: None, rack: dict[str, Any], subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    page = tmp_path / "rack.html"
    done = subprocess.run(
        [sys.executable, "-m", "gpuid_agent", "history", "node", *NODES,
         "--since", START.date().isoformat(), "--until", FLEET.end.date().isoformat(),
         "--html", str(page)],
        env=subprocess_env | rack["env"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    # self-contained: nothing to fetch (the SVG namespace is a name, not a request)
    assert not re.search(r"<link|\bsrc=|url\(|@import", html)
    assert set(re.findall(r"https?://[^\s\"']+", html)) <= {"http://www.w3.org/2000/svg"}
    assert rack["gpus"] == 74  # 72 GPUs and the two serials the replacements brought

    shown = chromium.dom(page)
    assert re.search(r'<body[^>]*data-ready="1"', shown), "the page's script did not finish"
    assert len(re.findall(r'<g class="gpu-row"', shown)) == rack["gpus"]
    assert len(re.findall(r'<rect class="alloc', shown)) == rack["allocations"]
    assert len(re.findall(r'<g class="group"', shown)) == RACK
    assert len(re.findall(r"<polygon class=\"mark xid\"", shown)) > 0
    # hovering shows the exact times and the pod: each bar carries them as its title
    first = re.search(r'<rect class="alloc[^>]*><title>([^<]*)</title>', shown)
    assert first is not None and "job-" in first.group(1) and "from 2025-03-" in first.group(1)

    chromium.screenshot(page, SCREENSHOT)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
