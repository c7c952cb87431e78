"""GPU accounting: GPU-seconds and energy per workload, per pod and per holding (one container
on one device), accumulated snapshot by snapshot.

Between two snapshots each GPU's wall time and its energy counter's increase are divided by
the split (`accounting_split.py`) that held at the first of them; what no holder has counts
under `IDLE`, so over a node the totals add up to wall time times GPUs and to the GPUs' own
energy. Only a current attribution changes the split: while the kubelet is unreadable the
last known holders keep the GPU, as the allocation trail keeps them open.

Energy: the counter is millijoules since the driver loaded. A GPU whose counter is not
supported gets no energy; a counter that went down (driver reload, GPU reset) starts a new
baseline and that interval credits none, so no delta is ever negative.

Restarts: with STATE_DIR the totals of holdings, the split, the GPUs' energy baselines and the
time they were taken are saved (`accounting.json`, when the holders change and every
SAVE_INTERVAL). A restarted agent credits the time and energy since that save to the saved
split, so a SIGKILL neither loses nor repeats an interval; a gap over MAX_GAP (a node powered
off) is not credited.

Churn: a workload, pod or holding that holds no GPU any more is dropped `retention`
(ACCOUNTING_RETENTION) after it was last held, its series with it (its end and usage records
carry its final counts); at most MAX_ENDED of them wait out the retention, the longest
unheld going first, so memory, /gpu/metrics and the state file stay flat however many
short-lived pods pass through a node.

Cost per snapshot: the split is taken again only when its inputs moved (the attribution is
another object, the process shares or the GPUs differ), and each split's parts keep the
totals' rows they credit, so a snapshot adds to rows without hashing keys.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.runtime import formats, log
from gpuid_agent.state.accounting_split import (
    IDLE,
    AccountingView,
    HoldingKey,
    Part,
    Usage,
    WorkloadKey,
    idle_holding,
    split_node,
)
from gpuid_agent.state.attribution.holders import Attribution
from gpuid_agent.state.attribution.shares import ProcessView
from gpuid_agent.state.state_file import StateDir, write_atomically

_log = log.get("accounting")
STATE_FILE = formats.ACCOUNTING
STATE_VERSION = formats.FORMATS[STATE_FILE]  # raised there when the file's content changes
SAVE_INTERVAL = 15.0
MAX_GAP = 600.0  # longest restart gap credited to the saved split
MAX_ENDED = 4096  # ended workloads, pods and holdings kept at once while they wait out retention


@dataclass(frozen=True, slots=True)
class AccountingConfig:
    per_pod: bool = False  # ACCOUNTING_PER_POD
    state_dir: StateDir | None = None  # accounting.json; None keeps nothing
    retention: float = 3600.0  # ACCOUNTING_RETENTION: how long what ended stays readable


class _Totals(dict[Any, list[Any]]):
    """key → [gpu_seconds, device_seconds, joules or None]."""

    def add(self, key: Any, seconds: float, device: float, joules: float | None) -> None:
        row = self.get(key)
        if row is None:
            row = self[key] = [0.0, 0.0, None]
        row[0] += seconds
        row[1] += device
        if joules is not None:
            row[2] = (row[2] or 0.0) + joules

    def row(self, key: Any) -> list[Any]:
        row = self.get(key)
        if row is None:
            row = self[key] = [0.0, 0.0, None]
        return row

    def frozen(self) -> Mapping[Any, Usage]:
        make = tuple.__new__  # Usage(*row) without its argument parsing
        return MappingProxyType({k: make(Usage, v) for k, v in self.items()})


class _Credit:
    """One part of a split with the totals' rows it adds to, found at its first credit: a
    holder's rows appear when time is first credited to it, as before, and their keys are
    hashed once per split instead of once per snapshot."""

    __slots__ = ("part", "pod", "rows")

    def __init__(self, part: Part, per_pod: bool) -> None:
        self.part = part
        self.pod = _pod_key(part) if per_pod else None
        self.rows: tuple[list[Any], ...] = ()

    def find_rows(self, holdings: _Totals, workloads: _Totals, pods: _Totals) -> None:
        rows = [holdings.row(self.part.holding), workloads.row(self.part.workload)]
        if self.pod is not None:
            rows.append(pods.row(self.pod))
        self.rows = tuple(rows)


def _idle_fraction(parts: tuple[Part, ...]) -> float:
    idle = 1.0
    for p in parts:
        idle -= p.gpu_fraction
    return max(0.0, idle)


class Accountant:
    def __init__(self, config: AccountingConfig, node: str) -> None:
        self._config, self._node = config, node
        self._as_of: float | None = None
        self._split: dict[str, tuple[Part, ...]] = {}
        self._energy: dict[str, float] = {}  # GPU UUID → counter (mJ) at _as_of
        self._workloads, self._pods, self._holdings = _Totals(), _Totals(), _Totals()
        # the split's inputs, its parts ready to credit (GPU UUID → parts, idle fraction), and
        # the keys it holds (holdings; pods too with per_pod)
        self._inputs: tuple[Attribution, ProcessView, tuple[GpuIdentity, ...]] | None = None
        self._credits: dict[str, tuple[tuple[_Credit, ...], float, list[Any]]] = {}
        self._held: set[Any] = set()
        # ended workloads, holdings and pods → when last held, the longest unheld first
        self._last_held: dict[Any, float] = {}
        self._saved = 0.0
        self._changed = False
        self._load()
        # after the load: None while the file there is of a newer format (never overwritten)
        self.path = config.state_dir.path(STATE_FILE) if config.state_dir else None

    def advance(
        self,
        inventory: NodeInventory,
        samples: Mapping[str, GpuSample],
        attribution: Attribution,
        processes: ProcessView,
    ) -> AccountingView:
        """Credit the time since the last NVML read to the split that held over it, then take
        the split of this snapshot; the totals as of this read. Time is the reads' own (the
        energy counters were read then): a snapshot of another cause credits nothing, and a
        holder change it brings counts from the next read."""
        now = inventory.read_time.timestamp()
        elapsed = None if self._as_of is None else now - self._as_of
        if elapsed is not None and elapsed > MAX_GAP:
            _log.info("accounting gap not credited", extra={"seconds": round(elapsed)})
            elapsed = None
        for gpu in inventory.gpus:
            sample = samples.get(gpu.uuid)
            joules = self._energy_delta(gpu.uuid, sample)
            if elapsed is not None and gpu.uuid in self._split:
                self._credit(gpu.uuid, max(0.0, elapsed), joules)
        if attribution.state == "current" or not self._split:
            self._take_split(inventory, attribution, processes, now)
        self._as_of = now
        self._forget(now)
        return AccountingView(
            self._workloads.frozen(), self._pods.frozen(), self._holdings.frozen()
        )

    def _energy_delta(self, uuid: str, sample: GpuSample | None) -> float | None:
        counter = sample.values.get("energy_mj") if sample is not None else None
        if counter is None:
            return None
        before = self._energy.get(uuid)
        self._energy[uuid] = counter
        if before is None or counter < before:  # first read, or a reset: a new baseline
            return None
        return (counter - before) / 1000

    def _take_split(
        self,
        inventory: NodeInventory,
        attribution: Attribution,
        processes: ProcessView,
        now: float,
    ) -> None:
        """The split of this snapshot; the last one again while its inputs did not move (the
        attributor keeps its object while the kubelet, pods, slices and GPUs do not)."""
        inputs = self._inputs
        if (
            inputs is not None
            and inputs[0] is attribution
            and (inputs[1] is processes or inputs[1] == processes)
            and (inputs[2] is inventory.gpus or inputs[2] == inventory.gpus)
        ):
            return
        self._inputs = (attribution, processes, inventory.gpus)
        split = split_node(inventory, attribution, processes)
        if _holdings(split) != _holdings(self._split):
            self._changed = True  # saved at once: a restart credits the gap to these
        self._split = split
        self._credits.clear()
        held = self._held_keys()
        for key in self._held - held:  # the last split's keys: credited up to this read
            self._last_held[key] = now
        for key in held:
            self._last_held.pop(key, None)
        self._held = held

    def _held_keys(self) -> set[Any]:
        keys: set[Any] = _holdings(self._split) | {idle_holding(uuid) for uuid in self._split}
        keys.update(p.workload for parts in self._split.values() for p in parts)
        if self._config.per_pod:
            keys.update(_pod_key(p) for parts in self._split.values() for p in parts)
        return keys

    def _credit(self, uuid: str, seconds: float, joules: float | None) -> None:
        ready = self._credits.get(uuid)
        if ready is None:
            parts = self._split[uuid]
            per_pod = self._config.per_pod
            ready = self._credits[uuid] = (
                tuple(_Credit(p, per_pod) for p in parts),
                _idle_fraction(parts),
                self._holdings.row(idle_holding(uuid)),
            )
        credits, idle, idle_row = ready
        for c in credits:
            if not c.rows:
                c.find_rows(self._holdings, self._workloads, self._pods)
            fraction = c.part.gpu_fraction
            gpu_s, device_s = seconds * fraction, seconds * c.part.device_fraction
            share = None if joules is None else joules * fraction
            for row in c.rows:
                row[0] += gpu_s
                row[1] += device_s
                if share is not None:
                    row[2] = (row[2] or 0.0) + share
        idle_joules = None if joules is None else joules * idle
        self._workloads.add(IDLE, seconds * idle, 0.0, idle_joules)
        idle_row[0] += seconds * idle  # the GPU's own idle row: its idle usage records
        if idle_joules is not None:
            idle_row[2] = (idle_row[2] or 0.0) + idle_joules

    def _forget(self, now: float) -> None:
        """Ended workloads, holdings and pods leave `retention` after they were last held,
        or sooner past MAX_ENDED of them (the longest unheld first)."""
        ended = self._last_held
        retention = self._config.retention
        while ended:
            key, seen = next(iter(ended.items()))  # insertion order: the longest unheld
            if now - seen <= retention and len(ended) <= MAX_ENDED:
                return
            del ended[key]
            self._holdings.pop(key, None)
            self._pods.pop(key, None)
            self._workloads.pop(key, None)

    # ---- state file ------------------------------------------------------------------------

    def _state_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "version": STATE_VERSION,
                "node": self._node,
                "as_of": self._as_of,
                "energy": self._energy,
                "split": {
                    uuid: [
                        [list(p.holding), _key_wire(p.workload), p.gpu_fraction, p.device_fraction]
                        for p in parts
                    ]
                    for uuid, parts in self._split.items()
                },
                "holdings": [[list(k), *v] for k, v in self._holdings.items()],
            }
        )

    async def save_due(self) -> None:
        """Save the state file when SAVE_INTERVAL has passed since the last save, or the
        holders changed."""
        now = time.monotonic()
        if self.path is None or self._as_of is None:
            return
        if now - self._saved < SAVE_INTERVAL and not self._changed:
            return
        self._saved, self._changed = now, False
        try:
            await asyncio.to_thread(write_atomically, self.path, self._state_bytes())
        except OSError as exc:
            _log.warning("cannot save accounting state", extra={"error": str(exc)})

    def _load(self) -> None:
        # a damaged or odd file must not stop the agent: set aside, accounting starts over
        state_dir = self._config.state_dir
        state = state_dir.load(STATE_FILE, self._parse) if state_dir else None
        if state is None:
            return
        self._as_of, self._energy, self._split, self._holdings = state
        self._held = self._held_keys()
        for key in self._holdings.keys() - self._held:  # ended before the restart
            self._last_held[key] = self._as_of
        _log.info("restored accounting", extra={"holdings": len(self._holdings)})

    def _parse(
        self, raw: bytes
    ) -> tuple[float, dict[str, float], dict[str, tuple[Part, ...]], _Totals]:
        state = orjson.loads(raw)
        formats.readable_format(STATE_FILE, state)  # a newer one is kept, not set aside
        if state.get("node") != self._node:
            raise ValueError("state file is for another node")
        as_of = float(state["as_of"])
        energy = {str(k): float(v) for k, v in state["energy"].items()}
        split = {
            str(uuid): tuple(
                Part(_holding(h), _key_from_wire(w), float(g), float(d)) for h, w, g, d in parts
            )
            for uuid, parts in state["split"].items()
        }
        holdings = _Totals()
        for key, seconds, device, joules in state["holdings"]:
            holdings[_holding(key)] = [
                float(seconds),
                float(device),
                None if joules is None else float(joules),
            ]
        return as_of, energy, split, holdings


def _holdings(split: Mapping[str, tuple[Part, ...]]) -> set[HoldingKey]:
    return {p.holding for parts in split.values() for p in parts}


def _pod_key(part: Part) -> WorkloadKey:
    w = part.workload
    return WorkloadKey(w.namespace, w.owner_kind, w.owner_name, w.claim, w.labels, part.holding[1])


def _key_wire(key: WorkloadKey) -> list[Any]:
    return [key.namespace, key.owner_kind, key.owner_name, key.claim, [list(p) for p in key.labels]]


def _key_from_wire(wire: Any) -> WorkloadKey:
    namespace, kind, name, claim, labels = wire
    pairs = tuple((str(k), str(v)) for k, v in labels)
    return WorkloadKey(str(namespace), str(kind), str(name), str(claim), pairs)


def _holding(wire: Any) -> HoldingKey:
    if not isinstance(wire, list) or len(wire) != 5 or not all(isinstance(v, str) for v in wire):
        raise ValueError("malformed holding key")
    return (wire[0], wire[1], wire[2], wire[3], wire[4])
