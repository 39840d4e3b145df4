"""`miles-async bench loop`: samples/s of the RL loop, fully asynchronous beside synchronous and beside TRL.

In one run, on the main job's recipe (recipes/reverse.toml) with long-tailed outputs:

1. One shared warm start: the recipe's SFT (`loop.num_steps=0`) into a temporary run folder, on
   words of long-tailed lengths (`LONG_TAIL`: most 4-6 letters, a tail to 32), so the answers,
   and the outputs of a model still learning them (at temperature 1 it sometimes runs on, up to
   `--max-new-tokens`, 48), are long-tailed, as real rollouts are. Each run reports the
   distribution (`output_tokens`).
2. Ours, three times, from that warm start with the same settings: `loop.mode=sync` (lockstep,
   staleness 0) twice and `loop.mode=async` (the recipe's `max_staleness`) once. All with
   `eval.mode=none` and `buffer.filter=none`, so every generated group is trained, as TRL does;
   same steps, batch_groups, group_size, sampling and lr. Each run resumes from a copy of the warm
   start's checkpoint (the trainer's weights and optimizer state, as the recipe's own run goes
   from SFT into RL); the engines load the warm start's Hugging Face folder (`sft_model`).
   Threads per phase: ours is an engine and a trainer process. Asynchronous, they run at once, so
   each gets the recipe's torch threads (`rollout.engine_threads`, `trainer.num_threads`: 1 and 1
   in the shipped recipes, one core each on 2 cores). Synchronous, they take turns, so one thread
   each would leave a core idle by construction: the sync baseline runs with both set to 1 and
   then to 2 (`SYNC_THREADS`; these win over a `--set` of the same keys), and the better of the
   two is the figure every async/sync ratio and `meets_targets` is taken against
   (`sync.best`), as TRL's better thread count is. Each run records its `engine_threads`,
   `trainer_threads`, `mode` and `max_staleness`.
3. The peer: TRL's GRPOTrainer (miles_async/bench/loop_peers.py, on CPU, `use_cpu=True`) on the same
   `sft_model`, the train split's first `steps * batch_groups` prompts in order (the ones our sync
   run trains), the same group size, prompts per step, steps, max_new_tokens, temperature and lr.
   TRL runs in one process, twice, with 1 and with 2 torch threads (`TRL_THREADS`), and the better
   of the two is the figure our ratios are taken against.

What is measured (`measured` in the JSON says it too): samples/s = trained samples over wall
time, after the first `--warmup-steps` steps (the processes' first compiles, allocations and, in
async, the pipeline filling): for ours, from metrics.jsonl (steps after the warm-up: their
`train/num_samples` over the `perf/wall_s` between the warm-up's last row and the last row); for TRL, its
per-step times (`step_s`, miles_async/bench/loop_peers.py) after the same number of steps. The trainer's idle
fraction over the same steps is sum(step_s - train_s) / sum(step_s); `whole_rl_phase` also gives the
controller's own figures over every step (RunResult). `time_split_s` sums each step's
wait_data_s / train_s / update_s in the window: where our time goes.

`machine.free_cores_*` (before and after) spins one process per CPU for a second: the cores the
machine really gives us. On a shared machine it falls below `cpus`, and the asynchronous loop,
whose gain is running the engine and the trainer at once, has that much less to overlap on;
`cores_used` per run says how many cores our processes got over the window.

Targets (the issue's), in `meets_targets`: async >= 1.5x sync's better figure, async >= 2x TRL's
better figure. `ratios` gives both bases (`sync_samples_per_s`, `trl_samples_per_s`).

`--model smollm2` measures the same on the real model instead: SmolLM2-135M-Instruct on
recipes/smollm2-math.toml (two-digit addition in the chat template), with no warm start (both
sides train the pretrained model as it is), the recipe's sizes (4 prompts x 8 samples, outputs up
to 32 tokens) over 12 steps, the recipe's precision on both sides ("auto" as the run resolves it
on the CPU: bf16 engine and bf16-autocast trainer where bf16 is native, fp32 elsewhere; TRL with
bf16=True exactly when our trainer runs bf16) and the task's own reward in TRL; the prompts reach TRL as text
rendered with the chat template, which it tokenizes back into our prompt ids
(`prompt_ids_match_ours`).
Prints one JSON object on stdout; progress goes to stderr.

    miles-async bench loop --json
    miles-async bench loop --json --quick          # tiny settings (the e2e test)
    miles-async bench loop --json --model smollm2  # the real model: ours vs TRL (~20 min)
    miles-async bench loop --steps 60 --max-new-tokens 32 --keep runs/bench-loop
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

import miles_async
from miles_async.bench._stats import percentile
from miles_async.bench.loop_peers import trl_grpo
from miles_async.kernels.precision import auto_dtype

SHIPPED = Path(str(files("miles_async.recipes")))  # recipes/ in a clone (nothing imports launch/)
DEFAULT_RECIPE = SHIPPED / "reverse.toml"
SMOLLM2_RECIPE = SHIPPED / "smollm2-math.toml"
TARGETS = {"async_over_sync_min": 1.5, "async_over_trl_min": 2.0}
TRL_THREADS = (1, 2)
SYNC_THREADS = (1, 2)  # torch threads per phase (engine and trainer alike) of the sync baseline's runs
# Long-tailed word lengths (mostly 4-6 letters, a tail to 32: task.config.lengths = "zipf"), so
# that answers, and the outputs of a model still learning them, are long-tailed, as real rollouts
# are (measured: output p50 6 tokens, p99 29-36, max 48); `--set` entries come after these and win.
LONG_TAIL = ['task.config.lengths="zipf"', "task.config.max_len=32", "rollout.engine.max_seq_len=128"]
QUICK = {"steps": 4, "batch_groups": 2, "group_size": 4, "max_new_tokens": 16, "warmup_steps": 1, "sft_max_steps": 20}
# --model smollm2: the recipe's own settings (4 prompts x 8 samples, 32 tokens), fewer steps, no warm start.
SMOLLM2 = {"steps": 12, "batch_groups": 4, "group_size": 8, "max_new_tokens": 32, "warmup_steps": 2}


def _progress(line: str) -> None:
    print(f"[bench loop] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


def _load(recipe: Path, overrides: list[str]) -> Any:
    from miles_async.actors.recipe import load_recipe

    return load_recipe(recipe, overrides)


def _run_controller(config: Any, run_dir: Path, *, resume: bool) -> tuple[Any, float]:
    """The run's RunResult and its start (time.time(): metrics.jsonl's wall_s counts from it)."""
    from miles_async.actors.controller import Controller
    from miles_async.runtime import run

    controller = Controller(config, run_dir, resume=resume, progress=False)
    return run(controller.run()), controller.start_time


class CpuSampler:
    """CPU seconds of this process (the controller: scheduler, buffer, rollout workers, HTTP) and of
    each child process (engines, trainer ranks), sampled every `interval_s` on a thread, so a
    window's CPU use can be read afterwards. Needs psutil (installed with the dev extra); without
    it `cores_used` returns None."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._psutil = importlib.import_module("psutil") if importlib.util.find_spec("psutil") else None

    def start(self) -> None:
        if self._psutil is not None:
            self._thread = threading.Thread(target=self._run, name="bench-loop-cpu", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me = self._psutil.Process()
        while not self._stop.wait(self.interval_s):
            children: dict[int, float] = {}
            for child in me.children(recursive=True):
                try:
                    times = child.cpu_times()
                except self._psutil.Error:  # it exited between listing and reading
                    continue
                children[child.pid] = times.user + times.system
            times = me.cpu_times()
            self.samples.append((time.time(), times.user + times.system, children))

    def cores_used(self, start: float, end: float) -> dict | None:
        """Cores busy on average over [start, end] (time.time()): the controller's and each child's."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return None
        (t0, own0, kids0), (t1, own1, kids1) = inside[0], inside[-1]
        span = t1 - t0
        kids = sorted((round((kids1[pid] - kids0[pid]) / span, 3) for pid in kids1 if pid in kids0), reverse=True)
        return {"controller": round((own1 - own0) / span, 3), "children": kids, "total": round(
            (own1 - own0) / span + sum(kids), 3), "span_s": round(span, 3)}


def _load_avg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _burn(seconds: float, out: Any) -> None:
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start_wall < seconds:
        pass
    out.put(time.process_time() - start_cpu)


def free_cores(seconds: float = 1.0) -> float:
    """Cores this machine gives us now: `os.cpu_count()` processes spin for `seconds`; their CPU
    seconds over the wall time. Below cpu_count means someone else is using the machine, and the
    asynchronous loop (engine and trainer at once) has less to overlap on."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_burn, args=(seconds, out)) for _ in range(os.cpu_count() or 1)]
    for proc in procs:
        proc.start()
    cpu_s = sum(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join()
    return round(cpu_s / seconds, 2)


# ----- ours -----


def warm_start(recipe: Path, overrides: list[str], run_dir: Path) -> dict:
    """The recipe's SFT alone; returns where its model folder and checkpoint are, and what it reached."""
    config = _load(recipe, [*overrides, "loop.num_steps=0", 'eval.mode="none"'])
    t0 = time.perf_counter()
    result, _ = _run_controller(config, run_dir, resume=False)
    if not (run_dir / "sft_model" / "config.json").is_file():
        raise RuntimeError(f"the warm start wrote no {run_dir / 'sft_model'} (SFT steps: {result.sft_steps}); "
                           "the recipe's [sft] must run at least one step (sft.max_steps >= 1)")
    return {"sft_steps": result.sft_steps, "sft_probe_accuracy": result.sft_probe_accuracy,
            "wall_s": round(time.perf_counter() - t0, 2)}


def ours(recipe: Path, overrides: list[str], mode: str, warm_dir: Path | None, run_dir: Path,
         warmup_steps: int) -> dict:
    """One RL run (`loop.mode=mode`) from the warm start (None: from the recipe's model as it is);
    its figures over the measured window."""
    config = _load(recipe, [*overrides, f'loop.mode="{mode}"'])
    # From a warm start, the run resumes from its checkpoint: that keeps the SFT optimizer state, as
    # the recipe's own SFT-then-RL run does, and the engines get the warm start's version.
    if warm_dir is not None:
        shutil.copytree(warm_dir / "checkpoints", run_dir / "checkpoints")
    load_before = _load_avg()
    cpu = CpuSampler()
    cpu.start()
    try:
        result, start_time = _run_controller(config, run_dir, resume=warm_dir is not None)
    finally:
        cpu.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/num_samples" in r]  # RL steps only
    if len(rows) <= warmup_steps:
        raise RuntimeError(f"{mode} run logged {len(rows)} steps, not more than the {warmup_steps} warm-up steps")
    window = rows[warmup_steps:]
    start_s = (rows[warmup_steps - 1]["perf/wall_s"] if warmup_steps
               else rows[0]["perf/wall_s"] - rows[0]["perf/step_s"])
    window_s = window[-1]["perf/wall_s"] - start_s
    samples = sum(r["train/num_samples"] for r in window)
    idle_s = sum(max(r["perf/step_s"] - r["perf/train_s"], 0.0) for r in window)
    return {
        "mode": mode,
        "max_staleness": config.loop.staleness,
        "engine_threads": config.rollout.engine_threads,  # torch threads of each engine (the rollout phase)
        "trainer_threads": config.trainer.num_threads,  # torch threads of each trainer rank (the train phase)
        "samples_per_s": round(samples / window_s, 2),
        # over the steps' own durations (one clock): wall_s stamps rows after the write-down, so
        # idle / window_s could pass 1 on a short window
        "trainer_idle_fraction": round(idle_s / max(sum(r["perf/step_s"] for r in window), 1e-9), 3),
        "measured_steps": len(window),
        "measured_samples": samples,
        "window_s": round(window_s, 3),
        "time_split_s": {key: round(sum(r[f"perf/{key}"] for r in window), 3) for key in ("wait_data_s", "train_s", "update_s")},
        "step_s": _spread([r["perf/step_s"] for r in window]),
        # Cores in use over the window: this process (the controller's actors) and each child
        # (engine, trainer; largest first). On 2 cores, a total near 2 means they contend.
        "cores_used": cpu.cores_used(start_time + start_s, start_time + window[-1]["perf/wall_s"]),
        "engine_busy_fraction_mean": round(statistics.fmean(r["perf/engine_busy_fraction"] for r in window), 3),
        "staleness_mean": round(statistics.fmean(r["train/staleness_mean"] for r in window), 3),
        "output_tokens": output_lengths(run_dir / "trace.jsonl", config.rollout.sampling.max_new_tokens),
        "reward_first": _round(result.reward_first),
        "reward_last": _round(result.reward_last),
        "whole_rl_phase": {"steps": result.num_steps, "samples_per_s": round(result.samples_per_s, 2),
                           "trainer_idle_fraction": round(result.trainer_idle_fraction, 3)},
        "wall_s": round(result.wall_s, 2),  # the whole run: spawning, resuming, RL, stopping
        "load_avg_1m": {"before": load_before, "after": _load_avg()},
    }


def output_lengths(trace_path: Path, max_new_tokens: int) -> dict:
    """The distribution of `output_tokens` over every generated sample in a run's trace.jsonl."""
    lengths = [r["output_tokens"] for r in map(json.loads, trace_path.read_text().splitlines())
               if r.get("kind") == "sample"]
    if not lengths:
        raise RuntimeError(f"{trace_path} holds no sample records")
    return {"num_samples": len(lengths), "mean": round(statistics.fmean(lengths), 2),
            **{f"p{q}": round(percentile(lengths, q), 1) for q in (50, 90, 99)}, "max": max(lengths),
            "at_cap_fraction": round(sum(n >= max_new_tokens for n in lengths) / len(lengths), 4)}


def _spread(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 4), "p90": round(percentile(values, 90), 4),
            "max": round(max(values), 4)}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# ----- the peer -----


def train_prompts(model_dir: Path, config: Any, settings: dict) -> list:
    """The train split's first `steps * batch_groups` prompts: those our sync run trains, in order.

    Raises ValueError when the longest of them plus `max_new_tokens` does not fit the engine's context.
    """
    from miles_async.models import load_tokenizer
    from miles_async.task import load_task

    task = load_task(config.task, load_tokenizer(model_dir)).items("train", settings["steps"] * settings["batch_groups"])
    longest = max(len(p.input_ids) for p in task)
    context = config.rollout.engine.max_seq_len
    if context is not None and longest + settings["max_new_tokens"] > context:
        raise ValueError(f"--max-new-tokens {settings['max_new_tokens']} plus the longest prompt ({longest} tokens) "
                         f"exceeds the engine's max_seq_len {context}; lower --max-new-tokens or pass "
                         f"--set rollout.engine.max_seq_len=N")
    return task


def peer_prompts(model_dir: Path, items: list) -> tuple[list[str], list[str]]:
    """The prompts as text TRL tokenizes back into our prompt ids (a chat model's are rendered with
    its template: our ids decoded), and the answers as text."""
    from miles_async.models import load_tokenizer

    if all(hasattr(p, "text") for p in items):
        return [p.text for p in items], [str(p.answer) for p in items]
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.decode(p.input_ids) for p in items], [str(p.answer) for p in items]


