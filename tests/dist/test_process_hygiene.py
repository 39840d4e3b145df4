"""Processes of a run say what they are, and leave no shared memory behind however they end.

- a spawned actor's process is named for it in `ps` (its command line) and `top` (its kernel name);
- a child holding data-plane blobs and shared weights, SIGKILLed: its parent unlinks them, and
  Python's resource tracker prints nothing (no "leaked shared_memory objects");
- a run whose root was SIGKILLed is swept by the next one; a live run is not touched; a root
  that exits unlinks what its run left.

The scenarios that check stderr or kill a root run in a subprocess of their own (`python -c`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from _actors import Counter, Pid
from _support import config, scenario, wait_pid_gone

from miles_async.runtime import ActorSystem, segments

TIMEOUT_S = 120.0
HERE = Path(__file__).resolve().parent
SHM = Path(segments.default_folder())


def python(script: str, timeout_s: float = TIMEOUT_S, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout_s, check=False, **kwargs)  # type: ignore[call-overload]


def of_run(tag: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM) if name.startswith(f"{segments.PREFIX}{tag}"))


def test_a_spawned_actor_s_process_is_named_for_it_in_ps_and_top() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            counter = await system.spawn(Counter, "engine-7", process=True)
            pid = await counter.ask(Pid())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()
            assert cmdline == "miles-async: engine-7"
            assert Path(f"/proc/{pid}/comm").read_text().strip() == "miles:engine-7"
            if shutil.which("ps"):  # procps: what an operator types
                ps = await asyncio.to_thread(subprocess.run, ["ps", "-o", "comm=,args=", "-p", str(pid)],
                                             capture_output=True, text=True, check=True, timeout=30)
                assert ps.stdout.split() == ["miles:engine-7", "miles-async:", "engine-7"]

    scenario(main, TIMEOUT_S)


def test_a_sigkilled_child_leaves_no_segment_and_no_tracker_warning() -> None:
    result = python("""
        import asyncio, json, os, signal, time
        from _actors import BlobKeeper, HoldWeights, Pid, PutRandom
        from _support import config, scenario, wait_until
        from miles_async.runtime import ActorSystem, segments
        from miles_async.transport.shm import SharedWeights

        async def main():
            async with ActorSystem(config=config("ipc")) as system:
                keeper = await system.spawn(BlobKeeper, "keeper", process=True)
                pid = await keeper.ask(Pid())
                blob = await keeper.ask(PutRandom(num_bytes=100_000))
                weights = await keeper.ask(HoldWeights())
                attached = SharedWeights.attach(weights)  # the pusher's side: attached, never tracked
                attached.close()
                shm = segments.default_folder()
                names = sorted(n for n in os.listdir(shm) if n.startswith(segments.process_prefix(pid)))
                assert names == sorted([blob.ref.segment, weights]), names
                os.kill(pid, signal.SIGKILL)
                taken = await wait_until(lambda: not any(os.path.exists(os.path.join(shm, n)) for n in names),
                                         20, "the parent unlinks the dead child's segments")
                return {"names": names, "gone_s": taken, "tag": segments.run_tag()}

        print(json.dumps(scenario(main, 100)))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["names"][0].startswith(f"{segments.PREFIX}{out['tag']}-")
    assert not any((SHM / name).exists() for name in out["names"])
    assert of_run(out["tag"]) == [], "the run's lock outlived its root"
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, result.stderr[-3000:]


def test_a_dead_run_is_swept_by_the_next_and_a_live_one_is_not() -> None:
    make_run = """
        import os, signal, sys, torch
        from miles_async.runtime import segments
        from miles_async.transport.shm import SharedWeights
        weights = SharedWeights.like({"w": torch.ones(8)})
        orphan = os.path.join(segments.default_folder(), segments.process_prefix(4_000_000) + "dp00-1")
        open(orphan, "wb").close()  # as a grandchild SIGKILLed with its parent leaves it
        print(segments.run_tag(), flush=True)
        if sys.argv[-1] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()  # alive until told
    """
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(make_run), "live"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None
        live_tag = live.stdout.readline().strip()
        before = of_run(live_tag)
        assert len(before) == 3, before  # the weights, the orphan and the lock
        dead = subprocess.run([sys.executable, "-c", textwrap.dedent(make_run), "die"], capture_output=True,
                              text=True, timeout=TIMEOUT_S, check=False)
        dead_tag = dead.stdout.strip()
        assert dead.returncode == -9 and len(of_run(dead_tag)) == 3, (dead.stderr[-2000:], of_run(dead_tag))

        segments.sweep_stale(str(SHM))  # (how many it unlinks depends on what else runs on this machine)
        assert of_run(dead_tag) == []
        assert of_run(live_tag) == before, "a live run's segments were swept"
        _, err = live.communicate("", timeout=TIMEOUT_S)
        assert live.returncode == 0, err[-2000:]
    finally:
        if live.poll() is None:
            live.kill()
    assert of_run(live_tag) == [], "a root that exits unlinks what its run left, then its lock"


def test_the_children_of_a_sigkilled_root_unlink_their_segments_as_they_exit() -> None:
    """Their parent cannot reap them: each child sees it is gone, closes, and unlinks at exit
    what it still held (the engine's weights), before any later run has to sweep."""
    root = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import asyncio, json, os, signal
        from _actors import BlobKeeper, HoldWeights, Pid, PutRandom
        from _support import config, scenario
        from miles_async.runtime import ActorSystem, segments

        async def main():
            async with ActorSystem(config=config("ipc", heartbeat_interval_s=0.2)) as system:
                keeper = await system.spawn(BlobKeeper, "keeper", process=True)
                blob = await keeper.ask(PutRandom(num_bytes=1000))
                names = [blob.ref.segment, await keeper.ask(HoldWeights())]
                print(json.dumps({"pid": await keeper.ask(Pid()), "names": names, "tag": segments.run_tag()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        scenario(main, 100)
    """)], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = root.communicate(timeout=TIMEOUT_S)
    finally:
        if root.poll() is None:
            root.kill()
    assert root.returncode == -9, err[-3000:]
    info = json.loads(out.strip().splitlines()[-1])
    scenario(lambda: wait_pid_gone(info["pid"], 30), 60)
    assert not any((SHM / name).exists() for name in info["names"])
    assert of_run(info["tag"]) == [f"{segments.PREFIX}{info['tag']}{segments.LOCK_SUFFIX}"]
    segments.sweep_stale(str(SHM))  # the lock of the dead root: the next run's sweep removes it
    assert of_run(info["tag"]) == []
