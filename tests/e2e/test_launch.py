"""`miles-async launch` on one machine as several nodes: each launcher a real process with its own
address. Network namespaces need privileges CI may not have, so the nodes use distinct loopback
addresses (127.0.0.1, 127.0.0.2, ...: Linux routes all of 127/8 to lo); each binds only its own.

The recipe is the shipped one, shortened, with engines placed on node 1 (and node 0), the trainer
on node 0 or with a rank on each node, weights by "stream" or "broadcast" (a gloo group across
the nodes)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support_launch import (
    RECIPE,
    SECRET,
    finish,
    first_versions,
    free_port,
    joined_at,
    session_pids,
    stop_run,
    wait_engine,
    wait_steps,
)
from _support_run import SHORT, pids_alive, titled

from miles_async.trainer import checkpoint


def loopback_ok(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not loopback_ok("127.0.0.2"), reason="cannot bind 127.0.0.2 (no 127/8 on lo)")


def launcher(rank: int, nnodes: int, port: int, out: Path, *extra: str, env: dict | None = None,
             quiet: bool = True, prefix: tuple[str, ...] = (), recipe: Path = RECIPE) -> subprocess.Popen:
    args = [*prefix, sys.executable, "-m", "miles_async.launch.cli", "launch", "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--host", f"127.0.0.{rank + 1}",
            "--rdzv-timeout-s", "60", str(recipe), *extra]
    if rank == 0:
        args += ["--out", str(out)]
    if quiet:
        args.append("--quiet")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "MILES_ASYNC_SECRET": SECRET, **(env or {})})


# eval on the shared engine: the controller scores through node 1's engine HTTP API, which wants the run's key;
# the weights travel by "stream", CURVE-authenticated with the run's key like every mailbox
# the trainer's two ranks span the nodes: one process group over both addresses (gloo bound to each node's);
# the scheduler and the buffer run on node 1 too, each a process there
SHORT_TWO_NODES = [*SHORT, "loop.num_steps=3", "eval.mode=shared", "eval.every=3", "placement.engines=[1]",
                   "weights.transport=stream", "trainer.world_size=2", "placement.trainer=[0,1]",
                   "placement.scheduler=1", "placement.buffer=1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_run_the_recipe_with_engine_scheduler_buffer_and_a_trainer_rank_on_node_1(tmp_path: Path) -> None:
    port = free_port()
    procs = [launcher(0, 2, port, tmp_path / "run", *SHORT_TWO_NODES),
             launcher(1, 2, port, tmp_path / "run", *SHORT_TWO_NODES, quiet=False)]
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 0, err0[-3000:] + "\n---node 1---\n" + err1[-2000:]
    assert rc1 == 0, err1[-3000:]
    summary = json.loads(out0.strip().splitlines()[-1])
    assert summary["num_steps"] == 3 and not summary["interrupted"] and len(summary["eval_scores"]) == 1
    assert "node 1: started engine-0" in err1 and "node 1: started trainer-1" in err1, err1[-2000:]
    assert "started trainer-0" not in err1  # rank 0 ran on node 0
    assert "node 1: started scheduler" in err1 and "node 1: started buffer" in err1
    assert "trainer ranks on several nodes: their torch.distributed connections" in err0  # said, not hidden
    samples = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "sample" for r in samples) >= 3 * 2 * 4  # node 1's scheduler reported each one
    assert "node 1 stops: the run is over" in err1
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow  # ~6 s: waits out the rendezvous
@pytest.mark.timeout(60)
def test_a_node_that_never_arrives_ends_the_launch_naming_it(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    proc = launcher(0, 2, port, tmp_path / "run", *SHORT_TWO_NODES, "--rdzv-timeout-s", "3")
    ((rc, _, err),) = finish([proc], 45)
    assert rc == 3 and "node(s) 1 did not arrive" in err or "node 1 did not arrive" in err, err
    assert time.monotonic() - started < 40
    assert session_pids(proc.pid) == []


@pytest.mark.timeout(60)
def test_a_wrong_secret_is_refused_on_both_sides(tmp_path: Path) -> None:
    port = free_port()
    procs = [launcher(0, 2, port, tmp_path / "run", *SHORT_TWO_NODES, "--rdzv-timeout-s", "15"),
             launcher(1, 2, port, tmp_path / "run", *SHORT_TWO_NODES, "--rdzv-timeout-s", "15",
                      env={"MILES_ASYNC_SECRET": "c" * 64})]
    (rc0, _, err0), (rc1, _, err1) = finish(procs, 45)
    assert rc0 == 3 and "node 1" in err0 and "secret" in err0, err0
    assert rc1 == 3 and "secret" in err1, err1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_node_of_the_scheduler_and_buffer_killed_stops_the_run_with_the_cause(tmp_path: Path) -> None:
    """The run cannot go on without its scheduler and buffer: their node killed, node 0 stops within
    a bounded time naming what died and where, with the checkpoint --resume continues from."""
    port, out = free_port(), tmp_path / "run"
    args = [*SHORT, "loop.num_steps=100000", "loop.checkpoint_every=4", "eval.mode=none", "placement.scheduler=1",
            "placement.buffer=1", "--heartbeat-timeout-s", "3"]
    procs = [launcher(0, 2, port, out, *args), launcher(1, 2, port, out, *args)]
    wait_steps(out, 6, 180, procs)
    os.killpg(procs[1].pid, 9)
    started = time.monotonic()
    (rc0, _, err0), _ = finish(procs, 120)
    assert rc0 == 1 and time.monotonic() - started < 60, err0[-3000:]
    assert re.search(r"miles-async launch: the (refill scheduler|buffer) \((scheduler|buffer), on node 1\) died: "
                     r".*; the run stopped at RL step \d+ \(every process of it has exited\); --resume continues from "
                     r".*step_\d+ \(after RL step \d+\)", err0), err0[-3000:]
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


def engine_on_node_1(tmp_path: Path, num_steps: int, after_steps: int) -> tuple[Path, int, list[str],
                                                                                list[subprocess.Popen]]:
    """A two-node run whose engine is on node 1, once `after_steps` steps are written down: (run folder,
    port, arguments, the launchers)."""
    port, out = free_port(), tmp_path / "run"
    args = [*SHORT, f"loop.num_steps={num_steps}", "eval.mode=none", "placement.engines=[1]",
            "weights.transport=broadcast", "--heartbeat-timeout-s", "3"]
    procs = [launcher(0, 2, port, out, *args), launcher(1, 2, port, out, *args)]
    wait_steps(out, after_steps, 180, procs)
    return out, port, args, procs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_engine_process_killed_on_a_node_that_stays_is_started_again_there(tmp_path: Path) -> None:
    """Its node's agent answers: node 0 starts the engine again through it, with the current weights."""
    out, _, _, procs = engine_on_node_1(tmp_path, 40, 3)
    engines = [pid for pid in spawned_children(procs[1].pid)
               if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"miles-async: engine-0")]
    assert len(engines) == 1, engines  # node 1 runs the engine
    os.kill(engines[0], 9)
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert json.loads(out0.strip().splitlines()[-1])["num_steps"] == 40
    events = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines() if '"kind":"engine"' in line]
    assert [e["event"] for e in events] == ["serving", "lost", "restarted", "serving"], events
    back = events[-1]
    assert back["pid"] != events[0]["pid"] and back["weight_version"] > 0  # a new process, given the trained weights
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