def trl(model_dir: Path, task: list, settings: dict, num_threads: int) -> dict:
    """TRL's GRPOTrainer on the same model, prompts and settings; its figures over the same window."""
    load_before = _load_avg()
    texts, answers = peer_prompts(model_dir, task)
    out = trl_grpo(str(model_dir), texts, answers,
                   group_size=settings["group_size"], prompts_per_step=settings["batch_groups"],
                   num_steps=settings["steps"], max_new_tokens=settings["max_new_tokens"],
                   temperature=settings["temperature"], lr=settings["lr"], seed=settings["seed"],
                   num_threads=num_threads, reward=settings["reward"], bf16=settings["bf16"])
    warmup = settings["warmup_steps"]
    window = out["step_s"][warmup:]
    samples = out["samples_per_step"] * len(window)
    rewards = out["reward_mean"]
    return {
        "peer": out["peer"],
        "torch_threads": out["config"]["torch_threads"],
        "samples_per_s": round(samples / sum(window), 2),
        "samples_per_s_trl_own_warmup": out["samples_per_s"],  # loop_peers' figure: only step 0 left out
        "measured_steps": len(window),
        "measured_samples": samples,
        "window_s": round(sum(window), 3),
        "step_s": _spread(window),
        # TRL reports tokens per step, not per sample: the mean is all there is.
        "output_tokens": {"mean": round(sum(out["completion_tokens"]) / (out["samples_per_step"] * len(rewards)), 2)},
        "reward_first": round(statistics.fmean(rewards[:5]), 4),
        "reward_last": round(statistics.fmean(rewards[-5:]), 4),
        "prompts_in_order": out["prompts_in_order"],
        "prompt_ids_match_ours": out["prompt_ids_match_ours"],
        "setup_s": out["setup_s"],
        "versions": out["versions"],
        "config": out["config"],
        "load_avg_1m": {"before": load_before, "after": _load_avg()},
    }


