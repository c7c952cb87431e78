"""Reading the kubelet's List answer: the stdlib decoder (wire.py) against protobuf's own
parser (upb), on the same bytes in the same run, interleaved so that drift in machine load hits
both.

- Decoding alone, and decoding + `snapshot_from` (what a poll whose answer moved costs), at
  8 to 4,096 pods (one time-shared GPU replica each, as benchmarks/kubelet_server.py serves),
  and at 1,024 pods with what a real kubelet adds (NUMA topology, cpu ids, memory).
- The next answer with one pod gone and one new, read by a decoder that read the previous one.
- Memory: what importing each adds to a process that already holds the agent's libraries,
  and what a decoded 1,024-pod answer holds, each in a fresh process (median of 5).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Row, median
from benchmarks.kubelet_server import shared_pods
from gpuid_agent.simulate.kubelet import list_response
from gpuid_agent.simulate.pods import pod
from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.devices import ResourceMatcher
from gpuid_agent.sources.kubelet.source import snapshot_from
from gpuid_agent.sources.kubelet.v1 import api_pb2

NODE = "bench-node"
SIZES = (8, 128, 1024, 4096)
ROUNDS = 40
KUBELET = Path(__file__).resolve().parent.parent / "gpuid_agent" / "sources" / "kubelet"


def answer(pods: int, rich: bool = False) -> tuple[bytes, bytes]:
    """A List answer naming `pods` pods, and the next one: one pod gone, one new."""
    served = shared_pods(NODE, pods)[0]
    first = list_response(served)
    moved = list_response([*served[1:], pod("bench", "new", "c", "nvidia.com/gpu", "GPU-x::0")])
    if rich:
        number = {p.name: i for i, p in enumerate(served)}  # a pod keeps its figures
        for message in (first, moved):
            for p in message.pod_resources:
                i = number.get(p.name, len(served))
                for c in p.containers:
                    c.cpu_ids.extend(range(4 * i, 4 * i + 4))
                    c.memory.add(memory_type="memory", size=2**30).topology.nodes.add(ID=i % 2)
                    for d in c.devices:
                        d.topology.nodes.add(ID=i % 2)
    return first.SerializeToString(), moved.SerializeToString()


def _timed(way: Callable[[], Any], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        way()
    return (time.perf_counter() - started) / reps


def speed_rows(pods: int, rich: bool = False) -> list[Row]:
    data, moved = answer(pods, rich)
    upb = api_pb2.ListPodResourcesResponse.FromString
    matches = ResourceMatcher()
    decoder = wire.ListDecoder()

    def moved_rows() -> None:
        """The next answer, alone and with its snapshot, the decoder having read `data`."""
        for name, parse in (("wire", decoder.parse), ("upb", upb)):
            parse(data)
            started = time.perf_counter()
            parse(moved)
            took[f"{name}, 1 pod changed"].append(time.perf_counter() - started)
            parse(data)
            started = time.perf_counter()
            snapshot_from(parse(moved), matches)
            took[f"{name}, 1 pod changed+snapshot"].append(time.perf_counter() - started)

    ways: dict[str, Callable[[], Any]] = {
        "wire": lambda: wire.parse_list(data),
        "upb": lambda: upb(data),
        "wire+snapshot": lambda: snapshot_from(wire.parse_list(data), matches),
        "upb+snapshot": lambda: snapshot_from(upb(data), matches),
    }
    moved_ways = [f"{d}, 1 pod changed{s}" for d in ("wire", "upb") for s in ("", "+snapshot")]
    took: dict[str, list[float]] = {name: [] for name in [*ways, *moved_ways]}
    reps = max(1, 256 // pods)  # small answers timed in batches, above the clock's grain
    for _ in range(ROUNDS):
        for name, way in ways.items():
            took[name].append(_timed(way, reps))
        moved_rows()
    us = {name: median(values) * 1e6 for name, values in took.items()}
    what = f"List, {pods:,} pods{' + topology, cpus, memory' if rich else ''}"
    note = f"{len(data) / 1024:,.1f} KiB answer, median of {ROUNDS}"
    return [
        Row("kubelet decode", f"{what}: wire.py", us["wire"], "µs", note),
        Row("kubelet decode", f"{what}: upb", us["upb"], "µs", note),
        Row("kubelet decode", f"{what}: wire.py / upb", us["wire"] / us["upb"], "x", ""),
        Row("kubelet decode", f"{what} + snapshot_from: wire.py", us["wire+snapshot"], "µs", ""),
        Row("kubelet decode", f"{what} + snapshot_from: upb", us["upb+snapshot"], "µs", ""),
        Row(
            "kubelet decode",
            f"{what}, 1 pod changed: wire.ListDecoder",
            us["wire, 1 pod changed"],
            "µs",
            "the pods of the previous answer reused",
        ),
        Row("kubelet decode", f"{what}, 1 pod changed: upb", us["upb, 1 pod changed"], "µs", ""),
        Row(
            "kubelet decode",
            f"{what}, 1 pod changed + snapshot_from: wire.ListDecoder",
            us["wire, 1 pod changed+snapshot"],
            "µs",
            "",
        ),
        Row(
            "kubelet decode",
            f"{what}, 1 pod changed + snapshot_from: upb",
            us["upb, 1 pod changed+snapshot"],
            "µs",
            "",
        ),
    ]


# Steps run in a fresh process holding the agent's libraries; each prints the RSS it added.
_MEMORY = """
import gc, importlib.util, sys
def rss():
    gc.collect()
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
import aiohttp, h2.connection, orjson, prometheus_client, pydantic, yaml
import gpuid_agent.runtime.errors
def load(path):  # one module of the kubelet package, without the package's other modules
    name = path.replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, sys.argv[1] + "/" + path + ".py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
