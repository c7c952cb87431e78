"""Link health: the PCIe link's training and replays, and each NVLink's state and errors.

PCIe: a link narrower than its maximum is degraded at once (lanes do not come back without a
reset). A generation below the maximum is judged only while the GPU is busy, and only once
DOWNTRAIN_READINGS busy readings in a row showed it: idle links drop to a lower generation to
save power and climb back a moment after the load comes, and utilization and link are read at
different instants, so one busy reading at Gen1 is a link still waking. The finding holds until
a busy reading shows the full generation. Replays growing by `replay_threshold` in the window
degrade the link too (signal integrity), as do AER counters: any uncorrectable (non-fatal or
fatal) error in the window, or AER_CORRECTABLE_THRESHOLD correctable ones.

NVLink: a link that was seen up and is now down is unhealthy; a link's data-link error
counters growing within the window degrade it. For a model in `nvlink_models.json` every link
it has must be present and active: one missing or inactive, from the start or not, is
unhealthy. Every model is also judged against its peers (`nvlink_peers`): fewer links than
the same model's other GPUs on the node report, or a link never up that they have up, is
unhealthy (degraded when none of the GPU's links is up, which on a card is a bridge not
fitted); a link slower than the GPU's other links, or a GPU's links slower than its peers',
is degraded. The table's speed alone degrades a link only below TABLE_SPEED_SHARE of it: a
table value slightly off never makes a healthy GPU degraded. With neither table nor peers, a
link never seen up while others of the same GPU are up is degraded, and a GPU none of whose
links was ever up (no bridge fitted) is not news. Every reason names the link.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuid_agent.facts import NVLINK_COUNTERS, NvLink, PcieAer, PcieLink
from gpuid_agent.state.health.checks import CounterWindow, format_window
from gpuid_agent.state.health.nvlink_models import NvLinkModel
from gpuid_agent.state.health.nvlink_peers import SLOWER_SHARE, NvLinkPeers, modal_speed
from gpuid_agent.state.health.verdicts import HEALTHY, Verdict

# GPU utilization (percent) from which the link generation is judged
BUSY_UTILIZATION = 10.0
# Busy readings in a row below the maximum generation that make a downtrained link
DOWNTRAIN_READINGS = 3
# Correctable AER errors within the window that degrade the link (uncorrectable: any)
AER_CORRECTABLE_THRESHOLD = 100
# Share of the table's per-link speed below which a link is slow on the table's word alone
TABLE_SPEED_SHARE = 0.75
_RECOVERY = NVLINK_COUNTERS.index("recovery")


def _links_text(links: Sequence[int]) -> str:
    return ", ".join(str(link) for link in links)


class PcieWatch:
    """One GPU's PCIe link over time."""

    def __init__(self, window: float, replay_threshold: int) -> None:
        self.window = window
        self.replay_threshold = replay_threshold
        self.replays = CounterWindow(window)
        self.aer = tuple(CounterWindow(window) for _ in PcieAer._fields)
        self.busy_short = 0  # busy readings in a row below the maximum generation
        self.gen_short: tuple[int, int] | None = None  # (gen, max) once it persisted

    def verdict(
        self,
        link: PcieLink,
        replays: int | None,
        utilization: float | None,
        now: float,
        aer: PcieAer | None = None,
    ) -> Verdict:
        if link.max_gen <= 0 or link.max_width <= 0:
            return Verdict("unknown", f"PCIe link maximum not reported ({link})")
        if utilization is not None and utilization >= BUSY_UTILIZATION:
            if 0 < link.gen < link.max_gen:
                self.busy_short += 1
                if self.busy_short >= DOWNTRAIN_READINGS:
                    self.gen_short = (link.gen, link.max_gen)
            else:
                self.busy_short, self.gen_short = 0, None
        if replays is not None:
            self.replays.add(now, replays)
        for window, count in zip(self.aer, aer or (), strict=False):
            if count is not None:
                window.add(now, count)
        if 0 < link.width < link.max_width:
            return Verdict(
                "degraded",
                f"PCIe link trained to x{link.width} of x{link.max_width}",
                "hardware_inspection",
            )
        if link.width == 0:
            return Verdict("unhealthy", "PCIe link is down (width 0)", "reboot")
        if self.gen_short is not None:
            gen, top = self.gen_short
            return Verdict(
                "degraded",
                f"PCIe link at Gen{gen} of Gen{top} in {self.busy_short} busy readings in a row",
                "hardware_inspection",
            )
        span = format_window(self.window)
        correctable, non_fatal, fatal = (w.growth() for w in self.aer)
        if non_fatal or fatal:
            return Verdict(
                "degraded",
                f"{non_fatal + fatal} uncorrectable PCIe AER errors ({fatal} fatal) in the "
                f"last {span}",
                "hardware_inspection",
            )
        growth = self.replays.growth()
        if growth >= self.replay_threshold > 0:
            return Verdict(
                "degraded", f"{growth} PCIe replays in the last {span}", "hardware_inspection"
            )
        if correctable >= AER_CORRECTABLE_THRESHOLD:
            return Verdict(
                "degraded",
                f"{correctable} correctable PCIe AER errors in the last {span}",
                "hardware_inspection",
            )
        return HEALTHY


