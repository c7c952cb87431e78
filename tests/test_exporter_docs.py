"""The SQL recipes of docs/exporters/postgres.md, run against data the exporter wrote."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import asyncpg

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from tests.exporter_support import BASE_TIME, allocation, readings
from tests.servers.postgres import PostgresCluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "exporters" / "postgres.md"
RECIPE = re.compile(r"<!-- recipe: ([a-z0-9-]+) -->\s*```sql\n(.*?)```", re.S)


def recipes() -> dict[str, str]:
    found = dict(RECIPE.findall(DOC.read_text()))
    assert found, "no recipes found in the doc"
    return found


async def test_doc_recipes_run_and_answer(postgres: PostgresCluster, pg_schema: str) -> None:
    day2 = BASE_TIME + timedelta(days=1)
    exporter = PostgresExporter(
        **postgres.connect_kwargs(),  # type: ignore[arg-type]
        sslmode="disable",
        tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
    )
    try:
        # SN-MOVE: machine m1 in cluster c1 on day 1, machine m2 in cluster c2 on day 2.
        await exporter.export(
            readings(2, cluster="c1", machine="m1", serials=["SN-MOVE", "SN-STAY"])
            + readings(
                1, cluster="c1", machine="m1", serials=["SN-STAY"], node="n1", read_time=day2
            )
            + readings(
                1, cluster="c2", machine="m2", serials=["SN-MOVE"], node="n9", read_time=day2
            )
        )
        await exporter.export(
            [
                allocation(pod="a", namespace="ml", uuid="GPU-n1-0"),
                allocation(pod="b", namespace="ml", uuid="GPU-n1-1"),
                allocation(pod="c", namespace="infer", uuid="GPU-n1-2"),
                allocation(pod="d", namespace="ml", uuid="GPU-n1-3"),
                allocation(pod="d", namespace="ml", uuid="GPU-n1-3", ended_at=day2),
            ]
        )
    finally:
        await exporter.close()

    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        await conn.execute(f"SET search_path TO {pg_schema}")
        answers = {name: await conn.fetch(sql) for name, sql in recipes().items()}
    finally:
        await conn.close()

    assert set(answers) == {
        "gpus-on-several-machines",
        "gpus-that-moved-clusters",
        "gpus-per-day",
        "current-allocations-by-namespace",
    }
    (moved,) = answers["gpus-on-several-machines"]
    assert (moved["serial"], moved["machines"], moved["machine_ids"]) == (
        "SN-MOVE",
        2,
        ["m1", "m2"],
    )
    (clusters,) = answers["gpus-that-moved-clusters"]
    assert (clusters["serial"], clusters["clusters"]) == ("SN-MOVE", "c1 -> c2")
    per_day = [(r["day"], r["cluster"], r["serials"], r["gpus"]) for r in answers["gpus-per-day"]]
    assert per_day == [
        (BASE_TIME.replace(hour=0), "c1", 2, 2),
        (day2.replace(hour=0), "c1", 1, 1),
        (day2.replace(hour=0), "c2", 1, 1),
    ]
    by_namespace = [
        (r["namespace"], r["allocations"], r["pods"])
        for r in answers["current-allocations-by-namespace"]
    ]
    assert by_namespace == [("ml", 2, ["a", "b"]), ("infer", 1, ["c"])]
