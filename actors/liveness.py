"""Liveness of a run's processes, from the runtime's supervision (no polling).

    ActorSystem.watch(ref) ─ resolves with the cause when the actor is dead for good: its owner's
                             supervisor gave up on it, or (not ours) its process's link was lost
                             (exit, heartbeat timeout)
        engine ──► Liveness: it leaves the fleet: the scheduler moves its samples, the pusher
                   forgets it, the session server routes no session to it; none left: the run stops
        scheduler, buffer, session server, sample recorder, trainer rank ──► `lost` gets the death:
                   the step waiting for data raises it and the run ends naming the role

Use: `async with Liveness(fleet, stop) as liveness: ...` around the RL loop (it watches the fleet's
engines and roles at entry; `watch_engine` adds one that joins later).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from miles_async.actors.scheduler import EngineLost
from miles_async.actors.sessions import RemoveSessionEngine
from miles_async.actors.weights import ForgetEngine
from miles_async.runtime import ActorDeadError, ActorError, ActorRef, Failure

if TYPE_CHECKING:
    from typing_extensions import Self

    from miles_async.actors.fleet import Fleet

log = logging.getLogger("miles_async.actors.liveness")
ASK_S = 600.0


class Liveness:
    """Watches the fleet (module docstring); `lost` is a future that fails with the death of a
    process the run cannot go on without."""

    def __init__(self, fleet: Fleet, stop: asyncio.Event) -> None:
        self.fleet = fleet
        self.stop = stop
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        for ref in self.fleet.engines:
            self.watch_engine(ref)
        trainer = self.fleet.trainer.refs if self.fleet.trainer is not None else []
        for role in (self.fleet.scheduler, self.fleet.buffer, self.fleet.sessions, *trainer):
            if role is not None:
                self._watch(role, self._role_died)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self.lost.done():
            self.lost.cancel()
        elif not self.lost.cancelled():
            self.lost.exception()  # the same death usually surfaces first elsewhere (a trainer ask)

    def watch_engine(self, ref: ActorRef) -> None:
        self._watch(ref, self._engine_died)

    def _watch(self, ref: ActorRef, on_death: Any) -> None:
        async def wait() -> None:
            failure = await self.fleet.system.watch(ref)
            await on_death(ref, failure)

        task = asyncio.ensure_future(wait())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _role_died(self, ref: ActorRef, failure: Failure) -> None:
        log.error("%s is gone (%s: %s): the run cannot go on", ref.name, failure.type, failure.message)
        if not self.lost.done():
            self.lost.set_exception(ActorDeadError(ref.name, failure))

    async def _engine_died(self, ref: ActorRef, failure: Failure) -> None:
        fleet = self.fleet
        if ref not in fleet.engines:
            return
        log.error("engine %s is gone (%s: %s); its samples go to the other engines", ref.name, failure.type,
                  failure.message)
        fleet.engines.remove(ref)
        try:
            if fleet.scheduler is not None:
                await fleet.scheduler.tell(EngineLost(name=ref.name))
            if fleet.pusher is not None:
                await fleet.pusher.ask(ForgetEngine(name=ref.name), timeout_s=ASK_S)
            if fleet.sessions is not None:
                await fleet.sessions.ask(RemoveSessionEngine(url=fleet.engine_urls[ref.name]), timeout_s=ASK_S)
        except ActorError as e:  # a role died too: its own watcher ends the run
            log.warning("could not tell the run that %s is gone: %s", ref.name, e)
        if not fleet.engines:
            log.error("no engine left: stopping the run")
            self.stop.set()