class NvLinkWatch:
    """One GPU's NVLinks over time."""

    def __init__(self, window: float, expected: NvLinkModel | None = None) -> None:
        self.window = window
        self.expected = expected
        self.seen_up: set[int] = set()
        self._errors: dict[tuple[int, int], CounterWindow] = {}
        # Each link whose counters showed no growth at their last reading, with those values:
        # an equal reading adds nothing to windows that hold one value (the growth against
        # any baseline stays that value's), so the link is passed over.
        self._quiet: dict[int, tuple[int | None, ...]] = {}

    def verdict(
        self, links: Sequence[NvLink], now: float, peers: NvLinkPeers | None = None
    ) -> Verdict:
        down = [lk.link for lk in links if not lk.active and lk.link in self.seen_up]
        self.seen_up.update(lk.link for lk in links if lk.active)
        never = [lk.link for lk in links if not lk.active and lk.link not in self.seen_up]
        growing: dict[int, list[str]] = {}
        recovery: list[int] = []
        for lk in links:
            if self._quiet.get(lk.link) == lk.errors:
                continue
            for counter, value in enumerate(lk.errors):
                if value is None:
                    continue
                window = self._errors.get((lk.link, counter))
                if window is None:  # not setdefault: that would build one every pass
                    window = self._errors[(lk.link, counter)] = CounterWindow(self.window)
                window.add(now, value)
                if (grown := window.growth()) > 0:
                    name = NVLINK_COUNTERS[counter].replace("_", " ")
                    growing.setdefault(lk.link, []).append(f"{grown} {name}")
                    if counter == _RECOVERY:
                        recovery.append(lk.link)
            if lk.link in growing:
                self._quiet.pop(lk.link, None)
            else:
                self._quiet[lk.link] = lk.errors
        if down:
            plural = "s" if len(down) > 1 else ""
            return Verdict("unhealthy", f"NVLink{plural} {_links_text(down)} down", "reboot")
        model = self.expected
        if model is not None and (short := _short_of_model(model, links, never)):
            return short
        if peers is not None and (short := _short_of_peers(peers, links, never)):
            return short
        if growing:
            detail = "; ".join(
                f"link {link}: {', '.join(what)}" for link, what in sorted(growing.items())
            )
            return Verdict(
                "degraded",
                f"NVLink errors growing in the last {format_window(self.window)}: {detail}",
                "hardware_inspection" if recovery else "none",
            )
        if slow := _slow(model, links, peers):
            return slow
        if never and self.seen_up:
            up = len(links) - len(never)
            return Verdict(
                "degraded",
                f"NVLink {_links_text(never)} inactive while {up} other links are up",
                "hardware_inspection",
            )
        return HEALTHY


def _short_of_model(
    model: NvLinkModel, links: Sequence[NvLink], never: Sequence[int]
) -> Verdict | None:
    """Links the model has that are missing or were never up: unhealthy from the start."""
    if len(links) < model.links:
        return Verdict(
            "unhealthy",
            f"{len(links)} of the {model.links} NVLinks a {model.model} has are reported",
            "reboot",
        )
    if never:
        plural = "s" if len(never) > 1 else ""
        up = len(links) - len(never)
        return Verdict(
            "unhealthy",
            f"NVLink{plural} {_links_text(never)} inactive since the agent started "
            f"({up} of {model.links} up on a {model.model})",
            "reboot",
        )
    return None


def _others(peers: NvLinkPeers) -> str:
    if peers.gpus == 1:
        return f"the other {peers.model} GPU on the node"
    return f"the other {peers.gpus} {peers.model} GPUs on the node"


def _short_of_peers(
    peers: NvLinkPeers, links: Sequence[NvLink], never: Sequence[int]
) -> Verdict | None:
    """Links the same model's other GPUs report, or have up, that this GPU lacks."""
    others, have = _others(peers), "has" if peers.gpus == 1 else "have"
    if len(links) < peers.links:
        return Verdict(
            "unhealthy", f"{len(links)} NVLinks reported, {peers.links} on {others}", "reboot"
        )
    missing = [link for link in never if link in peers.up]
    if not missing:
        return None
    if len(never) == len(links):  # nothing up at all: on a card, a bridge not fitted
        return Verdict(
            "degraded", f"no NVLink up while {others} {have} links up", "hardware_inspection"
        )
    plural = "s" if len(missing) > 1 else ""
    return Verdict(
        "unhealthy",
        f"NVLink{plural} {_links_text(missing)} never up while {others} {have} "
        f"{'them' if plural else 'it'} up",
        "reboot",
    )


def _slow(
    model: NvLinkModel | None, links: Sequence[NvLink], peers: NvLinkPeers | None
) -> Verdict | None:
    """Slower than the GPU's other links, than its peers' links, or far below the table."""
    own = modal_speed(links)
    if own is not None:
        slow = [(link, mbps) for link, mbps in _active_speeds(links) if mbps < own * SLOWER_SHARE]
        if slow:
            detail = ", ".join(f"{link} at {mbps}" for link, mbps in slow)
            return Verdict(
                "degraded",
                f"NVLink slower than the GPU's other links ({own} MB/s): {detail}",
                "hardware_inspection",
            )
    peer_speed = peers.speed_mbps if peers is not None else None
    if own is not None and peers is not None and peer_speed and own < peer_speed * SLOWER_SHARE:
        return Verdict(
            "degraded",
            f"NVLinks at {own} MB/s, {peer_speed} MB/s on {_others(peers)}",
            "hardware_inspection",
        )
    if model is None:
        return None
    floor = model.speed_mbps * TABLE_SPEED_SHARE
    far = [(link, mbps) for link, mbps in _active_speeds(links) if mbps < floor]
    if not far:
        return None
    detail = ", ".join(f"{link} at {mbps}" for link, mbps in far)
    return Verdict(
        "degraded",
        f"NVLink below 3/4 of the {model.model}'s {model.speed_mbps} MB/s: {detail}",
        "hardware_inspection",
    )


def _active_speeds(links: Sequence[NvLink]) -> list[tuple[int, int]]:
    """(link, MB/s) of every active link whose speed is reported."""
    return [
        (lk.link, lk.speed_mbps)
        for lk in links
        if lk.active and lk.speed_mbps is not None and lk.speed_mbps > 0
    ]