# ----- the whole bench -----


def measure(settings: dict, *, recipe: Path, keep: str = "", skip_trl: bool = False) -> dict:
    """The whole bench (module docstring) with `settings` from `_settings`; returns the JSON object."""
    overrides = [*settings["overrides"], f"loop.batch_groups={settings['batch_groups']}",
                 f"scheduler.group_size={settings['group_size']}",
                 f"rollout.sampling.max_new_tokens={settings['max_new_tokens']}"]
    if settings["sft_max_steps"] is not None:
        overrides.append(f"sft.max_steps={settings['sft_max_steps']}")
    base = _load(recipe, overrides)
    pretrained = settings["model"] == "smollm2"
    settings = {**settings, "temperature": base.rollout.sampling.temperature, "lr": base.trainer.lr,
                "reward": "arithmetic" if pretrained else "reverse",
                # "auto" resolved as the run resolves it on this CPU, so TRL gets the precision ours runs in
                "bf16": base.trainer.on_device(torch.device("cpu")).compute_dtype == "bfloat16",
                "engine_dtype": auto_dtype(base.rollout.engine.dtype, torch.device("cpu")),
                "seed": base.loop.seed, "max_staleness_async": base.loop.max_staleness,
                "threads_per_phase": {"async": {"engine": base.rollout.engine_threads,
                                                "trainer": base.trainer.num_threads},
                                      "sync": list(SYNC_THREADS), "trl": list(TRL_THREADS)},
                "num_engines": base.rollout.num_engines, "trainer_world_size": base.trainer.world_size,
                "weights_transport": base.weights.transport, "partial": base.rollout.partial}
    result: dict[str, Any] = {"bench": "loop", "versions": _versions(), "settings": settings,
                              "measured": _MEASURED.format(warmup=settings["warmup_steps"])}
    result["machine"] = {"cpus": os.cpu_count(), "free_cores_before": free_cores(), "load_avg_1m_before": _load_avg()}
    _progress(f"machine: {result['machine']}")
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        warm_dir: Path | None = None
        if pretrained:  # the real model as it is: no warm start
            from miles_async.models.smollm2 import smollm2_checkpoint

            model_dir = smollm2_checkpoint()
            result["warm_start"] = None
            rl_overrides = list(overrides)
        else:
            warm_dir = root / "warm_start"
            _progress(f"warm start: the recipe's SFT into {warm_dir} ...")
            result["warm_start"] = warm_start(recipe, overrides, warm_dir)
            _progress(f"warm start: {result['warm_start']}")
            model_dir = warm_dir / "sft_model"
            rl_overrides = [*overrides, f'model.path="{model_dir}"']
        task = train_prompts(model_dir, base, settings)
        rl_overrides += ["sft.max_steps=0", 'eval.mode="none"', 'buffer.filter="none"',
                         f"loop.num_steps={settings['steps']}"]
        result["sync"] = _sync_runs(recipe, rl_overrides, warm_dir, root, settings)
        result["async"] = _ours_run(recipe, rl_overrides, "async", warm_dir, root / "async", settings)
        result["trl"] = _trl_runs(model_dir, task, settings, skip=skip_trl)
    result["machine"].update(free_cores_after=free_cores(), load_avg_1m_after=_load_avg())
    result["ratios"] = _ratios(result)
    result["meets_targets"] = _meets_targets(result["ratios"])
    return result