def spawned_children(pid: int) -> list[int]:
    """The run's worker processes a launcher started (named `miles-async: <actor>`; forked by its
    fork server, so its grandchildren), not its resource tracker or the fork server itself."""
    return list(titled(pids_alive(pid)).values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_agent_run_with_the_session_server_and_engine_on_node_1(tmp_path: Path) -> None:
    """The TITO session server serves node 1's address, where it wants the run's API key: the
    rollout workers' agents and the controller's evaluation (both on node 0) send it. Where mount
    namespaces are allowed node 1 does not see node 0's files: the model folder is sent to it."""
    port, out = free_port(), tmp_path / "run"
    prefix = private_prefix(tmp_path)
    args = ["sft.max_steps=10", "sft.probe_every=10", "sft.num_probe=4", "loop.num_steps=3", "loop.batch_groups=2",
            "scheduler.group_size=2", "scheduler.target_in_flight=8", "buffer.filter=none", "eval.every=3",
            "eval.num_prompts=4", "task.num_prompts=200", "placement.engines=[1]", "placement.sessions=1",
            "weights.transport=stream"]
    recipe = RECIPE.parent / "calculator.toml"
    procs = [launcher(0, 2, port, out, *args, recipe=recipe),
             launcher(1, 2, port, out, *args, recipe=recipe, quiet=False, prefix=prefix or ())]
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 0 and rc1 == 0, err0[-3000:] + "\n--- node 1 ---\n" + err1[-2000:]
    summary = json.loads(out0.strip().splitlines()[-1])
    assert summary["num_steps"] == 3 and len(summary["eval_scores"]) == 1
    assert "node 1: started sessions" in err1 and "node 1: started engine-0" in err1
    if prefix is not None:  # the model went over the wire, once (the session server found it there)
        assert err0.count("to a node that lacked them") == 1, err0[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/num_tokens"] / r["train/num_samples"] > 300 for r in metrics)  # whole conversations, through node 1
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(400)
def trainer_run(out: Path, num_steps: int, checkpoint_every: int) -> list[str]:
    """A two-node run's arguments: both trainer ranks on node 0, the engine on node 1."""
    return [*SHORT, f"loop.num_steps={num_steps}", f"loop.checkpoint_every={checkpoint_every}", "eval.mode=none",
            "trainer.world_size=2", "placement.engines=[1]", "weights.transport=broadcast", "--heartbeat-timeout-s", "3"]


def kill_trainer_rank(out: Path, args: list[str], rank: int, after_steps: int, *node0: str) -> list[subprocess.Popen]:
    """Start the run's two launchers (`node0`: more arguments for node 0's), SIGKILL trainer rank
    `rank` once `after_steps` steps are written down and a checkpoint is finished; the launchers,
    still running."""
    port = free_port()
    procs = [launcher(0, 2, port, out, *args, *node0), launcher(1, 2, port, out, *args)]
    wait_steps(out, after_steps, 180, procs)
    deadline = time.monotonic() + 60  # and a finished checkpoint to resume from: it is written
    while checkpoint.latest(out / "checkpoints") is None:  # beside the steps, later on a loaded machine
        assert time.monotonic() < deadline, "no finished checkpoint within 60 s"
        time.sleep(0.1)
    ranks = spawned_children(procs[0].pid)
    assert len(ranks) == 2, ranks  # the two trainer ranks run on node 0
    victim = [pid for pid in ranks if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
              == f"miles-async: trainer-{rank}".encode()]
    assert len(victim) == 1, ranks
    os.kill(victim[0], 9)
    return procs


@pytest.mark.slow  # ~20 s: two launches of a two-node run
def test_a_trainer_rank_killed_stops_the_run_with_its_cause_and_resume_continues(tmp_path: Path) -> None:
    # 30 steps, the kill after 6: a short step can outrun the kill, and 10 steps were once all
    # written before it landed (then the resume had nothing left to write).
    out = tmp_path / "run"
    args = trainer_run(out, 30, 4)
    procs = kill_trainer_rank(out, args, 1, 6)
    started = time.monotonic()
    (rc0, _, err0), (rc1, _, err1) = finish(procs, 120)
    assert time.monotonic() - started < 60
    assert rc0 == 1, err0[-3000:]
    assert "trainer rank" in err0 and "died" in err0 and "--resume continues from" in err0, err0[-2000:]
    assert "Traceback" not in err0
    assert "the run stopped on node 0" in err1
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"
    stopped_at = len((out / "metrics.jsonl").read_text().splitlines())
    port = free_port()
    procs = [launcher(0, 2, port, out, *args, "--resume"), launcher(1, 2, port, out, *args)]
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    summary = json.loads(out0.strip().splitlines()[-1])
    assert summary["num_steps"] == 30 and summary["resumed_from"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31)) and len(steps) > stopped_at  # the steps after the checkpoint: once


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_rank_killed_with_max_restarts_restarts_every_node_from_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    procs = kill_trainer_rank(out, trainer_run(out, 24, 3), 0, 4, "--max-restarts", "1")  # the kill well before the end
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 300)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert "restart 1 of 1: trainer rank 0" in err0 and "Traceback" not in err0, err0[-2000:]
    summary = json.loads(out0.strip().splitlines()[-1])
    assert summary["num_steps"] == 24 and summary["restarts"] == 1 and summary["resumed_from"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25))  # the steps after the checkpoint ran again, written once
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_added_to_a_running_job_serves_after_receiving_the_weights(tmp_path: Path) -> None:
    out, port, args, procs = engine_on_node_1(tmp_path, 100000, 4)
    procs.append(launcher(2, 3, port, out, *args))  # elastic: a third node, not in the first rendezvous
    wait_engine(out, "engine-1", 180, procs)
    stop_run(procs[0])
    (rc0, _, err0), (rc1, _, _), (rc2, _, err2) = finish(procs, 240)
    assert rc0 == 130 and rc1 == 0 and rc2 == 0, err0[-2000:] + err2[-2000:]
    version = joined_at(err0, "engine-1")
    assert version > 0 and first_versions(out)["engine-1"] >= version  # the weights came before the work
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_engine_node_killed_mid_run_does_not_stop_it_and_rejoins_when_relaunched(tmp_path: Path) -> None:
    """Engines on nodes 0 and 1; node 1 is killed (every process of it) mid-run: node 0 declares its
    engine lost after the heartbeat timeout, the push in flight goes on to the other engine, the
    in-flight samples go there too, and the run goes on; a launcher started again for node 1 joins
    and its new engine gets the current weights before it serves."""
    port, out = free_port(), tmp_path / "run"
    args = [*SHORT, "loop.num_steps=100000", "eval.mode=none", "rollout.num_engines=2", "placement.engines=[0,1]",
            "weights.transport=broadcast", "--heartbeat-timeout-s", "3"]
    procs = [launcher(0, 2, port, out, *args), launcher(1, 2, port, out, *args)]
    wait_steps(out, 4, 180, procs)
    os.killpg(procs[1].pid, 9)
    time.sleep(4.5)  # past the heartbeat timeout: node 0 has declared it lost
    done = len((out / "metrics.jsonl").read_text().splitlines())
    wait_steps(out, done + 3, 60, procs[:1])  # the run goes on without node 1
    back = launcher(1, 2, port, out, *args)
    wait_engine(out, "engine-2", 180, [procs[0], back])
    stop_run(procs[0])
    (rc0, _, err0), (rc_back, _, err_back) = finish([procs[0], back], 240)
    assert rc0 == 130 and rc_back == 0, err0[-2000:] + err_back[-2000:]
    assert "engine engine-1 is gone" in err0
    version = joined_at(err0, "engine-2")
    assert first_versions(out)["engine-2"] >= version > 0
    for p in [*procs, back]:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_engine_node_cut_off_and_back_rejoins_with_the_current_weights(tmp_path: Path) -> None:
    """Node 1 frozen (SIGSTOP on all its processes: nothing leaves it, as with its link down) past the
    heartbeat timeout: its engine is declared lost and the run goes on; when it thaws, its agent
    answers again, its stale engine is stopped and a fresh one gets the current weights first.
    Where network namespaces are allowed, test_launch_netns.py takes the link down for real instead."""
    if netns_allowed():
        pytest.skip("network namespaces are allowed here: test_launch_netns.py cuts node 1's link off instead")
    port, out = free_port(), tmp_path / "run"
    args = [*SHORT, "loop.num_steps=100000", "eval.mode=none", "rollout.num_engines=2", "placement.engines=[0,1]",
            "weights.transport=broadcast", "--heartbeat-timeout-s", "3"]
    procs = [launcher(0, 2, port, out, *args), launcher(1, 2, port, out, *args)]
    wait_steps(out, 4, 180, procs)
    os.killpg(procs[1].pid, 19)  # SIGSTOP
    time.sleep(6)
    os.killpg(procs[1].pid, 18)  # SIGCONT
    wait_engine(out, "engine-2", 180, procs)
    stop_run(procs[0])
    (rc0, _, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 130 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "engine engine-1 is gone" in err0 and "node 1 (127.0.0.2) is back" in err0
    version = joined_at(err0, "engine-2")
    assert first_versions(out)["engine-2"] >= version > 0
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


def netns_allowed() -> bool:
    """Whether this machine lets a test make network namespaces (root, and the `ip` tool)."""
    name = f"mprobe{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], check=False, capture_output=True, timeout=30)
    except OSError:
        return False
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
    return made.returncode == 0


def private_prefix(folder: Path) -> tuple[str, ...] | None:
    """A command prefix: run in a mount namespace of its own where `folder` is an empty tmpfs (a
    node that does not share node 0's filesystem there); None where mount namespaces are not allowed."""
    try:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                f"mount -t tmpfs none {folder} && ! ls -A {folder} | grep -q ."],
                               check=False, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    if probe.returncode != 0:
        return None
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", f'mount -t tmpfs none {folder} && exec "$@"',
            "sh")


