"""What a GPU's NVLinks are held to besides the models table: the same model's other GPUs on
the node. GPUs of one model on one board are built alike, so what the others report (how many
links, which of them came up, at what speed) is what this one should show, for any model,
listed or not. A GPU with no peer of its model and no table entry has no expectation, which
/status says instead of guessing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuid_agent.facts import NvLink
from gpuid_agent.state.health.nvlink_models import NvLinkModel

# A link below this share of the speed it is compared with is slower (speeds are discrete
# rates, so anything short of a rounding difference is a lower rate)
SLOWER_SHARE = 0.97


@dataclass(frozen=True, slots=True)
class NvLinkPeers:
    """What the other GPUs of one model on the node show."""

    model: str  # NVML's name
    gpus: int  # how many other GPUs of the model were read
    links: int  # the most links any of them reports
    up: frozenset[int]  # links any of them has had up
    speed_mbps: int | None  # their most common active link speed


@dataclass(frozen=True, slots=True)
class PeerInput:
    """One GPU as the peer comparison sees it."""

    uuid: str
    model: str | None
    links: Sequence[NvLink] | None  # None: NVLinks not read (or not supported)
    seen_up: frozenset[int]


def modal_speed(links: Iterable[NvLink]) -> int | None:
    """The most common speed among the active links that report one; a tie goes to the
    faster (half the links slow is the slow half's fault)."""
    counts = Counter(
        lk.speed_mbps
        for lk in links
        if lk.active and lk.speed_mbps is not None and lk.speed_mbps > 0
    )
    if not counts:
        return None
    return max(counts.items(), key=lambda item: (item[1], item[0]))[0]


def peer_views(gpus: Sequence[PeerInput]) -> dict[str, NvLinkPeers]:
    """For each GPU with NVLinks, what the other GPUs of its model show (absent: no peer)."""
    # each GPU summed up once (links, links ever up, modal speed), then compared with its peers
    read = [
        (
            g,
            len(g.links),
            g.seen_up | {lk.link for lk in g.links if lk.active},
            modal_speed(g.links),
        )
        for g in gpus
        if g.model and g.links
    ]
    views: dict[str, NvLinkPeers] = {}
    for gpu, *_ in read:
        others = [o for o in read if o[0].model == gpu.model and o[0].uuid != gpu.uuid]
        if not others:
            continue
        speeds = [speed for *_, speed in others if speed is not None]
        views[gpu.uuid] = NvLinkPeers(
            model=gpu.model or "",
            gpus=len(others),
            links=max(links for _, links, _, _ in others),
            up=frozenset().union(*(up for _, _, up, _ in others)),
            speed_mbps=Counter(speeds).most_common(1)[0][0] if speeds else None,
        )
    return views


def expectation(model: NvLinkModel | None, peers: NvLinkPeers | None, name: str | None) -> str:
    """What the GPU's NVLinks are held to, in words, for /status."""
    held = []
    if model is not None:
        held.append(
            f"{model.model}: {model.links} links at {model.speed_mbps} MB/s (nvlink_models.json)"
        )
    if peers is not None:
        held.append(
            f"{peers.gpus} other {peers.model} GPU{'s' if peers.gpus > 1 else ''} on the node: "
            f"{peers.links} links"
            + (f" at {peers.speed_mbps} MB/s" if peers.speed_mbps is not None else "")
        )
    if held:
        return "; ".join(held)
    return (
        f"no expectation: {name or 'this model'} is not in the models table and no other GPU of "
        "the model is on the node"
    )