_MEASURED = ("samples_per_s: trained samples / wall time over the steps after the first {warmup} (warm-up left "
             "out); ours from metrics.jsonl (train/num_samples, perf/wall_s), TRL from its per-step times. "
             "trainer_idle_fraction: sum(step_s - train_s) / sum(step_s) over that window. whole_rl_phase: the "
             "controller's RunResult over every RL step. output_tokens: every generated sample in trace.jsonl (ours).")


def _settings(args: argparse.Namespace) -> dict:
    """The run's sizes from the command line (`--quick` fills what was not given); ValueError if unusable."""
    pretrained = args.model == "smollm2"
    quick = {**(SMOLLM2 if pretrained else {}), **(QUICK if args.quick else {})}
    if pretrained and args.quick:
        quick.update(sft_max_steps=None, max_new_tokens=SMOLLM2["max_new_tokens"])
    steps = args.steps or quick.get("steps", 30)
    settings = {
        "model": args.model, "recipe": str(args.recipe), "quick": args.quick, "steps": steps,
        "batch_groups": args.batch_groups or quick.get("batch_groups", 8),
        "group_size": args.group_size or quick.get("group_size", 8),
        "max_new_tokens": args.max_new_tokens or quick.get("max_new_tokens", 48),
        "warmup_steps": quick.get("warmup_steps", 2) if args.warmup_steps is None else args.warmup_steps,
        "sft_max_steps": quick.get("sft_max_steps"),
        # the long tail is the main job's workload; the real model's is the recipe's own
        "overrides": [*([] if pretrained else LONG_TAIL), *args.set],
    }
    if settings["warmup_steps"] < 0 or steps <= max(settings["warmup_steps"], 1):
        raise ValueError(f"--steps ({steps}) must exceed --warmup-steps ({settings['warmup_steps']}) and 1, and "
                         "--warmup-steps must be >= 0")
    if settings["group_size"] < 2:
        raise ValueError(f"--group-size must be >= 2 (GRPO compares samples within a group), got {settings['group_size']}")
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        raise ValueError(f"--keep {args.keep} is not empty; pass a new or empty folder")
    settings["samples_per_step"] = settings["batch_groups"] * settings["group_size"]
    settings["samples_per_run"] = settings["samples_per_step"] * steps
    return settings


