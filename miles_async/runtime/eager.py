"""Run a handler's first step inline, and pay for an asyncio Task only if it suspends.

Most handlers finish without awaiting anything that blocks (an echo, a counter, a buffer put);
creating a Task for each would cost more than the handler. `start(coro)` steps the coroutine
once: a finished one returns its value at once, a suspended one is handed to a Task that picks
it up where it stopped (the idea of Python 3.12's eager tasks, available on 3.10 and 3.11).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

PENDING = object()  # returned by `start` in place of a value when the handler suspended


def start(coro: Coroutine[Any, Any, Any]) -> tuple[Any, asyncio.Task[Any] | None]:
    """Step `coro` once. Returns (value, None) if it finished, (PENDING, task) if it suspended.

    Exceptions raised by the first step propagate to the caller.
    """
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value, None
    return PENDING, asyncio.get_running_loop().create_task(_continue(coro, yielded))


async def _continue(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _Resume(coro, yielded)


class _Resume:
    """Awaitable that re-yields what `coro` yielded to the Task, then keeps driving `coro`.

    Re-yielding the same future keeps its `_asyncio_future_blocking` flag, so the Task waits on
    it exactly as if `coro` had yielded it itself; cancellation is thrown into `coro`.
    """

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.yielded
        self.yielded = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded into the handler, not swallowed
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value

