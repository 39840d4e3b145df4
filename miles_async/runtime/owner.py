"""The owner's side of supervision: records of spawned actors, restarts, child processes.

When an actor dies (its tell handler raised, its restart's `on_start` failed, or its process
exited), the system that spawned it hears of it here: from its own hosting code, from a
`ChildDied` message sent by a child process, or from the process's sentinel. The `RestartPolicy`
then decides: restart in place (`RestartActor` to a live child process), respawn the process at
the same address (refs stay valid), or leave it dead (and, with `escalate`, crash the owner).

The supervisor works on its system through `SupervisorHost`, a seam of public methods that
`ActorSystem` implements, so that this module stays below system.py.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

from miles_async.runtime import child, segments, wire
from miles_async.runtime.actor import Actor, ActorHost
from miles_async.runtime.errors import (
    ActorDeadError,
    ActorError,
    AskTimeoutError,
    Failure,
    RemoteError,
    SpawnError,
)
from miles_async.runtime.messages import ActorAddress, ChildReady, RestartActor, ShutdownSystem
from miles_async.runtime.supervision import RestartPolicy

log = logging.getLogger("miles_async.runtime")

STARTING, RUNNING, RESTARTING, DEAD, STOPPING, STOPPED = "starting", "running", "restarting", "dead", "stopping", "stopped"
SYSTEM_ACTOR = "$system"


class Child:
    """The owner's record of an actor it spawned (here or in a child process)."""

    __slots__ = (
        "address",
        "args",
        "capacity",
        "cls",
        "env",
        "exited",
        "kwargs",
        "name",
        "owner",
        "policy",
        "process",
        "ready",
        "reported",
        "restarts",
        "state",
    )

    def __init__(self, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any], owner: str,
                 policy: RestartPolicy, process: bool, capacity: int, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.env = dict(env or {})  # set in the child process before its actor is built
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.owner = owner
        self.policy = policy
        self.process: multiprocessing.process.BaseProcess | None = None if not process else NOT_STARTED
        self.address = ""
        self.capacity = capacity
        self.restarts: list[float] = []
        self.state = STARTING
        self.ready: asyncio.Future[str] | None = None
        self.reported: Failure | None = None  # what the child said before its process exited
        self.exited: asyncio.Future[None] | None = None


NOT_STARTED: Any = object()