def _ours_run(recipe: Path, overrides: list[str], mode: str, warm_dir: Path | None, run_dir: Path,
              settings: dict, label: str = "") -> dict:
    label = label or mode
    _progress(f"ours, {label}: {settings['steps']} steps of {settings['samples_per_step']} samples ...")
    run = ours(recipe, overrides, mode, warm_dir, run_dir, settings["warmup_steps"])
    _progress(f"ours, {label}: {run['samples_per_s']} samples/s, trainer idle {run['trainer_idle_fraction']}, "
              f"output tokens {run['output_tokens']}")
    return run


def _sync_runs(recipe: Path, overrides: list[str], warm_dir: Path | None, root: Path, settings: dict) -> dict:
    """The sync baseline at its best: one run per entry of SYNC_THREADS, the engine and the trainer
    both at that many torch threads (in lockstep the phases take turns, so each may use every core)."""
    runs = {}
    for threads in SYNC_THREADS:
        pinned = [*overrides, f"rollout.engine_threads={threads}", f"trainer.num_threads={threads}"]
        runs[f"threads_{threads}"] = _ours_run(recipe, pinned, "sync", warm_dir, root / f"sync_threads_{threads}",
                                               settings, f"sync, {threads} thread(s) per phase")
    return _with_best(runs, f"Ours in lockstep, the engine and the trainer both at each of {list(SYNC_THREADS)} "
                            "torch threads in turn (the phases take turns, so each may use every core). The "
                            "async/sync ratio and its target are taken against the better run.")


