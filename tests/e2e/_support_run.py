"""Helpers of the main-job tests: the shortening overrides, the CLI in a subprocess, bounded waits."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# A few seconds of work after start-up: 10 SFT steps, groups of 4, batches of 2 groups, short outputs.
SHORT = ["sft.max_steps=10", "sft.probe_every=10", "sft.target_accuracy=1.0", "sft.num_probe=8",
         "task.num_prompts=400", "loop.batch_groups=2", "scheduler.group_size=4", "scheduler.target_in_flight=16",
         "buffer.filter=none", "eval.num_prompts=8", "rollout.sampling.max_new_tokens=8"]


def run_cli(args: list[str], timeout_s: float = 200.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_async.launch.cli", *args], check=False, capture_output=True,
                          text=True,
                          timeout=timeout_s)


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.05)


def pids_alive(root: int) -> list[int]:
    """Every live descendant of process `root` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def titled(pids: list[int]) -> dict[str, int]:
    """The `miles-async: <role>` processes among `pids`: role -> pid (runtime/proctitle.py)."""
    found = {}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()
        except OSError:
            continue
        if cmdline.startswith("miles-async: "):
            found[cmdline.removeprefix("miles-async: ")] = pid
    return found


def kill_mid_run(args: list[str], role: str, ready: Callable[[], bool], what: str) -> tuple[int, str, list[int]]:
    """Run the CLI with `args`, SIGKILL the process of `role` (its title) once `ready()`, and wait
    for the run to end: (its exit status, its stderr, the pids of its processes at the kill)."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "miles_async.launch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready, 180, what)
        children = pids_alive(proc.pid)
        os.kill(titled(children)[role], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr, children
