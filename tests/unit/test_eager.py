"""Handlers start inline; only those that suspend become Tasks, and behave exactly like Tasks."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.runtime.eager import PENDING, start


def test_a_handler_that_does_not_suspend_finishes_inline():
    async def handler() -> int:
        return 7

    async def scenario():
        value, task = start(handler())
        assert (value, task) == (7, None)

    asyncio.run(scenario())


def test_a_suspended_handler_continues_as_a_task_with_results_errors_and_cancellation():
    async def slow(gate: asyncio.Event, fail: bool) -> str:
        await gate.wait()
        await asyncio.sleep(0)  # a bare yield after the first suspension
        if fail:
            raise KeyError("late")
        return "done"

    async def forever(log: list[str]) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            log.append("cancelled inside")
            raise

    async def scenario():
        gate = asyncio.Event()
        value, ok = start(slow(gate, False))
        _, bad = start(slow(gate, True))
        assert value is PENDING and ok is not None and not ok.done()
        gate.set()
        assert await ok == "done"
        with pytest.raises(KeyError, match="late"):
            await bad
        log: list[str] = []
        _, stuck = start(forever(log))
        await asyncio.sleep(0)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        assert log == ["cancelled inside"]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_errors_of_the_first_step_reach_the_caller():
    async def broken() -> None:
        raise ValueError("at once")

    async def scenario():
        with pytest.raises(ValueError, match="at once"):
            start(broken())

    asyncio.run(scenario())
