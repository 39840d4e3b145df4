"""Process actors over real ZeroMQ: ask/tell, typed replies, lookup, FIFO, remote errors."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from _actors import Add, Boom, Counter, CounterStats, FailsToStart, Get, GetEnv, Pid, Record, Stats
from _support import TRANSPORTS, config, scenario, wait_pid_gone

from miles_async.runtime import ActorSystem, RemoteError, SpawnError

TIMEOUT_S = 60.0
NUM_TELLS = 200


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_process_actor_ask_tell_lookup_and_fifo(transport: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=config(transport)) as system:
            assert system.address.startswith(f"{transport}://")
            ref = await system.spawn(Counter, "counter", kwargs={"start": 10}, process=True)
            assert not ref.is_local and ref.address.startswith(f"{transport}://")
            assert ref.address != system.address

            child_pid = await ref.ask(Pid())
            assert child_pid != os.getpid()

            await ref.tell(Add(amount=5))
            assert await ref.ask(Add(amount=1)) == 16
            assert await ref.ask(Get()) == 16

            found = await system.lookup("counter")
            assert found == ref
            assert await found.ask(Pid()) == child_pid

            for seq in range(NUM_TELLS):
                await ref.tell(Record(seq=seq))
            stats = await ref.ask(Stats())
            assert isinstance(stats, CounterStats)  # decoded by Stats.Reply, not left a dict
            assert stats.history == list(range(NUM_TELLS))
            assert (stats.count, stats.pid) == (16, child_pid)

    scenario(main, TIMEOUT_S)


def test_remote_handler_error_keeps_the_actor_serving() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            ref = await system.spawn(Counter, "counter", process=True)
            pid = await ref.ask(Pid())
            await ref.ask(Add(amount=3))

            with pytest.raises(RemoteError) as info:
                await ref.ask(Boom(text="bad input 42"))
            failure = info.value.failure
            assert failure.type == "ValueError"
            assert failure.message == "bad input 42"
            assert "dist-test: boom raise line" in failure.traceback  # the source line of the raise
            assert "_actors.py" in failure.traceback
            assert "bad input 42" in str(info.value)

            assert await ref.ask(Pid()) == pid  # same process, same instance, same state
            assert await ref.ask(Get()) == 3

    scenario(main, TIMEOUT_S)


def test_failed_on_start_in_a_child_process_reports_its_cause() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            with pytest.raises(SpawnError) as info:
                await system.spawn(FailsToStart, "doomed", process=True)
            cause = info.value.cause
            assert (cause.type, cause.message) == ("ValueError", "no such device: cuda:7")
            assert "dist-test: on_start raise line" in cause.traceback
            ref = await system.spawn(Counter, "doomed", process=True)  # the name is free again
            assert await ref.ask(Get()) == 0

    scenario(main, TIMEOUT_S)


def test_a_child_process_gets_the_environment_it_was_spawned_with() -> None:
    """What a multi-node run uses to give each engine its GPU (CUDA_VISIBLE_DEVICES)."""
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            ref = await system.spawn(Counter, "c", process=True, env={"CUDA_VISIBLE_DEVICES": "3", "X_TEST": "y"})
            assert await ref.ask(GetEnv(name="CUDA_VISIBLE_DEVICES")) == "3"
            assert await ref.ask(GetEnv(name="X_TEST")) == "y"
            assert os.environ.get("X_TEST") is None  # the parent's environment is untouched
            with pytest.raises(ValueError, match="process=True"):
                await system.spawn(Counter, "local", env={"X_TEST": "y"})

    scenario(main, TIMEOUT_S)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_child_takes_the_owners_environment_as_it_is_when_the_child_starts(start_method: str, monkeypatch) -> None:
    """A forked child's parent is the fork server, started with the first child: the second child
    still sees a variable set after that (and not one removed), and dies with its owner (the
    liveness tests kill owners); `spawn` gives the same answers from fresh interpreters."""
    monkeypatch.setenv("X_BEFORE", "1")

    async def main() -> None:
        async with ActorSystem(config=config("ipc", start_method=start_method)) as system:
            first = await system.spawn(Counter, "first", process=True)
            monkeypatch.setenv("X_AFTER", "2")
            monkeypatch.delenv("X_BEFORE")
            second = await system.spawn(Counter, "second", process=True)
            assert await second.ask(GetEnv(name="X_AFTER")) == "2"
            assert await second.ask(GetEnv(name="X_BEFORE")) is None
            assert await first.ask(GetEnv(name="X_BEFORE")) == "1"
            pids = [await ref.ask(Pid()) for ref in (first, second)]
            parents = {parent_of(pid) for pid in pids}
            if start_method == "spawn":
                assert parents == {os.getpid()}
            else:  # both forked by one server, itself a child of this process
                [server] = parents
                assert server != os.getpid()
                assert parent_of(server) == os.getpid()

    scenario(main, TIMEOUT_S)


START_EARLY = """
import asyncio, os, sys
sys.path.insert(0, {dist!r})
from _actors import Counter, Pid
from miles_async.runtime import ActorSystem, RuntimeConfig
from miles_async.runtime.child import start_fork_server

