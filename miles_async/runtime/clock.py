"""Clocks for policy code: `RealClock` for runs, `VirtualClock` for the simulator and tests.

Policy code (scheduling, admission, staleness) takes a `Clock` instead of calling `time.time()`
or `asyncio.sleep`, so `miles_async/sim/` can drive the very same code on virtual time and tests never sleep.

    clock = VirtualClock()
    task = asyncio.ensure_future(policy(clock))   # policy awaits clock.sleep(5.0)
    await clock.advance(5.0)                      # wakes it; no real time passes
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall time: `time.monotonic` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """Time that moves only when `advance`/`advance_to` says so.

    Sleepers wake in deadline order (ties in the order they went to sleep), and each advance
    lets the woken coroutines run before returning, so what they schedule next is seen.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    def next_deadline(self) -> float | None:
        """When the earliest live sleeper wakes, or None when nobody sleeps."""
        while self._sleepers and self._sleepers[0][2].done():  # cancelled sleepers
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    @property
    def num_sleepers(self) -> int:
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    async def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards (advance by {seconds})")
        await self.advance_to(self._now + seconds)

    async def advance_to(self, deadline: float) -> None:
        """Move to `deadline`, waking every sleeper due on the way, in order."""
        if deadline < self._now:
            raise ValueError(f"cannot move a clock backwards (from {self._now} to {deadline})")
        while (due := self.next_deadline()) is not None and due <= deadline:
            when, _, fut = heapq.heappop(self._sleepers)
            self._now = when
            fut.set_result(None)
            await _settle()
        self._now = deadline
        await _settle()


async def _settle(rounds: int = 8) -> None:
    # Let woken coroutines run far enough to go back to sleep or finish; a few loop turns
    # suffice for chains of awaits on already-completed futures.
    for _ in range(rounds):
        await asyncio.sleep(0)