def private_folder(folder: Path) -> tuple[str, ...]:
    """`private_prefix`, skipping the test where mount namespaces are not allowed."""
    prefix = private_prefix(folder)
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare --mount is not allowed)")
    return prefix


def refused_without_the_run_folder(tmp_path: Path, *overrides: str) -> tuple[int, str, str, float]:
    """Launch two nodes, node 1 without node 0's filesystem, a run that needs it shared: (node 0's exit
    status, node 0's and node 1's stderr, seconds taken); no process of either is left."""
    out, port = tmp_path / "run", free_port()
    prefix = private_folder(tmp_path)
    args = [*SHORT, "loop.num_steps=3", "eval.mode=none", *overrides]
    started = time.monotonic()
    procs = [launcher(0, 2, port, out, *args), launcher(1, 2, port, out, *args, prefix=prefix)]
    (rc0, _, err0), (_, _, err1) = finish(procs, 120)
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"
    return rc0, err0, err1, time.monotonic() - started


@pytest.mark.slow  # ~7 s: a two-node launch
@pytest.mark.timeout(300)
def test_a_trainer_rank_on_a_node_without_the_run_folder_is_refused_naming_it(tmp_path: Path) -> None:
    rc0, err0, err1, seconds = refused_without_the_run_folder(tmp_path, "trainer.world_size=2",
                                                              "placement.trainer=[0,1]")
    assert rc0 == 1 and seconds < 120, err0[-3000:]
    # the launcher's own word: the cause, not a traceback (the failed process logs its own)
    assert ("\nmiles-async launch: the run could not start: trainer-0 failed: RuntimeError: trainer rank(s) 1 (on "
            "127.0.0.2) do not see the run folder of node 0") in err0, err0[-3000:]
    assert "node 1 stops: the run stopped on node 0: SpawnError" in err1


@pytest.mark.timeout(300)
def test_disk_delta_to_a_node_without_the_run_folder_is_refused_before_anything_starts(tmp_path: Path) -> None:
    rc0, err0, err1, seconds = refused_without_the_run_folder(tmp_path, "placement.engines=[1]",
                                                              "weights.transport=disk_delta")
    assert rc0 == 2 and seconds < 60, err0[-3000:]
    assert ('miles-async launch: the run cannot start: weights.transport = "disk_delta" writes weights into the run '
            f"folder ({tmp_path / 'run'}) for the engines to read, but node(s) [1] do not see it") in err0, err0[-3000:]
    assert "Traceback" not in err0
    assert "node 1 stops: the run stopped on node 0: RunSetupError" in err1
