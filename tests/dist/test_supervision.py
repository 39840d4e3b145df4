"""Supervision across processes: killed and crashed process actors, restarts, owner trees."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from _actors import Add, Counter, Crash, Family, Get, Parent, Pid, Sleep, Stats
from _support import TRANSPORTS, ask_until_ok, config, raises_within, scenario, signal_if_alive, wait_pid_gone

from miles_async.runtime import (
    ActorDeadError,
    ActorRef,
    ActorSystem,
    RestartPolicy,
    SpawnError,
    UnknownActorError,
)

TIMEOUT_S = 60.0
FAST_HEARTBEATS = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}
DEATH_SEEN_S = 2.0  # a killed child's sentinel wakes the owner at once; this is slack for load


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_fails_pending_and_later_asks(transport: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=config(transport)) as system:
            ref = await system.spawn(Counter, "victim", process=True)
            pid = await ref.ask(Pid())
            pending = ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0)
            await ref.ask(Get())  # answered after the Sleep arrived (FIFO), so the kill finds it running
            os.kill(pid, signal.SIGKILL)

            err, took_s = await raises_within(pending, DEATH_SEEN_S)
            assert isinstance(err, ActorDeadError), repr(err)
            assert took_s < DEATH_SEEN_S
            assert err.cause.type == "ProcessExited" and str(pid) in err.cause.message
            assert "SIGKILL" in err.cause.message and "SIGKILL" in str(err)

            with pytest.raises(ActorDeadError) as later:  # policy "never": it stays dead
                await ref.ask(Get(), timeout_s=5.0)
            assert later.value.cause == err.cause
            await wait_pid_gone(pid, 5.0)
            await wait_unknown(system, "victim", 5.0)

    scenario(main, TIMEOUT_S)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkilled_process_actor_restarts_at_the_same_ref(transport: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=config(transport)) as system:
            policy = RestartPolicy(mode="on_failure", backoff_s=0.05)
            ref = await system.spawn(Counter, "phoenix", kwargs={"start": 7}, process=True, restart=policy)
            pid = await ref.ask(Pid())
            assert await ref.ask(Add(amount=1)) == 8
            pending = ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0)
            await ref.ask(Get())
            os.kill(pid, signal.SIGKILL)

            err, _ = await raises_within(pending, DEATH_SEEN_S)
            assert isinstance(err, ActorDeadError) and err.cause.type == "ProcessExited"
            assert "SIGKILL" in err.cause.message

            new_pid = await ask_until_ok(ref, Pid(), timeout_s=30.0)
            assert new_pid != pid
            assert await ref.ask(Get()) == 7  # a fresh instance, same name and address
            assert await ref.ask(Add(amount=2)) == 9
            found = await system.lookup("phoenix")
            assert found == ref and await found.ask(Pid()) == new_pid

    scenario(main, TIMEOUT_S)


NUM_VICTIMS = 6


def test_sigkill_cause_names_the_signal() -> None:
    # The sentinel pipe closes a moment before the process can be reaped: an owner that reads the
    # exit status too early reports "exited with code None". Kill several, one at a time.
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            names = [f"victim{i}" for i in range(NUM_VICTIMS)]
            refs = await asyncio.gather(*(system.spawn(Counter, n, process=True) for n in names))
            pids = await asyncio.gather(*(ref.ask(Pid()) for ref in refs))
            pending = [ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0) for ref in refs]
            await asyncio.gather(*(ref.ask(Get()) for ref in refs))
            causes = []
            for pid, fut in zip(pids, pending):  # one at a time: the owner reacts at once to each
                os.kill(pid, signal.SIGKILL)
                err, _ = await raises_within(fut, DEATH_SEEN_S * 2)
                assert isinstance(err, ActorDeadError), repr(err)
                causes.append(err.cause.message)
            assert all("killed by signal SIGKILL" in c for c in causes), causes

    scenario(main, TIMEOUT_S)


def test_crashing_tell_restarts_in_place_then_gives_up() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            policy = RestartPolicy(mode="on_failure", max_restarts=1, backoff_s=0.05)
            ref = await system.spawn(Counter, "fragile", kwargs={"start": 100}, process=True, restart=policy)
            first = await ref.ask(Stats())
            assert await ref.ask(Add(amount=5)) == 105

            await ref.tell(Crash(text="first crash"))
            # restarted in place: the same process builds a fresh instance from the constructor
            again = await ask_until_ok(ref, Stats(), timeout_s=20.0)
            assert again.pid == first.pid
            assert again.incarnation == first.incarnation + 1
            assert again.count == 100
            assert await ref.ask(Add(amount=1)) == 101

            await ref.tell(Crash(text="second crash"))  # past max_restarts: it stays dead
            err = await _dead_within(ref, 20.0)
            assert err.cause.type == "RuntimeError", err.cause
            assert "second crash" in err.cause.message
            await wait_pid_gone(first.pid, 15.0)  # a dead process actor's process is reaped
            with pytest.raises(ActorDeadError) as later:
                await ref.ask(Get(), timeout_s=5.0)
            assert "second crash" in later.value.cause.message
            await wait_unknown(system, "fragile", 5.0)

    scenario(main, TIMEOUT_S)


def test_a_kill_after_an_in_place_restart_is_blamed_on_the_kill() -> None:
    # the first crash is dealt with by the restart; it must not be reported as the later death's cause
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            policy = RestartPolicy(mode="on_failure", max_restarts=1, backoff_s=0.05)
            ref = await system.spawn(Counter, "twice", process=True, restart=policy)
            pid = await ref.ask(Pid())
            await ref.tell(Crash(text="old crash"))
            assert (await ask_until_ok(ref, Stats(), timeout_s=20.0)).pid == pid  # restarted in place
            pending = ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0)
            await ref.ask(Get())
            os.kill(pid, signal.SIGKILL)
            err, _ = await raises_within(pending, DEATH_SEEN_S)
            assert isinstance(err, ActorDeadError)
            assert err.cause.type == "ProcessExited" and "old crash" not in err.cause.message, err.cause

    scenario(main, TIMEOUT_S)


@pytest.mark.parametrize("crash_first", [False, True], ids=["fresh", "after_in_place_restart"])
def test_a_stop_from_another_process_is_final(crash_first: bool) -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            policy = RestartPolicy(mode="on_failure", backoff_s=0.05)
            ref = await system.spawn(Counter, "stoppable", process=True, restart=policy)
            pid = await ref.ask(Pid())
            if crash_first:
                await ref.tell(Crash(text="old crash"))
                assert (await ask_until_ok(ref, Stats(), timeout_s=20.0)).pid == pid  # restarted in place
            async with ActorSystem("peer", config=config("ipc"), directory=system.address) as peer:
                await peer.lookup("stoppable")
                await peer.stop("stoppable", timeout_s=10.0)
            await wait_pid_gone(pid, 15.0)
            # a restart (after a 0.05s backoff) would answer within this second; a stop never does
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 1.0
            while loop.time() < deadline:
                with pytest.raises(ActorDeadError):
                    await ref.ask(Get(), timeout_s=2.0)
                await asyncio.sleep(0.05)
            await wait_unknown(system, "stoppable", 5.0)

    scenario(main, TIMEOUT_S)


def test_a_process_actor_named_like_its_system_breaks_nothing() -> None:
    # ipc sockets of systems and of process actors live in one run folder: names must not collide
    async def main() -> None:
        async with ActorSystem(config=config("ipc", spawn_timeout_s=5.0)) as system:
            assert system.name == "root"
            try:
                clash = await system.spawn(Counter, "root", process=True)
                assert await clash.ask(Get(), timeout_s=10.0) == 0
            except (ValueError, SpawnError) as exc:  # refusing the name is fine; breaking the system is not
                assert "root" in str(exc)
            other = await system.spawn(Counter, "other", process=True)
            assert await other.ask(Get(), timeout_s=10.0) == 0

    scenario(main, TIMEOUT_S)


def test_a_graceful_stop_fails_pending_asks_with_actor_dead() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc", stop_grace_s=0.5)) as system:
            ref = await system.spawn(Counter, "stopped", process=True)
            pid = await ref.ask(Pid())
            pending = ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0)
            await ref.ask(Get())
            await ref.stop()  # the running handler gets stop_grace_s, then is cancelled
            err, _ = await raises_within(pending, 5.0)
            assert isinstance(err, ActorDeadError), repr(err)
            assert err.cause.type == "ActorStopped", err.cause
            with pytest.raises(ActorDeadError):
                await ref.ask(Get(), timeout_s=5.0)
            await wait_pid_gone(pid, 10.0)
            await wait_unknown(system, "stopped", 5.0)

    scenario(main, TIMEOUT_S)


def test_a_crashed_owner_takes_its_child_process_down_and_restarts_with_a_new_one() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            policy = RestartPolicy(mode="on_failure", backoff_s=0.05)
            top = await system.spawn(Parent, "owner", process=True, restart=policy)
            top_pid, kid_pid = await top.ask(Family())
            await top.tell(Crash(text="owner crash"))
            try:
                await wait_pid_gone(kid_pid, 15.0)  # the crashed instance's child is stopped
            finally:
                signal_if_alive(kid_pid, signal.SIGKILL)
            new_top_pid, new_kid_pid = await ask_until_ok(top, Family(), timeout_s=30.0)
            assert new_top_pid == top_pid  # the owner restarted in place...
            assert new_kid_pid != kid_pid  # ...and its new on_start spawned a new child process
            kid = await system.lookup("owner-kid")
            assert await kid.ask(Pid()) == new_kid_pid

    scenario(main, TIMEOUT_S)


def test_stopping_an_owner_stops_its_grandchild_process() -> None:
    async def main() -> None:
        # a ref to a process this system did not spawn learns of its death by heartbeats
        async with ActorSystem(config=config("ipc", **FAST_HEARTBEATS)) as system:
            top = await system.spawn(Parent, "top", process=True)
            top_pid, kid_pid = await top.ask(Family())
            assert len({os.getpid(), top_pid, kid_pid}) == 3
            kid = await system.lookup("top-kid")
            assert await kid.ask(Pid()) == kid_pid
            try:
                await top.stop()
                await wait_pid_gone(kid_pid, 15.0)
                await wait_pid_gone(top_pid, 15.0)
            finally:
                signal_if_alive(kid_pid, signal.SIGKILL)
            with pytest.raises(ActorDeadError):
                await kid.ask(Pid(), timeout_s=10.0)
            await wait_unknown(system, "top-kid", 5.0)  # its owner's system unregistered it
            await wait_unknown(system, "top", 5.0)

    scenario(main, TIMEOUT_S)


def test_killing_a_middle_process_orphans_nothing() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc", **FAST_HEARTBEATS)) as system:
            top = await system.spawn(Parent, "middle", process=True)
            top_pid, kid_pid = await top.ask(Family())
            try:
                os.kill(top_pid, signal.SIGKILL)
                await wait_pid_gone(kid_pid, 5.0)  # the grandchild sees its parent gone and exits
            finally:
                signal_if_alive(kid_pid, signal.SIGKILL)

    scenario(main, TIMEOUT_S)


@pytest.mark.parametrize("ready", [False, True])
def test_closing_with_a_process_spawn_in_flight_or_never_messaged_stops_it(ready: bool) -> None:
    """The system closes (an error elsewhere) while a child is still starting, or has just started
    and was never messaged: close stops it (at once when it never became ready) and raises nothing."""
    pids: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError, match="elsewhere"):
            async with ActorSystem(config=config("ipc")) as system:
                spawn = asyncio.ensure_future(system.spawn(Counter, "late", process=True))
                if ready:
                    await spawn
                else:
                    await asyncio.sleep(0.05)
                    spawn.add_done_callback(lambda f: f.exception())  # it fails: stopped while starting
                pids.append(system.supervisor.children["late"].process.pid)
                started = loop.time()
                raise ValueError("a failure elsewhere")
        assert loop.time() - started < (5.0 if ready else 2.0)
        await wait_pid_gone(pids[0], 5.0)

    scenario(main, TIMEOUT_S)


async def wait_unknown(system: ActorSystem, name: str, timeout_s: float) -> None:
    """Poll the directory until `name` is gone from it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await system.lookup(name, timeout_s=5.0)
        except UnknownActorError:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{name!r} is still in the directory {timeout_s:g}s after it stopped")
        await asyncio.sleep(0.02)


async def _dead_within(ref: ActorRef, timeout_s: float) -> ActorDeadError:
    """Ask until the actor is reported dead (a restart may still be under way)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await ref.ask(Get(), timeout_s=2.0)
        except ActorDeadError as exc:
            return exc
        await asyncio.sleep(0.02)
    raise AssertionError(f"{ref.name!r} still answers {timeout_s:g}s after its last allowed crash")
