"""Feeding an emitter from a `SnapshotBus` subscription.

Each emitter keeps its own loop (heartbeats, coalescing, the trail's state refresh) and its
`offer`/`stop` pair, which tests drive directly; `follow` is the bridge from the bus: it offers
every snapshot the subscription yields and, once the bus is closed and drained, stops the
emitter so its loop publishes what it still owes and returns."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot


async def follow(
    subscription: Subscription,
    offer: Callable[[NodeSnapshot], None],
    stop: Callable[[], None],
    loop: Callable[[], Awaitable[None]],
) -> None:
    async def pump() -> None:
        async for snapshot in subscription:
            offer(snapshot)
        stop()

    feeder = asyncio.create_task(pump(), name=f"{subscription.name}-feed")
    try:
        await loop()
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
