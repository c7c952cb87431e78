"""Each check's current status and the last one reported, and which changes are news.

What is reported is the last *judgement*: a check that cannot be judged for a while ("unknown")
is shown as such but not reported, so unhealthy → unknown → unhealthy is no news and
unhealthy → unknown → healthy is one transition, unhealthy → healthy. A check that starts out
healthy or not supported is not news either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpuid_agent.state.health.verdicts import CheckStatus, Verdict

# Entering one of these states is not news when a check is first evaluated.
_QUIET_START = ("healthy", "not_supported")


@dataclass(slots=True)
class CheckStates:
    current: dict[str, CheckStatus] = field(default_factory=dict)
    reported: dict[str, CheckStatus] = field(default_factory=dict)

    def apply(
        self, verdicts: Mapping[str, Verdict], wall: datetime
    ) -> tuple[list[tuple[str, CheckStatus, CheckStatus | None]], bool]:
        """Apply verdicts: (check, current, previously reported) for each transition to
        report, and whether anything shown changed at all."""
        changed = []
        dirty = False
        for name, verdict in verdicts.items():
            previous = self.current.get(name)
            key = (verdict.state, verdict.action)
            if previous is not None and previous.key == key:
                if previous.reason != verdict.reason:  # same state, fresher wording
                    self.current[name] = CheckStatus(
                        verdict.state, verdict.reason, verdict.action, previous.since
                    )
                    dirty = True
                continue
            current = CheckStatus(verdict.state, verdict.reason, verdict.action, wall)
            self.current[name] = current
            dirty = True
            if verdict.state == "unknown":
                continue
            reported = self.reported.get(name)
            self.reported[name] = current
            if reported is None and verdict.state in _QUIET_START:
                continue
            if reported is not None and reported.key == key:
                continue
            changed.append((name, current, reported))
        return changed, dirty
