"""Watches that bring nothing usable: a server that answers every watch with the whole list
(it ignores `watch=true`), with garbage, or ends it at once. Each such watch is retried after
the exponential backoff (capped by `backoff_max`, reset by the next good event), the malformed
data is counted, and each reason is logged once a minute, not once per watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.retry import Backoff
from gpuid_agent.sources.kube import list_watch
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.sources.kube.list_watch import MALFORMED_LOG_EVERY, MalformedLog
from gpuid_agent.sources.kube.pods import PodCache
from gpuid_agent.sources.kube.resourceslices import ResourceSliceCache
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.waiting import eventually

NODE = "node-a"
PODS = "/api/v1/pods"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
BASE = 0.01  # the first backoff ceiling here; the agent's is 1 s
CAP = 0.05  # the caches' backoff_max here
BAD_WATCHES = 6


class _Ceiling(random.Random):
    """Full jitter drawing its ceiling every time: the delays are the backoff's bounds."""

    def uniform(self, a: float, b: float) -> float:
        return b


class RecordedBackoff(Backoff):
    """The loop's Backoff with a small base and no randomness, keeping every delay drawn."""

    def __init__(self, cap: float) -> None:
        super().__init__(base=BASE, cap=cap, rand=_Ceiling())
        self.delays: list[float] = []

    def next(self, floor: float | None = None) -> float:
        delay = super().next(floor)
        self.delays.append(delay)
        return delay


def expected_delays(count: int) -> list[float]:
    return [min(CAP, BASE * 2**i) for i in range(count)]


@pytest.fixture
def backoffs(monkeypatch: pytest.MonkeyPatch) -> list[RecordedBackoff]:
    """The Backoffs the list+watch loops make from now on."""
    made: list[RecordedBackoff] = []

    def recorded(base: float, cap: float) -> RecordedBackoff:
        made.append(RecordedBackoff(cap))
        return made[-1]

    monkeypatch.setattr(list_watch, "Backoff", recorded)
    return made


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(token="t0ken", resource_versions=("v1",)) as server:
        yield server


@pytest.fixture
async def client(kube: FakeKube, tmp_path: Path) -> AsyncIterator[KubeClient]:
    path = write_kubeconfig(tmp_path / "kubeconfig", kube.url, token="t0ken")
    made = await create_kube_client("auto", environ={"KUBECONFIG": str(path)})
    assert made is not None
    yield made
    await made.close()


@contextlib.asynccontextmanager
async def running(run: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """The cache's loop in a task, checked alive at the end, then stopped."""
    task = asyncio.create_task(run())
    yield
    assert not task.done(), "the loop ended"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def warnings(caplog: pytest.LogCaptureFixture, what: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "what", None) == what]


FAULTS: dict[str, dict[str, Any]] = {
    "list": {"as_list": True},  # 200 with the PodList: `watch=true` ignored
    "garbage": {"body": b"this is not json\n"},
    "no object": {"body": json.dumps({"type": "ADDED"}).encode() + b"\n"},
    "ended at once": {"body": b""},
}
REASONS = {
    "list": "pod watch answered with a list (watch=true ignored)",
    "garbage": "pod watch line is not JSON",
    "no object": "pod watch event without an object",
    "ended at once": None,
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_watch_of_only_malformed_data_backs_off_and_logs_once(
    kube: FakeKube,
    client: KubeClient,
    backoffs: list[RecordedBackoff],
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuid_agent")
    kube.create(objects.pod("first", node_name=NODE))
    cache = PodCache(NODE, backoff_max=CAP, watch_timeout=30)
    assert cache.open(client)
    bad = kube.inject(verb="watch", path=PODS, times=BAD_WATCHES, **FAULTS[fault])
    async with running(cache.run):
        # every bad watch, then the good one after them
        await eventually(lambda: kube.count("watch", path=PODS, status=200) > BAD_WATCHES)
        assert bad.hits == BAD_WATCHES
        (backoff,) = backoffs
        assert backoff.delays == expected_delays(BAD_WATCHES)  # doubling, capped
        malformed = cache.registry.get_sample_value("gpuid_pod_cache_malformed_total")
        reason = REASONS[fault]
        assert malformed == (0 if reason is None else BAD_WATCHES)
        if reason is not None:
            assert len(warnings(caplog, reason)) == 1, [r.__dict__ for r in caplog.records]

        # a good event resets the backoff: the next bad watches start from its base again
        kube.create(objects.pod("second", node_name=NODE))
        await eventually(lambda: cache.lookup("default", "second"))
        assert backoff.failures == 0
        again = kube.inject(verb="watch", path=PODS, times=2, **FAULTS[fault])
        kube.close_watches()
        await eventually(lambda: again.hits == 2 and len(backoff.delays) == BAD_WATCHES + 2)
        assert backoff.delays[BAD_WATCHES:] == expected_delays(2)
        if reason is not None:
            assert len(warnings(caplog, reason)) == 1  # still within the minute
        assert cache.lookup("default", "first") is not None


async def test_resourceslices_answered_with_a_list_back_off_and_log_once(
    kube: FakeKube,
    client: KubeClient,
    backoffs: list[RecordedBackoff],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuid_agent")
    device = objects.gpu_device("gpu-0", "GPU-00000000-0000-4000-8000-000000000000")
    kube.create(objects.resource_slice(f"{NODE}-gpu", NODE, [device], version="v1"))
    metrics = AttributionMetrics(CollectorRegistry())
    cache = ResourceSliceCache(NODE, backoff_max=CAP, watch_timeout=30, metrics=metrics)
    assert cache.open(client)
    kube.inject(verb="watch", path=SLICES, as_list=True, times=BAD_WATCHES)
    async with running(cache.run):
        await eventually(lambda: kube.count("watch", path=SLICES, status=200) > BAD_WATCHES)
        (backoff,) = backoffs
        assert backoff.delays == expected_delays(BAD_WATCHES)
        assert cache.status()["malformed"] == BAD_WATCHES
        malformed = metrics.registry.get_sample_value("gpuid_resource_slices_malformed_total")
        assert malformed == BAD_WATCHES
        reason = "resourceslice watch answered with a list (watch=true ignored)"
        assert len(warnings(caplog, reason)) == 1
        assert cache.available and [d.name for d in cache.devices()] == ["gpu-0"]


def test_each_reason_is_logged_at_most_once_a_minute_with_the_count_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuid_agent")
    now = [100.0]
    report = MalformedLog(logging.getLogger("gpuid_agent.test"), "pod", clock=lambda: now[0])
    for _ in range(5):
        report("a")
        now[0] += 1.0
    report("b")  # another reason has its own minute
    now[0] = 100.0 + MALFORMED_LOG_EVERY
    report("a")
    report("a")
    records = caplog.records
    lines = [(r.getMessage(), r.__dict__["what"], r.__dict__.get("suppressed")) for r in records]
    assert lines == [
        ("malformed pod data skipped", "a", None),
        ("malformed pod data skipped", "b", None),
        ("malformed pod data skipped", "a", 4),
    ]
