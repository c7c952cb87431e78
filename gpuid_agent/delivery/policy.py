"""How one exporter's worker batches, bounds its memory, retries and probes (BATCH_SIZE,
FLUSH_INTERVAL, QUEUE_SIZE, RETRY_COUNT, TIMEOUT, backoff, HEALTH_PROBE_INTERVAL)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    batch_size: int = 10
    flush_interval: float = 2.0
    queue_size: int = 10_000
    retry_count: int = 2
    timeout: float = 30.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    health_probe_interval: float = 30.0


def memory_split(policy: BatchPolicy) -> tuple[int, int]:
    """QUEUE_SIZE bounds the records one exporter holds in memory: the intake and the batch
    being formed take half, batches in a memory store (or a spool that cannot be written)
    the other half. Returns (intake size, records in memory batches)."""
    half = policy.queue_size // 2
    return max(1, half - policy.batch_size), max(1, policy.queue_size - half)
