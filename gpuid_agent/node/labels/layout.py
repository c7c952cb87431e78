"""The labels (and detail annotation) a node should carry, from its inventory.

gpuid's layout under a prefix P (default `gpuid.github.com`), i and j counted from 0:

- no chassis (H100 HGX):    P/gpu-<j>                       j over the sorted unique serials
- one chassis (GB200 tray): P/chassis, P/gpu-<j>
- several chassis:          P/chassis-<i>, P/chassis-<i>-gpu-<j>   i over sorted chassis serials
- always (with GPUs):       P/gpu-count (GPUs NVML reports)
- with a chassis:           P/chassis-count (as gpuid: none without a chassis, so a selector
                            on the label's existence picks only nodes that have one)

GPUs sharing a serial (the two dies of a GB200 superchip) get one label. GPUs without a
chassis on a node that also has chassis keep `gpu-<j>`, with the chassis in indexed form so
keys never collide. A node without GPUs carries none of these labels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpuid_agent.facts import NodeInventory
from gpuid_agent.node.labels.values import label_value

ANNOTATION_NAME = "gpus"
ANNOTATION_VERSION = 1
# Names this agent writes under its prefix; only these are ever removed as stale, so labels
# others put under the same prefix are left alone.
OWN_NAME = re.compile(
    r"^(?:gpu-\d+|chassis|chassis-\d+|chassis-\d+-gpu-\d+|gpu-count|chassis-count)$"
)


@dataclass(frozen=True, slots=True)
class DesiredState:
    labels: Mapping[str, str]
    annotation: str | None  # JSON detail, or None when none should exist
    rewritten: tuple[str, ...] = ()  # raw serials that are not valid label values


def is_own_label(key: str, prefix: str) -> bool:
    head, sep, name = key.partition("/")
    return bool(sep) and head == prefix and OWN_NAME.match(name) is not None


def annotation_key(prefix: str) -> str:
    return f"{prefix}/{ANNOTATION_NAME}"


def _groups(inventory: NodeInventory) -> dict[str | None, list[str]]:
    """Sorted unique serials per chassis serial (None: GPUs without a chassis)."""
    groups: dict[str | None, set[str]] = {}
    for gpu in inventory.gpus:
        if not gpu.serial:
            continue
        groups.setdefault(gpu.chassis_serial or None, set()).add(gpu.serial)
    return {chassis: sorted(serials) for chassis, serials in groups.items()}


def desired_labels(inventory: NodeInventory, prefix: str) -> tuple[dict[str, str], list[str]]:
    """The labels and the raw serials (GPU or chassis) that had to be rewritten."""
    if not inventory.gpus:
        return {}, []
    labels: dict[str, str] = {}
    rewritten: list[str] = []

    def put(name: str, raw: str) -> None:
        value, exact = label_value(raw)
        if not exact:
            rewritten.append(raw)
        labels[f"{prefix}/{name}"] = value

    groups = _groups(inventory)
    chassis = sorted(c for c in groups if c is not None)
    unchassised = groups.get(None, [])
    if len(chassis) == 1 and not unchassised:
        put("chassis", chassis[0])
        for j, serial in enumerate(groups[chassis[0]]):
            put(f"gpu-{j}", serial)
    else:
        for i, chassis_serial in enumerate(chassis):
            put(f"chassis-{i}", chassis_serial)
            for j, serial in enumerate(groups[chassis_serial]):
                put(f"chassis-{i}-gpu-{j}", serial)
        for j, serial in enumerate(unchassised):
            put(f"gpu-{j}", serial)
    labels[f"{prefix}/gpu-count"] = str(len(inventory.gpus))
    if inventory.chassis_serials:
        labels[f"{prefix}/chassis-count"] = str(len(inventory.chassis_serials))
    return labels, rewritten


def detail_annotation(inventory: NodeInventory) -> str | None:
    """Full detail for tools, as canonical JSON (so an unchanged node compares equal).

    Only identity, never readings or times: the annotation changes only when the hardware
    does.
    """
    if not inventory.gpus:
        return None
    gpus = [
        {
            "index": g.index,
            "uuid": g.uuid,
            "serial": g.serial,
            "module_id": g.module_id,
            "chassis": g.chassis_serial,
            "slot": g.platform.slot_number if g.platform else None,
            "tray": g.platform.tray_index if g.platform else None,
            "host_id": g.platform.host_id if g.platform else None,
        }
        for g in inventory.gpus
    ]
    body = {"version": ANNOTATION_VERSION, "machine": inventory.machine, "gpus": gpus}
    # stdlib json with ASCII escapes: a serial NVML could not decode (lone surrogates) still
    # serialises, where orjson would refuse it
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def desired_state(inventory: NodeInventory, prefix: str, *, annotation: bool) -> DesiredState:
    labels, rewritten = desired_labels(inventory, prefix)
    return DesiredState(
        labels=labels,
        annotation=detail_annotation(inventory) if annotation else None,
        rewritten=tuple(dict.fromkeys(rewritten)),
    )
