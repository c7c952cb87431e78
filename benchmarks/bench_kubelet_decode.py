"""Reading the kubelet's List answer with protobuf's parser (upb) through `wire.parse_list`.

- Parsing alone, and parsing + `snapshot_from` (what a poll whose answer moved costs: every
  answer is parsed whole), at 8 to 4,096 pods (one time-shared GPU replica each, as
  benchmarks/kubelet_server.py serves), and at 1,024 pods with what a real kubelet adds (NUMA
  topology, cpu ids, memory). Interleaved rounds, so drift in machine load hits both.
- Memory: what importing protobuf's runtime and the generated messages adds to a process that
  already holds the agent's libraries, and what a parsed 1,024-pod answer holds, each in a
  fresh process (median of 5).
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
from gpuid_agent.sources.kubelet import wire
from gpuid_agent.sources.kubelet.devices import ResourceMatcher
from gpuid_agent.sources.kubelet.source import snapshot_from

NODE = "bench-node"
SIZES = (8, 128, 1024, 4096)
ROUNDS = 40
KUBELET = Path(__file__).resolve().parent.parent / "gpuid_agent" / "sources" / "kubelet"


def answer(pods: int, rich: bool = False) -> bytes:
    """A List answer naming `pods` pods."""
    message = list_response(shared_pods(NODE, pods)[0])
    if rich:
        for i, p in enumerate(message.pod_resources):
            for c in p.containers:
                c.cpu_ids.extend(range(4 * i, 4 * i + 4))
                c.memory.add(memory_type="memory", size=2**30).topology.nodes.add(ID=i % 2)
                for d in c.devices:
                    d.topology.nodes.add(ID=i % 2)
    return message.SerializeToString()


def _timed(way: Callable[[], Any], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        way()
    return (time.perf_counter() - started) / reps


def speed_rows(pods: int, rich: bool = False) -> list[Row]:
    data = answer(pods, rich)
    matches = ResourceMatcher()
    ways: dict[str, Callable[[], Any]] = {
        "parse": lambda: wire.parse_list(data),
        "parse+snapshot": lambda: snapshot_from(wire.parse_list(data), matches),
    }
    took: dict[str, list[float]] = {name: [] for name in ways}
    reps = max(1, 256 // pods)  # small answers timed in batches, above the clock's grain
    for _ in range(ROUNDS):
        for name, way in ways.items():
            took[name].append(_timed(way, reps))
    us = {name: median(values) * 1e6 for name, values in took.items()}
    what = f"List, {pods:,} pods{' + topology, cpus, memory' if rich else ''}"
    note = f"{len(data) / 1024:,.1f} KiB answer, median of {ROUNDS}"
    return [
        Row("kubelet decode", f"{what}: wire.parse_list (upb)", us["parse"], "µs", note),
        Row("kubelet decode", f"{what} + snapshot_from", us["parse+snapshot"], "µs", note),
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
_MEMORY_STEPS = [
    _RUNTIME,
    "api_pb2 = load('v1/api_pb2')",
    # 8 answers, so that what one holds stands above the noise of RSS
    "held = [api_pb2.ListPodResourcesResponse.FromString(bytes(data)) for _ in range(8)]",
]


def memory_rows(pods: int = 1024) -> list[Row]:
    with tempfile.NamedTemporaryFile(prefix="bench-list-", dir="/tmp") as file:
        file.write(answer(pods))
        file.flush()
        runs = []
        for _ in range(5):
            script = _MEMORY.format(steps=_MEMORY_STEPS)
            out = subprocess.run(
                [sys.executable, "-c", script, str(KUBELET), file.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs.append([float(v) for v in out.split()])
    runtime, generated, held = (statistics.median(step) for step in zip(*runs, strict=True))
    note = "RSS added, median of 5"
    return [
        Row("kubelet decode", "import protobuf runtime (upb)", runtime, "MiB", note),
        Row("kubelet decode", "import api_pb2 (generated)", generated, "MiB", note),
        Row("kubelet decode", f"{pods:,}-pod answer parsed and held", held / 8, "MiB", note),
    ]


async def run() -> list[Row]:
    rows: list[Row] = []
    for pods in SIZES:
        rows += speed_rows(pods)
    rows += speed_rows(1024, rich=True)
    return rows + memory_rows()
