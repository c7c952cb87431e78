"""A DRA allocation first joined through the node-local fallback, then through the slices once
the driver publishes them: the allocation stays one allocation (no second start), its start
record keeps the source it was started with, and /gpu/metrics and /status show the current
source. On the real kube-apiserver (this node's ResourceSlice created while the agent watches,
read with its pod-bound token under the chart's RBAC) and the kubelet's own pod-resources
server (`real_kubelet`); no stand-in."""

from __future__ import annotations

import io

import orjson

from tests.conftest import running_agent, serves
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.test_dra_agent import (
    DraNode,
    claim_rows,
    dra_node,  # noqa: F401  (fixture)
    get,
    kubelet_pods,
    make_agent,
    node_slice,
    nvml_config,
)
from tests.waiting import eventually


async def test_the_source_moves_on_while_the_start_record_stays(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    dra_node: DraNode,  # noqa: F811
) -> None:
    config = nvml_config()
    fake_nvml.apply(config)
    real_kubelet.pods = kubelet_pods(dra_node.node)
    real_kubelet.publish()
    out = io.BytesIO()
    agent = make_agent(fake_nvml, real_kubelet, out, node_name=dra_node.node, kube_api="auto")
    async with running_agent(agent):
        # the driver has published no slice yet: whole GPUs through the fallback
        await eventually(lambda: out.getvalue().count(b'"claim_source":"dra-fallback"') == 3)
        fallback = claim_rows(await get(agent, "/gpu/metrics"))
        assert {row[-1] for row in fallback} == {"dra-fallback"}

        dra_node.publish(node_slice(config, dra_node.node))
        await eventually(lambda: serves(agent, b'claim_name="big-mig"'))
        text = await get(agent, "/gpu/metrics")
        assert claim_rows(text) == {
            ("train-0", "", "train-gpu", "gpu-1", "dra"),
            ("serve-a", "", "shared-gpu", "gpu-2", "dra"),
            ("serve-b", "", "shared-gpu", "gpu-2", "dra"),
            ("big", "2", "big-mig", "gpu-0-mig-9-0-4", "dra"),
        }
        dra = orjson.loads(await get(agent, "/status"))["attribution"]["dra"]
        assert dra["fallback"] == 0
        assert {c["source"] for c in dra["claims"]} == {"dra"}
        await eventually(lambda: out.getvalue().count(b'"claim_name":"big-mig"') == 1)

        real_kubelet.pods = [p for p in kubelet_pods(dra_node.node) if p.name != "train-0"]
        real_kubelet.publish()
        await eventually(lambda: out.getvalue().count(b'"event":"end"') == 1)
    records = [orjson.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    allocations = [r for r in records if r.get("kind") == "allocation"]
    starts = {(r["pod"], r["claim_source"]) for r in allocations if r["event"] == "start"}
    # one start per allocation: the three fallback ones were not started again as "dra"
    assert starts == {
        ("train-0", "dra-fallback"),
        ("serve-a", "dra-fallback"),
        ("serve-b", "dra-fallback"),
        ("big", "dra"),
    }
    assert len([r for r in allocations if r["event"] == "start"]) == 4
    [end] = [r for r in allocations if r["event"] == "end"]
    [start] = [r for r in allocations if r["event"] == "start" and r["pod"] == "train-0"]
    # the end closes the same allocation, with the fields it was started with
    assert end["allocation_id"] == start["allocation_id"]
    assert (end["pod"], end["claim_source"], end["uuid"]) == (
        "train-0",
        "dra-fallback",
        config.gpus[1].uuid,
    )
