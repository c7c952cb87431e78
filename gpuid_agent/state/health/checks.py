"""The checks: pure functions from signals (and their recent history) to a Verdict.

Nothing here reads NVML or the clock; the tracker feeds in what was read and when, which keeps
every rule testable on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from gpuid_agent.sources.nvml.signals import EccCounts, RemappedRows
from gpuid_agent.state.health.clocks import SLOWDOWN_REASONS, decode_clock_reasons
from gpuid_agent.state.health.verdicts import ACTIONS, HEALTHY, Verdict
from gpuid_agent.state.health.xid import XidClass

# A hardware slowdown reason active in at least this share of the window's samples makes the
# GPU degraded; fewer samples than MIN_SAMPLES are not judged (one hot moment is not a trend).
SLOWDOWN_SHARE = 0.25
MIN_SAMPLES = 3
_SEVERITY = {"healthy": 0, "degraded": 1, "unhealthy": 2}


def format_window(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


class CounterWindow:
    """Growth of a monotonic counter over a sliding time window.

    A counter that goes down was reset (driver reload, volatile counters cleared): the history
    before the reset no longer compares, so the window starts again from the new value.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, at: float, value: int) -> None:
        if self._samples and value < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((at, value))
        # keep one sample at or before the window start as the baseline
        while len(self._samples) > 1 and self._samples[1][0] <= at - self.window:
            self._samples.popleft()

    def growth(self) -> int:
        if len(self._samples) < 2:
            return 0
        return self._samples[-1][1] - self._samples[0][1]


class ReasonWindow:
    """How often each slowdown reason was active among the samples of a time window."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, frozenset[str]]] = deque()

    def add(self, at: float, mask: int) -> None:
        self._samples.append((at, decode_clock_reasons(mask)))
        while self._samples and self._samples[0][0] < at - self.window:
            self._samples.popleft()

    def __len__(self) -> int:
        return len(self._samples)

    def shares(self) -> dict[str, float]:
        if not self._samples:
            return {}
        total = len(self._samples)
        return {
            reason: sum(1 for _, active in self._samples if reason in active) / total
            for reason in SLOWDOWN_REASONS
        }


def ecc_verdict(
    ecc: EccCounts | None,
    retired_pages_pending: bool | None,
    *,
    corrected_growth: int,
    uncorrected_growth: int,
    window: float,
) -> Verdict:
    if retired_pages_pending:
        return Verdict("unhealthy", "retired pages pending: reboot to retire them", "reboot")
    if ecc is None:
        return Verdict("not_supported", "ECC counters not reported (ECC off or not supported)")
    if ecc.volatile_uncorrected:
        return Verdict(
            "unhealthy",
            f"{ecc.volatile_uncorrected} uncorrected ECC errors since the driver loaded",
            "reboot",
        )
    if uncorrected_growth > 0:
        return Verdict(
            "unhealthy",
            f"{uncorrected_growth} new uncorrected ECC errors in the last {format_window(window)}",
            "reboot",
        )
    if corrected_growth > 0:
        return Verdict(
            "degraded",
            f"{corrected_growth} new corrected ECC errors in the last {format_window(window)}",
            "none",
        )
    return HEALTHY


def remapped_rows_verdict(rows: RemappedRows) -> Verdict:
    if rows.failure:
        return Verdict(
            "unhealthy",
            "row remapping failed: the GPU has no spare rows left",
            "hardware_inspection",
        )
    if rows.pending:
        # NVIDIA: the GPU keeps working; the remap takes effect at the next reset (XID 63)
        return Verdict("degraded", "row remapping pending: reset the GPU when convenient", "reset")
    return HEALTHY


def clock_events_verdict(window: ReasonWindow) -> Verdict:
    if len(window) < MIN_SAMPLES:
        return HEALTHY
    shares = window.shares()
    hot = {r: s for r, s in shares.items() if s >= SLOWDOWN_SHARE}
    if not hot:
        return HEALTHY
    # the most frequent reason; on a tie the most specific one (SLOWDOWN_REASONS order)
    order = list(SLOWDOWN_REASONS)
    reason = max(hot, key=lambda r: (hot[r], -order.index(r)))
    share = hot[reason]
    return Verdict(
        "degraded",
        f"{SLOWDOWN_REASONS[reason]} active in {share:.0%} of samples over the last "
        f"{format_window(window.window)}",
        "hardware_inspection",
    )


def persistence_verdict(mode: int) -> Verdict:
    if mode == 1:
        return HEALTHY
    return Verdict(
        "degraded",
        "persistence mode is off: the driver state is torn down between jobs "
        "(run nvidia-persistenced)",
        "none",
    )


def lost_verdict(reason: str | None) -> Verdict:
    if reason is None:
        return HEALTHY
    return Verdict("unhealthy", reason, "reboot")


def gpu_count_verdict(usable: int, expected: int | None, source: str) -> Verdict:
    if expected is None:
        return Verdict(
            "unknown",
            "no expected count: set EXPECTED_GPU_COUNT; neither the kubelet's allocatable "
            "GPUs nor the DRA driver's ResourceSlices are available",
        )
    if usable < expected:
        return Verdict(
            "unhealthy",
            f"{usable} of {expected} expected GPUs usable ({source})",
            "reboot",
        )
    return HEALTHY


def _rank(c: XidClass) -> tuple[int, int]:
    return _SEVERITY[c.state], ACTIONS.index(c.action)


def worst_xid(classes: Iterable[XidClass]) -> XidClass | None:
    judged = [c for c in classes if c.state != "healthy"]
    return max(judged, key=_rank) if judged else None


def xid_verdict(active: XidClass | None, unsupported: str | None) -> Verdict:
    if active is not None:
        how = "" if active.latched else " (recent)"
        return Verdict(active.state, f"XID {active.code}: {active.name}{how}", active.action)
    if unsupported is not None:
        return Verdict("not_supported", unsupported)
    return HEALTHY
