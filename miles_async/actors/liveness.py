"""Liveness of a run's processes, from the runtime's supervision (no polling), and engines coming back.

    ActorSystem.watch(ref) ─ resolves with the cause when the actor is dead for good: its owner's
                             supervisor gave up on it, or (not ours) its process's link was lost
                             (exit, heartbeat timeout)
        engine ──► Liveness: it leaves the fleet: the scheduler moves its samples, the pusher
                   forgets it, the session server routes no session to it ("lost"); then, within
                   `[rollout.restart]` (a `RestartBudget`: limit per window, doubling backoff), it
                   is started again after its backoff:
                   due ──► the controller, between two steps ──► `restart_engine`: `Fleet.respawn`
                   (a new process, same name and node: "restarted") ──► `Fleet.join` (the current
                   weights through a pusher of its own, verified as any push; then the run's
                   pusher, the scheduler, the session server: "serving")
                   past the limit, or its node lost ("gone"), it stays dead; with no engine left
                   and none coming back, `no_engine_left` is set and `stop` too: the run writes
                   its step down, saves a checkpoint and ends with that cause
        scheduler, buffer, session server, sample recorder, trainer rank ──► `lost` gets the death:
                   the step waiting for data raises it and the run ends naming the role

Every engine event is a trace record (`observe.EngineTrace`: serving, lost, restarted, gone). An
engine on another node whose node's agent does not answer is not restarted here: when the node is
back (`launch.launcher.watch_nodes`) or relaunched, `Fleet.admit` brings fresh engines.

Use: `async with Liveness(fleet, stop, ...) as liveness: ...` around the RL loop (it watches the
fleet's engines and roles at entry; `joined` adds an engine that joins later). Try it:
`tests/unit/test_engine_restarts.py`, `tests/e2e/test_engine_restart.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from miles_async.actors.engine import EngineStatus
from miles_async.actors.scheduler import EngineLost
from miles_async.actors.sessions import RemoveSessionEngine
from miles_async.actors.weights import ForgetEngine
from miles_async.observe import EngineTrace, TraceLog
from miles_async.runtime import (
    ActorDeadError,
    ActorError,
    ActorRef,
    AskTimeoutError,
    Failure,
    RestartBudget,
    RestartPolicy,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from miles_async.actors.fleet import Fleet

log = logging.getLogger("miles_async.actors.liveness")
ASK_S = 600.0
Push = Callable[[ActorRef], Awaitable[None]]  # pushes the current weights through the pusher given


class NoEngineLeftError(RuntimeError):
    """Every rollout engine is dead for good (restart limit reached, restarts off, or their nodes
    lost): no more samples can come. The message names the last one and why."""


class Liveness:
    """Watches the fleet and restarts its engines (module docstring). `lost` is a future that fails
    with the death of a process the run cannot go on without; `no_engine_left`, once `stop` is set
    for want of engines, says why.

    `restart`: the engines' restart policy (`EngineRestartConfig.policy()`); `due(name)`: called
    when an engine's backoff is over (the controller calls `restart_engine` between two steps);
    `trace`, `now`: where engine events are recorded and their clock; `version`: the weight
    version the engines serve at entry."""

    def __init__(self, fleet: Fleet, stop: asyncio.Event, *, restart: RestartPolicy | None = None,
                 due: Callable[[str], None] | None = None, trace: TraceLog | None = None,
                 now: Callable[[], float] | None = None, version: int = 0) -> None:
        self.fleet = fleet
        self.stop = stop
        self.loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.budget = RestartBudget(restart or RestartPolicy())
        self.due = due
        self.trace = trace
        self.now = now or self.loop.time
        self.version = version
        self.restarting: set[str] = set()  # engines waiting for their backoff or being restarted
        self.no_engine_left: NoEngineLeftError | None = None  # set when it stopped the run for want of engines
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}  # engine -> the end of its backoff

    async def __aenter__(self) -> Self:
        for ref in self.fleet.engines:
            self.watch_engine(ref)
            self._record(ref.name, "serving", version=self.version, pid=await self._pid(ref))
        trainer = self.fleet.trainer.refs if self.fleet.trainer is not None else []
        for role in (self.fleet.scheduler, self.fleet.buffer, self.fleet.sessions, self.fleet.teacher,
                     self.fleet.teacher_scorer, *trainer):
            if role is not None:
                self._watch(role, self._role_died)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self.lost.done():
            self.lost.cancel()
        elif not self.lost.cancelled():
            self.lost.exception()  # the same death usually surfaces first elsewhere (a trainer ask)

    def watch_engine(self, ref: ActorRef) -> None:
        self._watch(ref, self._engine_died)

    async def joined(self, ref: ActorRef, version: int) -> None:
        """An engine that joined the running job (a node's, `Fleet.admit`) serves from `version`."""
        self.watch_engine(ref)
        self._record(ref.name, "serving", version=version, pid=await self._pid(ref))

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

    # ----- an engine leaving -----

    async def _engine_died(self, ref: ActorRef, failure: Failure) -> None:
        fleet = self.fleet
        if ref not in fleet.engines:
            return
        log.error("engine %s is gone (%s: %s); its samples go to the other engines", ref.name, failure.type,
                  failure.message)
        fleet.engines.remove(ref)
        self._record(ref.name, "lost", cause=f"{failure.type}: {failure.message}")
        try:
            if fleet.scheduler is not None:
                await fleet.scheduler.tell(EngineLost(name=ref.name))
            if fleet.pusher is not None:
                await fleet.pusher.ask(ForgetEngine(name=ref.name), timeout_s=ASK_S)
            if fleet.sessions is not None:
                await fleet.sessions.ask(RemoveSessionEngine(url=fleet.engine_urls[ref.name]), timeout_s=ASK_S)
        except ActorError as e:  # a role died too: its own watcher ends the run
            log.warning("could not tell the run that %s is gone: %s", ref.name, e)
        self._retry(ref.name, failure)

    def _retry(self, name: str, failure: Failure) -> None:
        """Restart `name` after its backoff, if its budget allows; else it is gone."""
        if self._replaced(name):
            return
        delay = self.budget.next_delay(name, self.loop.time())
        if delay is None:
            policy = self.budget.policy
            limit = (f"it was restarted {policy.max_restarts} time(s) within {policy.within_s:g}s "
                     "(rollout.restart.max_restarts)" if policy.mode != "never" else
                     "restarts are off (rollout.restart.max_restarts = 0)")
            self._gone(name, f"{failure.type}: {failure.message}; {limit}")
            return
        self.restarting.add(name)
        log.warning("engine %s: restart %d of %d in %.1fs", name, self.budget.recent(name, self.loop.time()),
                    self.budget.policy.max_restarts, delay)
        self._timers[name] = self.loop.call_later(delay, self._due, name)

    def _replaced(self, name: str) -> bool:
        """Whether `name`'s node joined again since it started (it is gone then: fresh engines took its place)."""
        if not self.fleet.replaced(name):
            return False
        self._gone(name, f"its node {self.fleet.engine_homes[name].node} joined again: fresh engines took its place")
        return True

    def _due(self, name: str) -> None:
        self._timers.pop(name, None)
        if self.due is not None:
            self.due(name)

    def _gone(self, name: str, why: str) -> None:
        self.restarting.discard(name)
        log.error("engine %s died and will not be restarted: %s", name, why)
        self._record(name, "gone", cause=why)
        if not self.fleet.engines and not self.restarting and self.no_engine_left is None:
            self.no_engine_left = NoEngineLeftError(f"every rollout engine is dead: the last, {name}, {why}")
            log.error("no engine left: stopping the run")
            self.stop.set()

    # ----- an engine coming back -----

    async def restart_engine(self, name: str, version: int, push: Push) -> None:
        """Start engine `name` again and have it join at weight `version` (`Fleet.respawn`, `Fleet.join`).
        Call it between steps, with no weight update in flight. A failure counts as another death."""
        fleet = self.fleet
        node = fleet.engine_homes[name].node
        if self._replaced(name):
            return
        try:
            ref = await fleet.respawn(name)
        except (ActorDeadError, AskTimeoutError) as e:
            if node != 0:  # the node's agent does not answer: the node is lost, and brings fresh engines when back
                self._gone(name, f"its node {node} does not answer ({e}); fresh engines start when the node is back")
            else:
                self._retry(name, Failure.from_exception(e))
            return
        except Exception as e:  # noqa: BLE001 - a process boundary: the engine could not start (SpawnError, ...)
            log.error("engine %s could not start again: %s", name, e)
            self._retry(name, Failure.from_exception(e))
            return
        self._record(name, "restarted", pid=await self._pid(ref))
        try:
            await fleet.join(ref, version, push)
        except Exception as e:  # noqa: BLE001 - a process boundary: it died or failed on its way in
            log.error("engine %s started again but could not join the run: %s", name, e)
            with contextlib.suppress(ActorError):
                await fleet.system.stop(ref)
            self._retry(name, Failure.from_exception(e))
            return
        self.restarting.discard(name)
        self.watch_engine(ref)
        self._record(name, "serving", version=version, pid=await self._pid(ref))
        log.warning("engine %s is back: serves from weight version %d", name, version)

    # ----- records -----

    def _record(self, name: str, event: str, *, version: int = -1, cause: str = "", pid: int = 0) -> None:
        if self.trace is not None:
            self.trace.write(EngineTrace(engine=name, time_s=self.now(), event=event, weight_version=version,
                                         cause=cause, pid=pid))

    async def _pid(self, ref: ActorRef) -> int:
        try:
            return (await ref.ask(EngineStatus(), timeout_s=30.0)).pid
        except ActorError:  # gone again already: its death is seen by its watch
            return 0
