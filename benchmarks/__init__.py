"""Benchmarks (`nox -s bench`): each `bench_*.py` module has `async def run() -> list[Row]`."""
