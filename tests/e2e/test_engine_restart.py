"""Engines come back: the main job as shipped (one engine, one trainer rank), shortened, its only
engine SIGKILLed through the CLI. Within `[rollout.restart]` the engine is started again, gets the
current weights first and the run finishes; killed past its limit, the run stops cleanly (a
checkpoint, one line naming the cause, exit status 1). No process of the run is left either way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support_run import SHORT, pids_alive, wait_for

from miles_async.observe import EngineTrace, SampleTrace, StepTrace, decode_trace

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"
PROG = "miles-async run"


def engine_events(out: Path) -> list[dict]:
    path = out / "trace.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.splitlines() if '"kind":"engine"' in line]


def num_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def start(out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "miles_async.launch.cli", "run", str(RECIPE), "--out", str(out), "--quiet", *SHORT,
           "eval.mode=none", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_serving_engine(out: Path, times_served: int) -> None:
    """SIGKILL engine-0 once it has started serving for the `times_served`-th time (its pid from the trace)."""
    wait_for(lambda: len([e for e in engine_events(out) if e["event"] == "serving"]) >= times_served, 120,
             f"engine-0 serving (time {times_served})")
    serving = [e for e in engine_events(out) if e["event"] == "serving"][times_served - 1]
    os.kill(serving["pid"], signal.SIGKILL)


def finish(proc: subprocess.Popen, children: list[int]) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "a process of the run outlived it"
    return proc.returncode, stdout, stderr


@pytest.mark.timeout(300)
def test_the_only_engine_killed_mid_run_comes_back_with_the_current_weights_and_the_run_finishes(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "loop.num_steps=12")
    try:
        wait_for(lambda: num_steps(out) >= 2, 180, "two RL steps")
        children = pids_alive(proc.pid)
        kill_serving_engine(out, 1)
    finally:
        rc, stdout, stderr = finish(proc, children if "children" in locals() else [])
    assert rc == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["num_steps"] == 12
    trace = decode_trace(out / "trace.jsonl")
    events = [r for r in trace if isinstance(r, EngineTrace)]
    assert [(e.engine, e.event) for e in events] == [("engine-0", "serving"), ("engine-0", "lost"),
                                                     ("engine-0", "restarted"), ("engine-0", "serving")]
    back = events[-1]
    assert back.pid not in (0, events[0].pid) and "SIGKILL" in events[1].cause
    steps = [r for r in trace if isinstance(r, StepTrace)]
    # The version it serves on return is the trainer's current one: that of the last step trained by then.
    assert back.weight_version == max(s.weight_version for s in steps if s.train_end_s <= back.time_s) > 0
    assert [s.step for s in steps] == list(range(1, 13)) and any(s.start_s > back.time_s for s in steps)
    served = [r for r in trace if isinstance(r, SampleTrace) and r.submit_s > back.time_s]
    assert served and all(s.engine == "engine-0" and s.versions[0] >= back.weight_version for s in served)


@pytest.mark.timeout(300)
def test_the_engine_killed_past_its_restart_limit_stops_the_run_with_a_checkpoint_and_one_line(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "loop.num_steps=100000", "rollout.restart.max_restarts=1", "rollout.restart.backoff_s=0.2")
    try:
        wait_for(lambda: num_steps(out) >= 2, 180, "two RL steps")
        children = pids_alive(proc.pid)
        kill_serving_engine(out, 1)
        kill_serving_engine(out, 2)  # the restart, killed too: past the limit of 1
    finally:
        rc, _, stderr = finish(proc, children if "children" in locals() else [])
    assert rc == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    causes = [line for line in stderr.splitlines() if line.startswith(f"{PROG}: every rollout engine is dead")]
    assert len(causes) == 1, stderr[-3000:]
    assert "engine-0" in causes[0] and "SIGKILL" in causes[0] and "rollout.restart.max_restarts" in causes[0]
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert checkpoints and f"--resume continues from {checkpoints[-1]}" in causes[0]
    rl_step = json.loads((checkpoints[-1] / "run_state.json").read_text())["rl_step"]
    assert rl_step == num_steps(out) >= 2
    events = [(e.event, e.engine) for e in decode_trace(out / "trace.jsonl") if isinstance(e, EngineTrace)]
    assert events[-2:] == [("lost", "engine-0"), ("gone", "engine-0")]
