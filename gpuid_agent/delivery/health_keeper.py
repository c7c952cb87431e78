"""One exporter's health and delivery counts, kept from what its worker sees: deliveries and
failed attempts, dropped records, store problems, an intake that does not drain, and an
idle-time probe of the sink. `health` is a plain read of that state, for handlers.

Logs say each thing once: the first failure of an outage is a warning (the rest are debug),
drops are logged once per outage (the counter has the rest), and a state change once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from gpuid_agent.delivery.exporters.base import ExporterHealth
from gpuid_agent.delivery.policy import BatchPolicy
from gpuid_agent.delivery.store import BatchStore, StoredBatch
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import AgentMetrics

_log = log.get("pipeline")
STATES = ("ok", "degraded", "unavailable")


class HealthKeeper:
    def __init__(
        self,
        name: str,
        store: BatchStore,
        policy: BatchPolicy,
        metrics: AgentMetrics,
        *,
        store_problem: str | None = None,
    ) -> None:
        self.name = name
        self._store = store
        self._timeout = policy.timeout
        self._metrics = metrics
        self.store_problem = store_problem  # why the spool could not be used, if it could not
        self._store_error: str | None = None  # a store operation that raised anyway
        self._on_failure: list[Callable[[], None]] = []
        self._stuck = False  # the intake was not drained within one attempt's timeout
        self._probe: ExporterHealth | None = None
        self._drops_logged = False
        self.retry_after: float | None = None  # the sink's last Retry-After
        self.last_attempt = time.monotonic()
        self.last_error: str | None = None
        self.last_success: float | None = None
        self.consecutive_failures = 0
        self.delivered_records = 0
        self.dropped_records = 0
        self.dropped_since_success = 0
        self.set_aside_batches = 0
        self._state_gauges = {s: metrics.exporter_state.labels(name, s) for s in STATES}
        self._health = ExporterHealth(ok=True)
        self._publish_state()
        self.refresh()

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every failed attempt (waiting producers stop waiting)."""
        self._on_failure.append(callback)

    @property
    def health(self) -> ExporterHealth:
        return self._health  # recomputed after every result and store operation

    def delivering(self) -> bool:
        """Whether waiting for this worker is backpressure rather than a hang."""
        return not self.consecutive_failures and not self._stuck

    def stuck(self, stuck: bool) -> None:
        """The intake was (or is again) drained within one attempt's timeout."""
        if stuck or self._stuck:
            self._stuck = stuck
            self.refresh()

    # ---- deliveries --------------------------------------------------------------------------

    def attempted(self) -> None:
        self.last_attempt = time.monotonic()

    def succeeded(self, count: int) -> None:
        if self.consecutive_failures:
            _log.info(
                "exporter delivering again",
                extra={"exporter": self.name, "failed_attempts": self.consecutive_failures},
            )
        self.consecutive_failures = 0
        self.last_error = None
        self.retry_after = None
        self._probe = None  # a delivery proves the sink
        self.last_attempt = time.monotonic()
        self.delivered_records += count
        self.dropped_since_success = 0
        self.last_success = time.time()
        self._metrics.export_success.labels(self.name).inc()
        self._metrics.exported_records.labels(self.name).inc(count)
        self._metrics.last_export_success.labels(self.name).set(self.last_success)
        self.refresh()

    def failed(self, error_type: str, message: str, retry_after: float | None) -> None:
        self.consecutive_failures += 1
        for callback in self._on_failure:
            callback()
        self.last_error = message
        self.retry_after = retry_after
        self._metrics.export_failure.labels(self.name, error_type).inc()
        # The first failure of an outage is a warning; the rest would repeat it every backoff.
        level = 30 if self.consecutive_failures == 1 else 10
        _log.log(
            level,
            "export attempt failed",
            extra={"exporter": self.name, "error_type": error_type, "error": message},
        )
        self.refresh()

    # ---- losses and the store ------------------------------------------------------------------

    def dropped(self, batches: Sequence[StoredBatch]) -> None:
        """Count batches a store dropped, by the reason it gave."""
        by_reason: dict[str, int] = {}
        for batch in batches:
            reason = batch.dropped_for or "store_full"
            by_reason[reason] = by_reason.get(reason, 0) + batch.count
        for reason, count in by_reason.items():
            self.count_dropped(count, reason, "oldest batches dropped")

    def count_dropped(self, count: int, reason: str, message: str) -> None:
        self.dropped_records += count
        self.dropped_since_success += count
        self._metrics.dropped_records.labels(self.name, reason).inc(count)
        if not self._drops_logged:  # once per outage; the counter has the rest
            self._drops_logged = True
            _log.error(
                message,
                extra={
                    "exporter": self.name,
                    "reason": reason,
                    "records": count,
                    "store": self._store.describe(),
                },
            )
        self.refresh()

    def lost_at_shutdown(self, count: int) -> None:
        self.dropped_records += count
        self._metrics.dropped_records.labels(self.name, "shutdown").inc(count)

    def set_aside(self) -> None:
        self.set_aside_batches += 1
        self._metrics.set_aside_batches.labels(self.name).inc()

    def store_failed(self, op: str, exc: Exception) -> None:
        reason = f"store {op} failed: {exc}"
        if self._store_error != reason:
            _log.error(reason, extra={"exporter": self.name, "store": self._store.describe()})
        self._store_error = reason

    def store_ok(self) -> None:
        self._store_error = None

    # ---- probe -------------------------------------------------------------------------------

    async def probe_loop(
        self, probe: Callable[[], Awaitable[ExporterHealth]], interval: float
    ) -> None:
        """Probe the sink every `interval`, but only when no delivery was attempted within
        it: a delivery (or a failed one) already says how the sink is."""
        while True:
            idle = time.monotonic() - self.last_attempt
            if idle < interval:
                await asyncio.sleep(interval - idle)
                continue
            self.last_attempt = time.monotonic()
            try:
                result = await asyncio.wait_for(probe(), min(self._timeout, interval))
            except TimeoutError:
                result = ExporterHealth(ok=False, reason="health check timed out")
            except Exception as exc:  # a probe bug must not end the prober
                result = ExporterHealth(ok=False, reason=f"health check failed: {exc!r}")
            self._probe = result
            self.refresh()

    # ---- state -------------------------------------------------------------------------------

    def _compute(self) -> ExporterHealth:
        store = self._store
        reasons: list[str] = []
        figures: dict[str, int] = {}
        if self.consecutive_failures:
            reasons.append(self.last_error or "failing")
            figures["failed_attempts"] = self.consecutive_failures
            if store.batches:
                reasons.append(f"batches held in {store.describe()}")
                figures["batches_held"] = store.batches
        elif self._probe is not None and not self._probe.ok:
            reasons.append(self._probe.reason or "health check failed")
        for problem in (self.store_problem, store.problem, self._store_error):
            if problem:
                reasons.append(problem)
        if self._stuck:
            reasons.append(f"intake not drained within {self._timeout}s")
        if not reasons:
            return ExporterHealth(ok=True)
        if self.dropped_since_success:
            figures["dropped_records"] = self.dropped_since_success
        return ExporterHealth(
            ok=False,
            reason="; ".join(reasons),
            losing=self.dropped_since_success > 0,
            figures=figures,
        )

    def refresh(self) -> None:
        """Recompute health after a change; log and publish a change of state."""
        health = self._compute()
        if health == self._health:
            return
        previous, self._health = self._health, health
        if health.state != previous.state:
            self._publish_state()
            if health.state == "ok":
                self._drops_logged = False
                _log.info("exporter ok again", extra={"exporter": self.name})
            else:
                _log.warning(
                    f"exporter {health.state}",
                    extra={"exporter": self.name, "reason": health.reason},
                )

    def _publish_state(self) -> None:
        for state, gauge in self._state_gauges.items():
            gauge.set(1 if state == self._health.state else 0)