def children():
    found = []
    for stat in os.listdir("/proc"):
        try:
            text = open(f"/proc/{{stat}}/stat").read()
        except OSError:
            continue
        if stat.isdigit() and int(text.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.append(int(stat))
    return found

config = RuntimeConfig(start_method={method!r}, preload=("json",))
before = children()
start_fork_server(config)
started = sorted(set(children()) - set(before))

async def main():
    async with ActorSystem(config=config) as system:
        ref = await system.spawn(Counter, "counter", process=True)
        pid = await ref.ask(Pid())
        parent = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        print(bool(started), parent in started)

asyncio.run(main())
"""


@pytest.mark.parametrize(("start_method", "expected"), [("forkserver", "True True"), ("spawn", "False False")])
def test_a_fork_server_started_early_is_the_one_the_children_fork_from(start_method: str, expected: str) -> None:
    """`start_fork_server` (what `run` calls before importing torch) starts the server at once,
    as a child of the caller (with the resource tracker, multiprocessing's other helper), and the
    first actor's process is then forked by it; `spawn` starts nothing early."""
    import subprocess
    import sys

    script = START_EARLY.format(dist=str(Path(__file__).parent), method=start_method)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()  # (processes started early, the child's parent among them)


EXIT_QUICKLY = """
import asyncio, sys
sys.path.insert(0, {dist!r})
from _actors import Counter, Get
from miles_async.runtime import ActorSystem, RuntimeConfig

async def main():
    async with ActorSystem(config=RuntimeConfig(preload=("_exit_marker",))) as system:
        ref = await system.spawn(Counter, "counter", process=True)
        print(await ref.ask(Get()))

asyncio.run(main())
"""


def test_the_fork_server_exits_without_tearing_down_what_it_preloaded(tmp_path: Path) -> None:
    """Once its owner is gone the fork server ends in `os._exit` (runtime/quickexit.py, registered
    after every preloaded module): a preloaded module's atexit handler does not run in it, and the
    owner's stderr, which the server holds, is closed by the time the owner's output has ended
    (subprocess.run reads it to its end). Without quickexit the marker's atexit line is written."""
    import subprocess
    import sys

    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", EXIT_QUICKLY.format(dist=str(Path(__file__).parent))],
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "MILES_TEST_EXIT_MARKER": str(marker),  # (the server's sys.path
                               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])})  # is its own)
    assert done.returncode == 0 and done.stdout.split() == ["0"], done.stderr
    lines = marker.read_text().split()
    assert lines[0::2] == ["imported"], lines  # imported in the server alone; no atexit line from it
    try:  # gone, or a zombie nobody has reaped yet: not running
        state = Path(f"/proc/{lines[1]}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        state = "gone"
    assert state in ("gone", "Z", "X"), state
    # imported anywhere else, quickexit registers nothing: this process keeps its exit status
    elsewhere = subprocess.run([sys.executable, "-c", "import sys, miles_async.runtime.quickexit; sys.exit(3)"],
                               capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert elsewhere.returncode == 3, elsewhere.stderr


def test_a_bad_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"):
        config("ipc", start_method="fork")


def test_spawn_of_a_taken_name_reports_the_conflict() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            await system.spawn(Counter, "taken")
            async with ActorSystem("peer", config=config("ipc"), directory=system.address) as peer:
                with pytest.raises((ValueError, SpawnError)) as info:  # refused up front, or by the child
                    await peer.spawn(Counter, "taken", process=True)
                assert "'taken'" in str(info.value) and "already" in str(info.value), info.value
                assert await (await peer.lookup("taken")).ask(Get()) == 0  # the first one is untouched

    scenario(main, TIMEOUT_S)


def test_a_system_that_joined_a_run_closes_cleanly() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            peer = ActorSystem("peer", config=config("ipc"), directory=system.address)
            await peer.start()
            ref = await peer.spawn(Counter, "joined", process=True)
            pid = await ref.ask(Pid())
            try:
                await peer.close()
            finally:
                await wait_pid_gone(pid, 15.0)
            await asyncio.wait_for(peer.wait_closed(), 5.0)

    scenario(main, TIMEOUT_S)
