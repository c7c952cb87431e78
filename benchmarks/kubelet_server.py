"""A kubelet pod-resources server in a process of its own, as on a real node (a simulated node's
own kubelet runs inside the agent, its CPU counted as the agent's):
`python -m benchmarks.kubelet_server SOCKET NODE PODS` serves PODS pods time-sharing the 8 GPUs
of the simulated h100x8 node NODE (PODS 0: the pods the simulated node itself serves) until
terminated."""

from __future__ import annotations

import asyncio
import signal
import sys

from gpuid_agent.simulate.kubelet import FakeKubelet
from gpuid_agent.simulate.pods import KubeletPod, pod, simulated_pods
from gpuid_agent.simulate.profiles import PROFILES

RESOURCE = "nvidia.com/gpu"


def shared_pods(
    node: str, count: int
) -> tuple[list[KubeletPod], tuple[tuple[str, tuple[str, ...]], ...]]:
    """`count` pods, each holding one replica of a time-sliced GPU, spread over the GPUs."""
    gpus = PROFILES["h100x8"](node)
    per_gpu = count // len(gpus)
    pods = [
        pod(f"team-{r % 4}", f"job-{i}-{r}", "main", RESOURCE, f"{gpu.uuid}::{r}")
        for i, gpu in enumerate(gpus)
        for r in range(per_gpu)
    ]
    allocatable = tuple(
        (RESOURCE, tuple(f"{gpu.uuid}::{r}" for r in range(per_gpu))) for gpu in gpus
    )
    return pods, allocatable


async def _serve(socket_path: str, node: str, count: int) -> None:
    served = shared_pods(node, count) if count else simulated_pods(PROFILES["h100x8"](node))
    kubelet = FakeKubelet(socket_path, *served)
    await kubelet.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("serving", flush=True)
    await stop.wait()
    await kubelet.stop()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
