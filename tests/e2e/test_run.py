"""The main job, shortened: `miles-async run recipes/reverse.toml` end to end on the tiny model.

Real processes throughout (an engine process, trainer rank processes, the controller's actors).
Each run is shortened by overrides to a few seconds of work after start-up.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support_run import SHORT, kill_mid_run, pids_alive, run_cli, titled, wait_for

from miles_async.actors.controller import Controller
from miles_async.actors.controller import run as run_loop
from miles_async.actors.engine import EngineStatus
from miles_async.actors.evaluation import Evaluator
from miles_async.actors.recipe import load_recipe
from miles_async.observe import EngineTrace, SampleTrace, StepTrace, decode_trace, read_samples
from miles_async.observe.names import is_known
from miles_async.runtime import run as run_async
from miles_async.runtime import segments
from miles_async.sim import load_trace
from miles_async.trajectory import decode_data

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_with_fault(controller: Controller, run_dir: Path, fault):
    """Run, and once two steps are done await `fault()` (while the run goes on); the run's result."""

    async def main():
        task = asyncio.ensure_future(controller.run())
        while not ((run_dir / "metrics.jsonl").is_file() and len(rows(run_dir)) >= 2):
            assert not task.done(), task.exception() if task.done() else ""
            await asyncio.sleep(0.05)
        await fault()
        return await task

    return run_async(main())


