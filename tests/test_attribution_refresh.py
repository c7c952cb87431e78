"""Attribution is recomputed only when one of its inputs moved (the kubelet's answer, the GPUs),
not on every publish: the kubelet's own pod-resources server (Go, `real_kubelet`) answering the
same pods again leaves the attribution and the allocatable GPU count as they were. No stand-in."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry

from gpuid_agent.runtime.metrics import AttributionMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kubelet import PodResourcesClient, PodResourcesSource
from gpuid_agent.state.attribution.service import Attributor
from tests.fakekubelet import pod
from tests.realkube.kubelet import KubeletServer
from tests.test_dra_claims import UUIDS, inventory

RESOURCE = "nvidia.com/gpu"


async def test_attribution_moves_only_with_its_inputs(real_kubelet: KubeletServer) -> None:
    real_kubelet.pods = [pod("ml", "train", "c", RESOURCE, UUIDS[0])]
    real_kubelet.allocatable = ((RESOURCE, tuple(UUIDS[:3])),)
    real_kubelet.publish()
    source = PodResourcesSource(
        PodResourcesClient(real_kubelet.socket_path, timeout=1.0),
        interval=0.02,
        stale_after=30.0,
        board=StatusBoard(),
        metrics=AttributionMetrics(CollectorRegistry()),
    )
    attributor = Attributor(source)
    try:
        assert await source.poll_once()
        first = attributor.refresh(inventory())
        assert [(a.holder.pod, a.gpu_uuid) for a in first.allocations] == [("train", UUIDS[0])]
        assert attributor.allocatable_gpus(inventory()) == 3
        snapshot = source.current()
        # the same answer again, and the GPUs read again (a new read time): nothing to redo
        assert await source.poll_once()
        assert source.current() is snapshot
        assert attributor.refresh(inventory()) is first
        # the kubelet's answer moved
        real_kubelet.pods = [pod("ml", "train", "c", RESOURCE, UUIDS[1])]
        real_kubelet.publish()
        assert await source.poll_once()
        second = attributor.refresh(inventory())
        assert [a.gpu_uuid for a in second.allocations] == [UUIDS[1]]
        # the GPUs moved: GPU 1 gone from NVML, its device id no longer maps
        fewer = inventory()
        fewer = replace(fewer, gpus=tuple(g for g in fewer.gpus if g.uuid != UUIDS[1]))
        third = attributor.refresh(fewer)
        assert third.allocations == () and len(third.unmapped) == 1
        assert attributor.refresh(fewer) is third
    finally:
        await source.client.close()
