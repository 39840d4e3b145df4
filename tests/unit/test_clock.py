"""VirtualClock drives sleepers in deadline order without real time passing; RealClock is wall time."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles_async.runtime import Clock, RealClock, VirtualClock


def test_both_clocks_satisfy_the_protocol():
    assert isinstance(RealClock(), Clock) and isinstance(VirtualClock(), Clock)


def test_virtual_clock_wakes_sleepers_in_order_without_waiting():
    async def scenario():
        clock = VirtualClock(start=100.0)
        woke: list[tuple[str, float]] = []

        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append((name, clock.now()))
            if name == "a":  # a sleeper that sleeps again is woken by the same advance
                await clock.sleep(1.0)
                woke.append(("a2", clock.now()))

        tasks = [asyncio.ensure_future(sleeper(n, s)) for n, s in (("c", 3.0), ("a", 1.0), ("b", 2.0), ("b2", 2.0))]
        await asyncio.sleep(0)
        assert clock.next_deadline() == 101.0 and clock.num_sleepers == 4
        started = time.monotonic()
        await clock.advance(2.5)
        assert woke == [("a", 101.0), ("b", 102.0), ("b2", 102.0), ("a2", 102.0)]
        assert clock.now() == 102.5
        await clock.advance_to(103.0)
        assert woke[-1] == ("c", 103.0)
        assert time.monotonic() - started < 1.0
        assert clock.next_deadline() is None
        await asyncio.gather(*tasks)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_virtual_clock_skips_cancelled_sleepers_and_refuses_to_go_back():
    async def scenario():
        clock = VirtualClock()
        task = asyncio.ensure_future(clock.sleep(5.0))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        assert clock.next_deadline() is None
        with pytest.raises(ValueError, match="backwards"):
            await clock.advance(-1.0)
        with pytest.raises(ValueError, match="backwards"):
            await clock.advance_to(-1.0)
        await clock.sleep(0)  # zero sleeps just yield
        assert clock.now() == 0.0

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_real_clock_sleeps_for_real():
    async def scenario():
        clock = RealClock()
        t0 = clock.now()
        await clock.sleep(0.02)
        assert clock.now() - t0 >= 0.015

    asyncio.run(asyncio.wait_for(scenario(), 10))