def _with_best(runs: dict[str, dict], note: str) -> dict:
    """`runs` (keyed threads_N) with the key of the one of most samples/s (`best`) and its figure."""
    best = max(runs, key=lambda key: runs[key]["samples_per_s"])
    return {**runs, "best": best, "samples_per_s": runs[best]["samples_per_s"], "note": note}


def _trl_runs(model_dir: Path, task: list, settings: dict, *, skip: bool) -> dict | None:
    if skip:
        _progress("TRL: skipped (--skip-trl)")
        return None
    if importlib.util.find_spec("trl") is None:
        _progress("TRL: not installed (pip install -e .[dev]); its figures are null")
        return None
    runs = {}
    for threads in TRL_THREADS:
        _progress(f"TRL GRPOTrainer, {threads} torch thread(s): {settings['steps']} steps ...")
        runs[f"threads_{threads}"] = trl(model_dir, task, settings, threads)
        _progress(f"TRL, {threads} thread(s): {runs[f'threads_{threads}']['samples_per_s']} samples/s")
    return _with_best(runs, f"TRL runs in one process with each of {list(TRL_THREADS)} torch threads; ours "
                            "asynchronous is an engine and a trainer process at once, with the recipe's threads "
                            "(settings.threads_per_phase.async). The ratios are taken against TRL's better figure.")