class SupervisorHost(ActorHost, Protocol):
    """What a `Supervisor` needs of its `ActorSystem` beyond an actor's view (the one
    implementation; see its docstrings)."""

    @property
    def closing(self) -> bool: ...

    @property
    def key_dir(self) -> str | None: ...

    @property
    def directory_address(self) -> str: ...

    def run_background(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    async def start_hosted(self, name: str) -> None: ...

    async def stop_hosted(self, name: str, reason: str) -> None: ...

    def crash_hosted(self, name: str, failure: Failure, *, failed_start: bool = False) -> None: ...

    def unregister(self, name: str) -> None: ...

    def on_peer_ready(self, address: str) -> None: ...

    def on_peer_exit(self, address: str, cause: Failure, *, expected: bool = False) -> None: ...


class Supervisor:
    """The records of every actor a system spawned, and what happens when one dies.

    `serve` is what a child process runs once started (`ChildSpec.serve`: `system.serve_child`).
    """

    def __init__(self, system: SupervisorHost, serve: Callable[[child.ChildSpec], Coroutine[Any, Any, int]]) -> None:
        self.system = system
        self.serve = serve
        self.children: dict[str, Child] = {}
        self.watchers: dict[str, list[asyncio.Future[Failure]]] = {}  # `ActorSystem.watch`, by child name

    def watch(self, rec: Child) -> asyncio.Future[Failure]:
        """A future resolved with the cause once `rec` is dead for good (its policy gave up)."""
        fut: asyncio.Future[Failure] = self.system.loop.create_future()
        if rec.state is DEAD:
            fut.set_result(rec.reported or wire.problem("ActorDead", f"actor {rec.name!r} is dead"))
        else:
            self.watchers.setdefault(rec.name, []).append(fut)
        return fut

    def _dead(self, rec: Child, failure: Failure) -> None:
        rec.state = DEAD
        for fut in self.watchers.pop(rec.name, []):
            if not fut.done():
                fut.set_result(failure)

    def on_child_died(self, name: str, failure: Failure) -> None:
        rec = self.children.get(name)
        if rec is None or rec.state in (STOPPING, STOPPED, DEAD):
            return
        if rec.process is not None:
            rec.reported = failure
        if rec.ready is not None and not rec.ready.done():  # it died while (re)starting
            rec.ready.set_exception(SpawnError(name, failure))
            return
        now = self.system.loop.time()
        delay = None if self.system.closing else rec.policy.next_delay(rec.restarts, now)
        if delay is None:
            self._dead(rec, failure)
            log.error("actor %r died and will not be restarted: %s", name, failure.describe())
            if rec.process not in (None, NOT_STARTED):
                self.system.run_background(self.stop_child(rec, final_state=DEAD))
            if rec.policy.escalate:  # an owner in this process (a system actor is never crashed)
                self.system.crash_hosted(rec.owner, Failure(type="ChildFailed", message=f"child actor {name!r} died: "
                                         f"{failure.type}: {failure.message}", traceback=failure.traceback))
            return
        rec.state = RESTARTING
        rec.restarts.append(now)
        log.warning("actor %r died (%s: %s); restarting in %.2fs", name, failure.type, failure.message, delay)
        self.system.loop.call_later(delay, lambda: self.system.run_background(self.restart(rec)))

    async def restart(self, rec: Child) -> None:
        if rec.state is not RESTARTING or self.system.closing:
            return
        try:
            if rec.process is None:
                await self.system.start_hosted(rec.name)
            elif rec.process.is_alive():
                host = self.system.ref(ActorAddress(name=SYSTEM_ACTOR, address=rec.address, capacity=1024))
                await host.ask(RestartActor(name=rec.name), timeout_s=self.system.config.spawn_timeout_s)
            else:
                await self.start_process(rec)
        except SpawnError as exc:
            rec.state = RUNNING  # so that the failure below is judged by the policy
            if rec.process is None:
                self.system.crash_hosted(rec.name, exc.cause, failed_start=True)
            else:
                self.on_child_died(rec.name, exc.cause)
            return
        except (ActorDeadError, AskTimeoutError, RemoteError) as exc:
            rec.state = RUNNING
            self.on_child_died(rec.name, Failure.from_exception(exc))
            return
        rec.state = RUNNING
        rec.reported = None  # that crash is dealt with; a later death has a cause of its own
        log.info("actor %r restarted", rec.name)

    async def stop_children_of(self, owner: str) -> None:
        for rec in reversed([r for r in self.children.values() if r.owner == owner]):
            await self.stop_child(rec)

    async def stop_child(self, rec: Child, final_state: str = STOPPED) -> None:
        if rec.state is STOPPED:
            return
        rec.state = STOPPING
        if rec.process is None:
            await self.system.stop_hosted(rec.name, "stopped by its owner")
        elif rec.process is not NOT_STARTED:
            await self.stop_process(rec)
            self.system.unregister(rec.name)
        rec.state = final_state

    # -- child processes --------------------------------------------------------------------

    async def start_process(self, rec: Child) -> None:
        if rec.address:
            bind = rec.address  # a restart binds where the refs point
        elif self.system.config.transport == "ipc":
            bind = f"ipc://{wire.ipc_path(self.system.run_dir, 'actor-' + rec.name)}"
        else:
            bind = f"tcp://{self.system.config.host}:*"
        spec = child.ChildSpec(
            name=rec.name, cls=rec.cls, args=rec.args, kwargs=rec.kwargs, owner=rec.owner,
            owner_address=self.system.address, directory=self.system.directory_address, bind=bind,
            config=self.system.config, key_dir=self.system.key_dir, sys_path=list(sys.path),
            log_level=logging.getLogger().getEffectiveLevel(), serve=self.serve, env=rec.env,
            environ=dict(os.environ), owner_pid=os.getpid(), run_tag=segments.run_tag())
        rec.ready = self.system.loop.create_future()
        rec.exited = self.system.loop.create_future()
        rec.reported = None

        def start() -> multiprocessing.process.BaseProcess:
            # the spec travels pickled inside the arguments, so that the child names its process
            # before unpickling it imports the actor's module (child.main)
            process = child.context(self.system.config).Process(
                target=child.main, args=(rec.name, bytes(ForkingPickler.dumps(spec))), name=f"miles-async:{rec.name}")
            process.start()
            return process

        proc = await asyncio.to_thread(start)  # pickling and spawning take a while; keep the loop free
        rec.process = proc
        self.system.loop.add_reader(proc.sentinel, self.on_process_exit, rec, proc)
        try:
            rec.address = await asyncio.wait_for(asyncio.shield(rec.ready), self.system.config.spawn_timeout_s)
        except asyncio.TimeoutError:
            rec.ready.cancel()  # nobody waits for it any more
            await self.stop_process(rec)
            raise SpawnError(rec.name, wire.problem(
                "SpawnTimeout", f"child process did not start actor {rec.name!r} within "
                f"{self.system.config.spawn_timeout_s:g}s")) from None
        self.system.on_peer_ready(rec.address)

    def on_peer_lost(self, address: str, cause: Failure) -> None:
        """A child process stopped answering (hung, or stopped by a signal): kill it, so that its
        exit goes through the restart policy like any other death."""
        for rec in self.children.values():
            proc = rec.process
            if rec.address == address and proc not in (None, NOT_STARTED) and proc.is_alive():
                log.error("actor %r stopped answering; killing its process (pid %s)", rec.name, proc.pid)
                rec.reported = cause
                proc.kill()

    def on_child_ready(self, msg: ChildReady) -> None:
        rec = self.children.get(msg.name)
        if rec is not None and rec.ready is not None and not rec.ready.done():
            rec.ready.set_result(msg.address)

    def on_process_exit(self, rec: Child, proc: multiprocessing.process.BaseProcess) -> None:
        self.system.loop.remove_reader(proc.sentinel)
        self.system.run_background(self._reaped(rec, proc))

    async def _reaped(self, rec: Child, proc: multiprocessing.process.BaseProcess) -> None:
        # The sentinel pipe closes a moment before the process can be reaped: wait for its status.
        for _ in range(200):
            proc.join(0)
            if proc.exitcode is not None:
                break
            await asyncio.sleep(0.005)
        code = proc.exitcode
        if code is not None:  # the shared-memory segments a killed child could not unlink; at once,
            assert proc.pid is not None  # it exited, so it was started and has a pid
            self.system.dataplane.reap_process(proc.pid)  # before its pid is handed out again
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        if rec.state is STOPPING and rec.reported is None:
            cause = wire.problem("ActorStopped", f"actor {rec.name!r} was stopped")
        else:
            cause = rec.reported or wire.problem(
                "ProcessExited", f"the process of actor {rec.name!r} (pid {proc.pid}) {how}")
        if rec.address:
            self.system.on_peer_exit(rec.address, cause, expected=rec.state is STOPPING)
        if rec.exited is not None and not rec.exited.done():
            rec.exited.set_result(None)
        if rec.ready is not None and not rec.ready.done():
            rec.ready.set_exception(SpawnError(rec.name, cause))
            return
        if rec.state is RUNNING and code == 0 and rec.reported is None:
            rec.state = STOPPED  # a clean exit is a stop (e.g. `stop` sent to it by another process)
            self.system.unregister(rec.name)
        elif rec.state is RUNNING:
            self.on_child_died(rec.name, cause)

    async def stop_process(self, rec: Child) -> None:
        proc = rec.process
        if proc is None or proc is NOT_STARTED or rec.exited is None:
            return
        asked = False
        if not rec.exited.done() and rec.address:
            host = self.system.ref(ActorAddress(name=SYSTEM_ACTOR, address=rec.address, capacity=1024))
            try:
                host.tell_nowait(ShutdownSystem())
                asked = True
            except ActorError as exc:  # already gone or unreachable: escalate to signals below
                log.debug("could not ask %r to shut down: %s", rec.name, exc)
        # a process still starting (no address yet) has nothing to stop cleanly: signalled at once
        steps = ((None, self.system.config.stop_grace_s + 2.0),) if asked else ()
        for sig_fn, wait_s in (*steps, (proc.terminate, 3.0), (proc.kill, 3.0)):
            if rec.exited.done():
                break
            if sig_fn is not None:
                sig_fn()
            try:
                await asyncio.wait_for(asyncio.shield(rec.exited), wait_s)
            except asyncio.TimeoutError:
                log.warning("process of actor %r did not exit within %.1fs", rec.name, wait_s)