data = open(sys.argv[2], "rb").read()
last = rss()
for step in {steps!r}:
    exec(step)
    now = rss()
    print(now - last)
    last = now
"""
_RUNTIME = (
    "from google.protobuf import descriptor, descriptor_pool, runtime_version, symbol_database\n"
    "from google.protobuf.internal import builder"
)
_HOLD = "held = [{parse}(bytes(data)) for _ in range(8)]"  # 8 answers: above RSS noise
_MEMORY_STEPS = {
    "wire.py": ["wire = load('wire')", _HOLD.format(parse="wire.parse_list")],
    "upb": [
        _RUNTIME,
        "api_pb2 = load('v1/api_pb2')",
        _HOLD.format(parse="api_pb2.ListPodResourcesResponse.FromString"),
    ],
}


def memory_rows(pods: int = 1024) -> list[Row]:
    with tempfile.NamedTemporaryFile(prefix="bench-list-", dir="/tmp") as file:
        file.write(answer(pods)[0])
        file.flush()
        added: dict[str, list[list[float]]] = {}
        for _ in range(5):
            for name, steps in _MEMORY_STEPS.items():
                script = _MEMORY.format(steps=steps)
                out = subprocess.run(
                    [sys.executable, "-c", script, str(KUBELET), file.name],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                added.setdefault(name, []).append([float(v) for v in out.split()])
    mib = {
        name: [statistics.median(step) for step in zip(*runs, strict=True)]
        for name, runs in added.items()
    }
    held = f"{pods:,}-pod answer decoded and held, per answer"
    return [
        Row("kubelet decode", "import wire.py", mib["wire.py"][0], "MiB", "RSS added, median of 5"),
        Row("kubelet decode", f"{held}: wire.py", mib["wire.py"][1] / 8, "MiB", ""),
        Row("kubelet decode", "import protobuf runtime (upb)", mib["upb"][0], "MiB", ""),
        Row("kubelet decode", "import api_pb2 (generated)", mib["upb"][1], "MiB", ""),
        Row("kubelet decode", f"{held}: upb", mib["upb"][2] / 8, "MiB", ""),
    ]


async def run() -> list[Row]:
    rows: list[Row] = []
    for pods in SIZES:
        rows += speed_rows(pods)
    rows += speed_rows(1024, rich=True)
    return rows + memory_rows()
