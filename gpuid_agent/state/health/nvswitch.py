"""The node's NVSwitches, as their SXIDs in the kernel log tell: a fatal SXID makes the node's
`nvswitch` check unhealthy (reboot: NVIDIA's recovery for a fatal NVSwitch error resets the
switch and the GPUs behind it) until the agent restarts; a non-fatal one degrades it for
XID_HOLD. An SXID line that does not say which it is (the driver's follow-up "Data" lines)
is not judged."""

from __future__ import annotations

from gpuid_agent.state.health.verdicts import HEALTHY, Verdict


class SwitchErrors:
    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.fatal: str | None = None
        self._recent: list[tuple[float, str]] = []

    def add(self, at: float, fatal: bool, reason: str) -> None:
        if fatal:
            self.fatal = reason
        else:
            self._recent.append((at, reason))

    def verdict(self, now: float) -> Verdict:
        self._recent = [(t, r) for t, r in self._recent if now - t < self.hold]
        if self.fatal is not None:
            return Verdict("unhealthy", self.fatal, "reboot")
        if self._recent:
            return Verdict("degraded", f"{self._recent[-1][1]} (recent)", "none")
        return HEALTHY