@pytest.mark.timeout(240)
def test_the_recipe_runs_and_writes_metrics_trace_checkpoint_and_plots(tmp_path, monkeypatch):
    """With [observe]: wandb (the real package, offline), TensorBoard and 2 decoded samples a step."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    proc = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=4", "eval.every=2",
                    "eval.at_start=true", "observe.wandb=true", "observe.tensorboard=true", "observe.log_samples=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_steps"] == 4 and not summary["interrupted"] and summary["sft_steps"] == 10
    assert [s for s, _ in summary["eval_scores"]] == [0, 2, 4]  # at_start: the warm-started weights too
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(r["train/num_samples"] == 8 and 0 <= r["rollout/reward_mean"] <= 1 and r["perf/step_s"] > 0 for r in metrics)
    assert "eval/score" in metrics[1] and "eval/score" not in metrics[0]
    assert all(is_known(key) for r in metrics for key in r), [k for r in metrics for k in r if not is_known(k)]
    texts = read_samples(out / "samples.jsonl")  # 2 decoded samples of each step's batch
    assert [t.step for t in texts] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(t.prompt and t.num_generated_tokens > 0 and t.versions and t.finish_reason for t in texts)
    run_id = (out / "wandb_run_id").read_text().strip()
    [wandb_run] = (out / "wandb").glob(f"offline-run-*-{run_id}")
    assert (wandb_run / f"run-{run_id}.wandb").stat().st_size > 0
    assert len(list(wandb_run.glob("files/media/table/rollout/samples_*.table.json"))) == 4
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    records = decode_trace(out / "trace.jsonl")
    assert {type(r).__name__ for r in records} == {"RunTrace", "SampleTrace", "StepTrace", "UpdateTrace", "EvalTrace",
                                                   "EngineTrace"}  # (engine-0 serving)
    assert type(records[0]).__name__ == "RunTrace" and records[0].batch_groups == 2  # the header, first
    trace = load_trace(out / "trace.jsonl")  # what the simulator reads: checked, the warm start left out
    assert len(trace.steps) == 4 and all(0 < s.train_end_s <= s.end_s for s in trace.steps)
    # (the eval of the starting weights belongs to the warm-up, as the simulator reads it)
    assert [e.step for e in trace.evals] == [2, 4] and all(e.end_s > e.start_s > 0 for e in trace.evals)
    assert any((out / "checkpoints").iterdir()) and (out / "sft_model" / "model.safetensors").is_file()
    assert (out / "final_model" / "model.safetensors").is_file() and (out / "final_model" / "tokenizer.json").is_file()
    assert not (out / "final_model" / "buckets").exists()
    plots = run_cli(["plot", str(out)])
    assert plots.returncode == 0, plots.stderr
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "entropy.png", "grad_norm.png", "kl.png", "loss.png", "mismatch.png", "response_len.png", "reward.png",
        "staleness.png", "step_time.png"]


@pytest.mark.timeout(240)
def test_the_terminal_shows_progress_and_warnings_and_verbose_brings_the_detail_back(tmp_path):
    short = [*SHORT, "loop.num_steps=3", "sft.probe_every=5", "eval.mode=none"]
    plain = run_cli(["run", str(RECIPE), "--out", str(tmp_path / "plain"), *short])
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "step 3/3" in plain.stderr  # the progress display
    logged = [line for line in plain.stderr.splitlines() if " INFO " in line or " DEBUG " in line]
    assert len(logged) <= 3, logged  # a run's once-said lines only
    assert "weights now at version" not in plain.stderr and "SFT step 5:" not in plain.stderr
    verbose = run_cli(["run", str(RECIPE), "--out", str(tmp_path / "verbose"), "--verbose", *short])
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "weights now at version" in verbose.stderr and "SFT step 5:" in verbose.stderr
    assert "pushed over shm" in verbose.stderr


@pytest.mark.timeout(240)
def test_true_on_policy_mode_from_the_recipe_gives_exactly_zero_mismatch_on_every_step(tmp_path):
    """`trainer.batch_invariant` and `rollout.engine.batch_invariant`: the trainer's log-prob of every
    trained token equals the engine's bit for bit, so a synchronous run's mismatch is exactly 0.0
    (and without them it is not: the check can fail). The run also offloads its engines: each step
    they give back their weights and KV cache while the trainer trains and get them again before
    the push, which restores them bit for bit (the mismatch stays 0.0). Without the two switches
    the mismatch of a synchronous run is not 0.0: test_modes_bound_the_staleness_of_what_is_trained
    (sync) checks that, so this check can fail."""
    short = [*SHORT, "loop.num_steps=4", "loop.mode=sync", "eval.mode=none"]
    on = tmp_path / "on"
    proc = run_cli(["run", str(RECIPE), "--out", str(on), "--quiet", *short, "trainer.batch_invariant=true",
                    "rollout.engine.batch_invariant=true", "loop.offload_engines=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["train/logprob_abs_diff"] for r in rows(on)] == [0.0] * 4
    assert all(r["perf/engine_release_s"] > 0 for r in rows(on)) and all(r["perf/engine_resume_s"] > 0 for r in rows(on)[1:])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "bound", "client"), [("sync", 0, "http"), ("one_step_off", 1, "actor")])
def test_modes_bound_the_staleness_of_what_is_trained(tmp_path, mode, bound, client):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=5", f"loop.mode={mode}", "eval.mode=none",
                                  f"rollout.client={client}"])
    result = run_async(Controller(config, tmp_path, progress=False).run())
    assert result.num_steps == 5
    staleness = [r["train/staleness_max"] for r in rows(tmp_path)]
    assert max(staleness) <= bound
    if mode == "sync":  # lockstep: generation waits for every update, so nothing is ever stale
        assert staleness == [0] * 5
        # and without batch-invariant kernels the trainer's log-probs are not the engine's bit for
        # bit (what the true-on-policy test's zeros are measured against)
        assert any(r["train/logprob_abs_diff"] > 0.0 for r in rows(tmp_path))


@pytest.mark.timeout(240)
def test_two_trainer_ranks_and_a_dedicated_eval_engine(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=3", "trainer.world_size=2", "eval.mode=dedicated",
                                  "eval.every=3"])
    result = run_async(Controller(config, tmp_path, progress=False).run())
    assert result.num_steps == 3 and len(result.eval_scores) == 1
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]


@pytest.mark.timeout(240)
def test_an_external_eval_command_gets_a_loadable_checkpoint(tmp_path):
    script = tmp_path / "score.py"
    script.write_text("import json, sys\nfrom miles_async.models import load_pretrained\n"
                      "m = load_pretrained(sys.argv[1])\nprint('loaded')\nprint(json.dumps({'score': 0.25}))\n")
    command = f"{sys.executable} {script} {{checkpoint}}"
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=2", "eval.mode=command", "eval.every=2",
                                  f"eval.command={json.dumps(command)}"])
    result = run_async(Controller(config, tmp_path / "run", progress=False).run())
    assert result.eval_scores == [(2, 0.25)]


@pytest.mark.timeout(300)
def test_ctrl_c_saves_a_checkpoint_leaves_no_process_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles_async.launch.cli", "run", str(RECIPE), "--out", str(out), "--quiet",
           *SHORT, "loop.num_steps=10000", "eval.mode=none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(rows(out)) >= 3, 180, "three RL steps")
        children = pids_alive(proc.pid)
        assert children, "the run should have child processes (engine, trainer)"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "child processes outlived the run"
    stopped_at = rows(out)[-1]["step"]
    resumed = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", "--resume", *SHORT,
                       f"loop.num_steps={stopped_at + 2}", "eval.mode=none"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in rows(out)][-2:] == [stopped_at + 1, stopped_at + 2]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] and Path(summary["resumed_from"]).parent == out / "checkpoints"


@pytest.mark.timeout(300)
def test_an_engine_killed_mid_run_loses_no_sample_and_trains_none_twice(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=8", "rollout.num_engines=2", "eval.mode=none",
                                  "rollout.sampling.max_new_tokens=24"])
    controller = Controller(config, tmp_path, progress=False)

    killed_s: list[float] = []

    async def kill_engine_1():
        victim = next(e for e in controller.fleet.engines if e.name == "engine-1")
        state = await victim.ask(EngineStatus(), timeout_s=30)
        os.kill(state.pid, signal.SIGKILL)
        killed_s.append(time.time() - controller.start_time)  # the trace's clock

    result = run_with_fault(controller, tmp_path, kill_engine_1)
    assert result.num_steps == 8 and not result.interrupted
    trace = decode_trace(tmp_path / "trace.jsonl")
    trained = [p for r in trace if isinstance(r, StepTrace) for p in r.prompt_ids]
    assert len(trained) == len(set(trained)) == 8 * 2  # every step trained 2 groups, no group twice
    samples = [r for r in trace if isinstance(r, SampleTrace)]
    counted = {(s.prompt_id, s.attempt, s.index) for s in samples if not s.dropped}
    assert len(counted) == len([s for s in samples if not s.dropped])  # no sample counted twice
    served = [s for s in samples if s.engine == "engine-1" and s.end_s < killed_s[0] and not s.dropped]
    assert served, "engine-1 should have served samples before it died"
    # Work that only the survivor can have done: samples asked for after the kill. The staleness
    # bound makes the last steps need them (their data must be from versions pushed after it).
    # Not "after engine-1's last sample": its in-flight samples are stamped when their failure is
    # seen, which can come after the survivor's last sample on a run whose end is a few tenths of a
    # second away (that comparison failed at random).
    after_kill = [s for s in samples if s.engine == "engine-0" and s.submit_s > killed_s[0] and not s.dropped
                  and s.finish_reason in ("stop", "length")]
    assert after_kill, "the surviving engine should have carried on"
    # engine-1 may come back ([rollout.restart]): it finishes nothing between its death and its return
    back_at = min((r.time_s for r in trace if isinstance(r, EngineTrace) and r.engine == "engine-1"
                   and r.event == "serving" and r.time_s > killed_s[0]), default=math.inf)
    assert not [s for s in samples if s.engine == "engine-1" and killed_s[0] < s.submit_s < back_at and not s.dropped
                and s.finish_reason in ("stop", "length")], "a dead engine finished samples"
    for prompt in trained:  # each trained group has all its n samples, from one attempt
        attempts = {s.attempt for s in samples if s.prompt_id == prompt and not s.dropped
                    and s.finish_reason in ("stop", "length")}
        assert attempts


def run_segments(pids: list[int]) -> set[str]:
    """The runs (`miles-<run>-`) whose shared-memory segments these processes created (segments.py)."""
    tags = set()
    for name in os.listdir(segments.default_folder()):
        parts = name.split("-")
        if name.startswith(segments.PREFIX) and len(parts) > 3 and parts[2].isdigit() and int(parts[2]) in pids:
            tags.add(parts[1])
    return tags


@pytest.mark.timeout(240)
def test_an_engine_sigkilled_mid_run_leaves_no_process_no_shared_memory_and_no_warning(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles_async.launch.cli", "run", str(RECIPE), "--out", str(out), "--quiet", *SHORT,
           "loop.num_steps=6", "rollout.num_engines=2", "eval.mode=none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(rows(out)) >= 2, 180, "two RL steps")
        children = pids_alive(proc.pid)
        roles = titled([proc.pid, *children])
        assert {"controller", "engine-0", "engine-1", "trainer-0"} <= roles.keys(), roles
        tags = run_segments([proc.pid, *children])
        assert tags, "the engines keep their weights in shared memory (weights.transport auto -> shm)"
        os.kill(roles["engine-1"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "the run's processes exit")
    left = [n for n in os.listdir(segments.default_folder()) if any(n.startswith(f"miles-{t}") for t in tags)]
    assert left == [], f"shared-memory segments outlived the run: {left}"
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr[-3000:]


@pytest.mark.timeout(300)
def test_a_trainer_killed_restarts_the_run_from_its_checkpoint_and_no_step_or_prompt_repeats(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=8", "loop.checkpoint_every=3", "eval.mode=none",
                                  "observe.log_samples=1"])
    controllers: list[Controller] = []
    restarts: list[str] = []

    async def main():
        task = asyncio.ensure_future(run_loop(config, tmp_path, progress=False, max_restarts=1,
                                              on_restart=lambda n, e: restarts.append(str(e)),
                                              controllers=controllers))
        # after the checkpoint of step 3 is on disk and step 4 is written down (it is rolled back)
        while not (len(rows(tmp_path)) >= 4 if (tmp_path / "metrics.jsonl").is_file() else False) or \
                not any((p / "run_state.json").is_file() for p in (tmp_path / "checkpoints").glob("step_*")):
            assert not task.done(), task.exception() if task.done() else ""
            await asyncio.sleep(0.02)
        os.kill(controllers[0].system.supervisor.children["trainer-0"].process.pid, signal.SIGKILL)
        return await task

    result = run_async(main())
    assert result.num_steps == 8 and result.restarts == 1 and len(controllers) == 2
    assert len(restarts) == 1 and "trainer rank 0" in restarts[0] and "died" in restarts[0]
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, 9))  # each step once: the cut ones redone
    assert (tmp_path / "metrics.rolled_back.jsonl").is_file()
    assert [t.step for t in read_samples(tmp_path / "samples.jsonl")] == list(range(1, 9))  # rolled back too
    trace = decode_trace(tmp_path / "trace.jsonl")
    steps = [r for r in trace if isinstance(r, StepTrace)]
    assert [r.step for r in steps] == list(range(1, 9))
    trained = [p for r in steps for p in r.prompt_ids]
    assert len(trained) == len(set(trained)) == 8 * 2  # no prompt trained twice across the restart
    resumed = json.loads((Path(result.resumed_from) / "run_state.json").read_text())
    assert resumed["rl_step"] >= 3


@pytest.mark.timeout(300)
def test_a_trainer_killed_without_restarts_stops_in_one_line_and_resume_finishes_the_run(tmp_path):
    out = tmp_path / "run"
    args = ["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=8", "loop.checkpoint_every=2",
            "eval.mode=none"]
    status, stderr, children = kill_mid_run(
        args, "trainer-0", lambda: (out / "metrics.jsonl").is_file() and len(rows(out)) >= 3
        and any((p / "run_state.json").is_file() for p in (out / "checkpoints").glob("step_*")),
        "three RL steps and a checkpoint written")
    assert status == 1, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "trainer rank 0" in line]
    assert len(said) == 1 and "died" in said[0] and "--resume continues from" in said[0], stderr[-3000:]
    assert "Traceback" not in stderr
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "the run's processes exit")
    resumed = run_cli([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == list(range(1, 9))  # the steps after the checkpoint, written once
    trained = [p for r in decode_trace(out / "trace.jsonl") if isinstance(r, StepTrace) for p in r.prompt_ids]
    assert len(trained) == len(set(trained)) == 8 * 2


@pytest.mark.timeout(300)
def test_a_fatal_error_while_the_trainer_lives_saves_a_checkpoint_and_resume_writes_each_step_once(tmp_path,
                                                                                                 monkeypatch):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=6", "eval.every=3", "loop.checkpoint_every_s=0"])

    async def broken(self, step):
        raise RuntimeError(f"the evaluator broke at step {step}")

    monkeypatch.setattr(Evaluator, "evaluate", broken)
    with pytest.raises(RuntimeError, match="the evaluator broke at step 3"):
        run_async(Controller(config, tmp_path, progress=False).run())
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]  # step 3 was trained: written down before the stop
    saved = json.loads((sorted((tmp_path / "checkpoints").glob("step_*"))[-1] / "run_state.json").read_text())
    assert saved["rl_step"] == 3
    monkeypatch.undo()
    result = run_async(Controller(load_recipe(RECIPE, [*SHORT, "loop.num_steps=6", "eval.mode=none"]), tmp_path,
                                  resume=True, progress=False).run())
    assert result.num_steps == 6 and result.resumed_from
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, 7))
    trained = [p for r in decode_trace(tmp_path / "trace.jsonl") if isinstance(r, StepTrace) for p in r.prompt_ids]
    assert len(trained) == len(set(trained)) == 6 * 2


@pytest.mark.timeout(240)
def test_a_rollout_worker_stopped_mid_run_leaves_its_share_to_the_others(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=6", "rollout.num_workers=2", "eval.mode=none"])
    controller = Controller(config, tmp_path, progress=False)

    async def stop_worker_1():
        await controller.system.stop(await controller.system.lookup("rollout-1"))

    result = run_with_fault(controller, tmp_path, stop_worker_1)
    assert result.num_steps == 6
    trained = [p for r in decode_trace(tmp_path / "trace.jsonl") if isinstance(r, StepTrace) for p in r.prompt_ids]
    assert len(trained) == len(set(trained)) == 6 * 2


@pytest.mark.timeout(240)
def test_abort_and_retry_across_weight_updates(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=6", "rollout.partial=abort_retry", "eval.mode=none",
                                  "rollout.sampling.max_new_tokens=24", "scheduler.target_in_flight=32"])
    result = run_async(Controller(config, tmp_path, progress=False).run())
    assert result.num_steps == 6
    samples = [r for r in decode_trace(tmp_path / "trace.jsonl") if isinstance(r, SampleTrace)]
    aborted = [s for s in samples if s.finish_reason == "abort"]
    assert aborted, "weight updates in abort mode should abort in-flight samples"
    assert all(len(s.versions) == 1 for s in samples if s.finish_reason != "abort")  # never spans an update
    assert any(s.attempt > 0 for s in samples)  # aborted groups were generated again


@pytest.mark.timeout(300)
def test_the_multi_turn_recipe_trains_agent_episodes_through_the_session_server(tmp_path):
    recipe = RECIPE.parent / "calculator.toml"
    config = load_recipe(recipe, ["sft.max_steps=10", "sft.probe_every=10", "sft.num_probe=4", "loop.num_steps=3",
                                  "loop.batch_groups=2", "scheduler.group_size=2", "scheduler.target_in_flight=8",
                                  "buffer.filter=none", "eval.every=3", "eval.num_prompts=4",
                                  "task.num_prompts=200"])
    result = run_async(Controller(config, tmp_path, progress=False).run())
    assert result.num_steps == 3 and len(result.eval_scores) == 1
    metrics = rows(tmp_path)
    # Every sample is a whole conversation (the tools' system prompt alone is hundreds of tokens),
    # and every turn after a session's first reuses its prefix from the engine's cache.
    assert all(r["train/num_tokens"] / r["train/num_samples"] > 300 for r in metrics)
    assert metrics[-1]["rollout/prefix_cache_hit_rate"] > 0.5
    samples = [r for r in decode_trace(tmp_path / "trace.jsonl") if isinstance(r, SampleTrace)]
    assert samples and all(s.output_tokens > 0 for s in samples if s.finish_reason != "error")


@pytest.mark.timeout(240)
def test_a_moe_model_trains_on_the_experts_its_rollouts_were_routed_to(tmp_path):
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=2", "model.family=qwen3_moe", "eval.mode=none"])
    controller = Controller(config, tmp_path, progress=False)
    seen: list[tuple[int, ...]] = []
    trace = controller._trace_sample
    reads: list[asyncio.Task] = []

    async def experts_of(ref) -> None:  # read while the sample waits in the buffer (freed once trained)
        data = decode_data(await controller.system.dataplane.read(ref))
        experts = data.experts()
        seen.append(() if experts is None else (*experts.shape, data.num_tokens))

    def record(sample, counted):
        if counted and sample.data is not None:
            reads.append(asyncio.ensure_future(experts_of(sample.data)))
        trace(sample, counted)

    controller._trace_sample = record
    result = run_async(controller.run())
    assert result.num_steps == 2
    # every rollout came back with the experts of every token but its last, for each MoE layer
    assert seen and all(len(s) == 4 and s[0] == s[3] - 1 and s[1] > 0 and s[2] > 0 for s in seen), seen[:3]
