"""Liveness across processes: a frozen peer is lost by heartbeats, an orphaned child exits."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from _actors import Counter, Get, Pid, Sleep
from _support import TRANSPORTS, ask_until_ok, config, raises_within, scenario, signal_if_alive, wait_pid_gone

from miles_async.runtime import ActorDeadError, ActorSystem, RestartPolicy

TIMEOUT_S = 60.0
HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 0.6
DETECTION_SLACK_S = 2.0  # one missed check plus scheduling on a loaded machine
ORPHAN_EXIT_S = 5.0
DIST_DIR = Path(__file__).resolve().parent


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frozen_process_is_lost_by_heartbeats(transport: str) -> None:
    async def main() -> None:
        cfg = config(transport, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                     heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        async with ActorSystem(config=cfg) as system:
            ref = await system.spawn(Counter, "sleeper", process=True)
            pid = await ref.ask(Pid())
            pending = ref.ask_future(Sleep(seconds=60.0), timeout_s=60.0)
            await ref.ask(Get())  # answered after the Sleep arrived: it is running now
            try:
                os.kill(pid, signal.SIGSTOP)  # alive to the kernel, silent on the wire
                err, took_s = await raises_within(pending, HEARTBEAT_TIMEOUT_S + DETECTION_SLACK_S)
                assert isinstance(err, ActorDeadError), repr(err)
                assert err.cause.type == "PeerLost", err.cause
                assert took_s >= HEARTBEAT_TIMEOUT_S * 0.5  # lost by silence, not by an exit
                with pytest.raises(ActorDeadError):
                    await ref.ask(Get(), timeout_s=5.0)
            finally:
                signal_if_alive(pid, signal.SIGKILL)
                signal_if_alive(pid, signal.SIGCONT)
            await wait_pid_gone(pid, 5.0)

    scenario(main, TIMEOUT_S)


def test_a_frozen_child_is_killed_and_restarted_by_its_policy() -> None:
    async def main() -> None:
        cfg = config("ipc", heartbeat_interval_s=HEARTBEAT_INTERVAL_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        async with ActorSystem(config=cfg) as system:
            policy = RestartPolicy(mode="on_failure", backoff_s=0.05)
            ref = await system.spawn(Counter, "frozen", process=True, restart=policy)
            pid = await ref.ask(Pid())
            try:
                os.kill(pid, signal.SIGSTOP)
                await wait_pid_gone(pid, HEARTBEAT_TIMEOUT_S + DETECTION_SLACK_S + 5.0)
                new_pid = await ask_until_ok(ref, Pid(), timeout_s=20.0)
                assert new_pid != pid
                assert await ref.ask(Get()) == 0
            finally:
                signal_if_alive(pid, signal.SIGKILL)
                signal_if_alive(pid, signal.SIGCONT)

    scenario(main, TIMEOUT_S)


ORPHAN_SCRIPT = """
import os
import signal
import sys

sys.path.insert(0, {dist_dir!r})

from _actors import Counter, Pid
from miles_async.runtime import ActorSystem, RuntimeConfig, run


async def main() -> None:
    config = RuntimeConfig(transport="tcp", run_dir={run_dir!r}, heartbeat_interval_s={interval},
                           heartbeat_timeout_s={timeout}, spawn_timeout_s=60.0)
    system = ActorSystem(config=config)
    await system.start()
    ref = await system.spawn(Counter, "orphan", process=True)
    print(await ref.ask(Pid(), timeout_s=30.0), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the child must notice alone


if __name__ == "__main__":
    run(main())
"""


def test_child_process_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(ORPHAN_SCRIPT).format(
        dist_dir=str(DIST_DIR), run_dir=str(tmp_path / "run"), interval=HEARTBEAT_INTERVAL_S,
        timeout=HEARTBEAT_TIMEOUT_S))

    async def main() -> None:
        parent = await asyncio.create_subprocess_exec(
            sys.executable, str(script), stdout=asyncio.subprocess.PIPE)
        child_pid = None
        try:
            assert parent.stdout is not None
            line = await asyncio.wait_for(parent.stdout.readline(), 60.0)
            assert line.strip().isdigit(), f"the parent script printed {line!r}"
            child_pid = int(line)
            assert await asyncio.wait_for(parent.wait(), 30.0) == -signal.SIGKILL
            await wait_pid_gone(child_pid, ORPHAN_EXIT_S)
        finally:
            if parent.returncode is None:
                parent.kill()
                await parent.wait()
            if child_pid is not None:
                signal_if_alive(child_pid, signal.SIGKILL)

    scenario(main, TIMEOUT_S)
