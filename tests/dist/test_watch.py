"""`ActorSystem.watch`: liveness from supervision, for an owner and for a system that only knows a ref."""

from __future__ import annotations

import asyncio
import os
import signal

from _actors import Add, Counter, Crash, Pid
from _support import ask_until_ok, config, scenario

from miles_async.runtime import ActorSystem, RestartPolicy

TIMEOUT_S = 60.0
SEEN_S = 5.0  # a killed child's sentinel wakes its owner at once; slack for a loaded machine


def test_an_owner_sees_a_killed_child_dead_and_a_restarting_one_only_when_its_policy_gives_up() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            plain = await system.spawn(Counter, "plain", process=True)
            watch = system.watch(plain)
            os.kill(await plain.ask(Pid()), signal.SIGKILL)
            failure = await asyncio.wait_for(watch, SEEN_S)
            assert failure.type == "ProcessExited" and "SIGKILL" in failure.message
            assert (await asyncio.wait_for(system.watch(plain), SEEN_S)).type == "ProcessExited"  # already dead

            policy = RestartPolicy(mode="on_failure", backoff_s=0.05, max_restarts=1, within_s=60.0)
            phoenix = await system.spawn(Counter, "phoenix", process=True, restart=policy)
            watch = system.watch(phoenix)
            os.kill(await phoenix.ask(Pid()), signal.SIGKILL)  # restarted: not a death
            assert await ask_until_ok(phoenix, Add(amount=2), 30.0) == 2
            assert not watch.done()
            await phoenix.tell(Crash(text="twice"))  # past the limit: dead for good
            failure = await asyncio.wait_for(watch, SEEN_S)
            assert failure.type == "RuntimeError" and "twice" in failure.message

    scenario(main, TIMEOUT_S)


def test_a_system_that_did_not_spawn_an_actor_sees_it_dead_when_its_process_link_is_lost() -> None:
    async def main() -> None:
        fast = config("ipc", heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
        async with ActorSystem("owner", config=fast) as owner:
            ref = await owner.spawn(Counter, "remote", process=True)
            async with ActorSystem("watcher", config=fast, directory=owner.address) as watcher:
                seen = await watcher.lookup("remote", timeout_s=10.0)
                assert await seen.ask(Add(amount=1)) == 1  # the link is up
                watch = watcher.watch(seen)
                os.kill(await ref.ask(Pid()), signal.SIGKILL)
                failure = await asyncio.wait_for(watch, SEEN_S)
                assert failure.type in ("PeerLost", "ProcessExited"), failure
                cancelled = watcher.watch(seen)  # a watch of the dead resolves at once
                assert cancelled.done()

    scenario(main, TIMEOUT_S)
