"""Link health: the PCIe link's training and replays, and each NVLink's state and errors.

PCIe: a link narrower than its maximum is degraded at once (lanes do not come back without a
reset). A generation below the maximum is judged only while the GPU is busy: idle links drop
to a lower generation to save power, so an idle node never alarms. What a busy reading showed
holds until the next busy reading. Replays growing by `replay_threshold` in the window
degrade the link too (signal integrity), as do AER counters: any uncorrectable (non-fatal or
fatal) error in the window, or AER_CORRECTABLE_THRESHOLD correctable ones.

NVLink: a link that was seen up and is now down is unhealthy; a link's data-link error
counters growing within the window degrade it. For a model in `nvlink_models.json` every link
it has must be present and active: one missing or inactive, from the start or not, is
unhealthy, and an active link slower than the model's speed is degraded. For other models
(PCIe cards with bridges) a link never seen up while others of the same GPU are up is
degraded, and a GPU none of whose links was ever up (no bridge fitted) is not news. Every
reason names the link.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuid_agent.facts import NVLINK_COUNTERS, NvLink, PcieAer, PcieLink
from gpuid_agent.state.health.checks import CounterWindow, format_window
from gpuid_agent.state.health.nvlink_models import NvLinkModel
from gpuid_agent.state.health.verdicts import HEALTHY, Verdict

# GPU utilization (percent) from which the link generation is judged
BUSY_UTILIZATION = 10.0
# Correctable AER errors within the window that degrade the link (uncorrectable: any)
AER_CORRECTABLE_THRESHOLD = 100
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
        self.gen_short: tuple[int, int] | None = None  # (gen, max) the last busy read showed

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
            short = 0 < link.gen < link.max_gen
            self.gen_short = (link.gen, link.max_gen) if short else None
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
                "degraded", f"PCIe link at Gen{gen} of Gen{top} while busy", "hardware_inspection"
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

    def verdict(self, links: Sequence[NvLink], now: float) -> Verdict:
        down = [lk.link for lk in links if not lk.active and lk.link in self.seen_up]
        self.seen_up.update(lk.link for lk in links if lk.active)
        never = [lk.link for lk in links if not lk.active and lk.link not in self.seen_up]
        growing: dict[int, list[str]] = {}
        recovery: list[int] = []
        for lk in links:
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
        if down:
            plural = "s" if len(down) > 1 else ""
            return Verdict("unhealthy", f"NVLink{plural} {_links_text(down)} down", "reboot")
        model = self.expected
        if model is not None and (short := _short_of_model(model, links, never)):
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
        if model is not None and (slow := _slow(model, links)):
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


def _slow(model: NvLinkModel, links: Sequence[NvLink]) -> Verdict | None:
    slow = [
        lk
        for lk in links
        if lk.active and lk.speed_mbps is not None and 0 < lk.speed_mbps < model.speed_mbps
    ]
    if not slow:
        return None
    detail = ", ".join(f"{lk.link} at {lk.speed_mbps}" for lk in slow)
    return Verdict(
        "degraded",
        f"NVLink below the {model.model}'s {model.speed_mbps} MB/s: {detail}",
        "hardware_inspection",
    )