def _ratios(result: dict) -> dict:
    """Every ratio against the better sync run and TRL's better run."""
    sync_runs, peer = result["sync"], result["trl"]
    sync = sync_runs[sync_runs["best"]]["samples_per_s"]
    asynchronous = result["async"]["samples_per_s"]
    trl_best = peer[peer["best"]]["samples_per_s"] if peer else None
    return {"async_over_sync": round(asynchronous / sync, 3),
            "async_over_trl": round(asynchronous / trl_best, 3) if trl_best else None,
            "sync_over_trl": round(sync / trl_best, 3) if trl_best else None,
            "sync_samples_per_s": sync, "sync_best": sync_runs["best"],
            "trl_samples_per_s": trl_best, "targets": TARGETS}


def _meets_targets(ratios: dict) -> dict[str, bool | None]:
    meets = {"async_over_sync": ratios["async_over_sync"] >= TARGETS["async_over_sync_min"],
             "async_over_trl": (None if ratios["async_over_trl"] is None
                                else ratios["async_over_trl"] >= TARGETS["async_over_trl_min"])}
    return {**meets, "all": all(v is True for v in meets.values())}


def _versions() -> dict:
    versions = {"miles_async": miles_async.__version__, "python": platform.python_version(),
                "torch": torch.__version__, "cpus": os.cpu_count()}
    for name in ("trl", "transformers"):
        if importlib.util.find_spec(name) is not None:
            versions[name] = __import__(name).__version__
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: the main job's random-init model after an SFT warm start, on long-tailed "
                             "reversal; smollm2: SmolLM2-135M-Instruct on recipes/smollm2-math.toml, no warm start")
    parser.add_argument("--recipe", type=Path, default=None,
                        help=f"the recipe (default: {DEFAULT_RECIPE.name}, or {SMOLLM2_RECIPE.name} with --model smollm2)")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per run (default 30; --quick 4)")
    parser.add_argument("--batch-groups", type=int, default=0, help="groups (prompts) per step (default 8)")
    parser.add_argument("--group-size", type=int, default=0, help="samples per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="the output cap; generous, so lengths are long-tailed (default 48)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the figures (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny settings, for the e2e test (no figure to quote)")
    parser.add_argument("--skip-trl", action="store_true", help="leave the TRL peer out (its figures are null)")
    parser.add_argument("--keep", default="", help="keep the run folders under this new folder (default: a temp one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run, e.g. --set trainer.lr=1e-5 (repeatable)")
    args = parser.parse_args(argv)
    if args.recipe is None:
        args.recipe = SMOLLM2_RECIPE if args.model == "smollm2" else DEFAULT_RECIPE
    if args.model == "smollm2":
        from miles_async.models import smollm2

        if (reason := smollm2.unavailable()) is not None:
            parser.error(f"--model smollm2: the model is not available: {reason}")
    if min(args.steps, args.batch_groups, args.group_size, args.max_new_tokens) < 0:
        parser.error("--steps, --batch-groups, --group-size and --max-new-tokens must be > 0")
    if not args.recipe.is_file():
        parser.error(f"--recipe {args.recipe} is not a file")
    try:
        settings = _settings(args)
    except ValueError as e:
        parser.error(str(e))
    result = measure(settings, recipe=args.recipe, keep=args.keep, skip_trl=args.skip_trl)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
