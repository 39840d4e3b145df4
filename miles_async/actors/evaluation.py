"""Evaluation of the policy during a run (`[eval]`), and the scoring the SFT warm start's probe uses.

    Evaluator.evaluate(step) ─ "shared":    HoldRollouts ─► the run's engines answer the held-out items ─► resume
                             ─ "dedicated": the weights pushed to an engine of its own; rollouts go on
                             ─ "command":   the user's command (e.g. lm-eval) on the run's engine ({url}) or a
                                            checkpoint folder ({checkpoint}) ─► {"score": x} or lm-eval's results

A single-turn task is scored by generating one answer per held-out item (`task.prompt_ids`) and
taking the task's reward; a multi-turn one by running the agent's episode per item through the
session server (the environment's verifier scores it). Each evaluation is one `eval` record of
the trace. The `[eval]` section itself, `EvalConfig`, is in miles_async/actors/eval_config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from miles_async.actors.fleet import Fleet
from miles_async.actors.rollout import environment_factory
from miles_async.actors.scheduler import HoldRollouts
from miles_async.actors.sessions import CloseSessions
from miles_async.actors.trainer import ExportWeights
from miles_async.engine.backend import GenerateParams, connect
from miles_async.engine.client import bearer
from miles_async.observe import EvalTrace, TraceLog
from miles_async.task import Completion, Task, load_object

log = logging.getLogger(__name__)

ASK_S = 600.0


class Evaluator:
    """Scores the policy on held-out `items` of `task` (module docstring). `now()` is the run's
    clock (seconds since it started); `push(pusher)` pushes the trainer's current weights through
    a pusher (the dedicated eval engine's)."""

    def __init__(self, config: Any, fleet: Fleet, task: Task, items: list[Any], *, trace: TraceLog,
                 now: Callable[[], float], push: Callable[[Any], Awaitable[Any]]) -> None:
        self.config = config
        self.fleet = fleet
        self.task = task
        self.items = items
        self.trace = trace
        self.now = now
        self.push = push
        self.scores: list[tuple[int, float]] = []
        self._command_metrics: dict[int, dict[str, float]] = {}  # mode "command": lm-eval's, by step
        self._probe_round = 0

    async def score(self, items: list[Any], *, temperature: float, url: str | None = None) -> float:
        """Mean score of one sample per item: the task's reward of a single generation, or an agent's
        episode for a multi-turn task."""
        if self.task.multi_turn:
            return await self._score_episodes(items, temperature=temperature)
        urls = [url] if url else [self.fleet.engine_urls[e.name] for e in self.fleet.engines]
        params = GenerateParams(max_new_tokens=self.config.rollout.sampling.max_new_tokens, temperature=temperature)
        backends = [connect(self.config.rollout.backend, u, api_key=self.fleet.api_key, timeout_s=ASK_S,
                            adapter=self.fleet.adapter) for u in urls]
        try:
            outputs = await asyncio.gather(*(backends[i % len(backends)].generate(self.task.prompt_ids(item), params,
                                                                                   version=0)
                                             for i, item in enumerate(items)))
        finally:
            for backend in backends:
                await backend.close()
        scores = [float(await self.task.reward(item, Completion(text=out.text, token_ids=out.output_ids,
                                                                finish_reason=out.finish_reason)))
                  for item, out in zip(items, outputs)]
        return statistics.fmean(scores) if scores else 0.0

    async def _score_episodes(self, items: list[Any], *, temperature: float) -> float:
        """Mean reward of one episode per item, through the session server (sessions closed after),
        each driven as a rollout worker drives one: the recipe's rollout function, an environment
        of its own (no sandbox)."""
        cfg = self.config
        assert self.fleet.sessions is not None
        agent = load_object(cfg.agent.agent, "agent")
        make_environment = environment_factory(cfg.agent.environment)
        rollout = load_object(cfg.agent.rollout, "rollout function")
        sampling = {"temperature": temperature, "max_tokens": cfg.rollout.sampling.max_new_tokens}
        self._probe_round += 1
        ids = [f"probe{self._probe_round}-{i}" for i in range(len(items))]
        url = self.fleet.sessions_url
        async with aiohttp.ClientSession(headers=bearer(self.fleet.api_key)) as http:  # a session server off node 0
            episodes = await asyncio.gather(*(rollout(agent, make_environment(), item, f"{url}/sessions/{sid}/v1",
                                                      sampling=sampling, http=http)
                                              for item, sid in zip(items, ids)))
        await self.fleet.sessions.ask(CloseSessions(session_ids=ids), timeout_s=ASK_S)
        return statistics.fmean(e.reward or 0.0 for e in episodes) if episodes else 0.0

    async def evaluate(self, step: int) -> float:
        """Score the current weights (the caller has settled any weight push in flight)."""
        cfg = self.config.eval
        start = self.now()
        items = self.items[:cfg.num_prompts]
        if cfg.mode == "shared":
            assert self.fleet.scheduler is not None
            await self.fleet.scheduler.ask(HoldRollouts(hold=True), timeout_s=ASK_S)
            try:
                score = await self.score(items, temperature=cfg.temperature)
            finally:
                await self.fleet.scheduler.ask(HoldRollouts(hold=False), timeout_s=ASK_S)
        elif cfg.mode == "dedicated":
            if self.task.multi_turn:
                raise ValueError('eval.mode = "dedicated" is not wired for agents yet: use "shared" or "command"')
            await self.push(self.fleet.eval_pusher)
            score = await self.score(items, temperature=cfg.temperature, url=self.fleet.engine_urls["eval-engine"])
        else:
            score = await self._run_command(step)
        self.trace.write(EvalTrace(step=step, score=score, num_samples=len(items), mode=cfg.mode, start_s=start,
                                   end_s=self.now()))
        self.scores.append((step, score))
        return score

    def metrics_of(self, step: int) -> dict[str, float]:
        """Mode "command": the metrics lm-eval returned at `step`'s evaluation, as metrics-row keys
        ("eval/<task>/<metric>"); empty for other modes and steps."""
        return {f"eval/{name}": value for name, value in self._command_metrics.get(step, {}).items()}

    async def _run_command(self, step: int) -> float:
        """Run the user's command on the current weights (miles_async/actors/eval_config.py: EvalConfig); its score."""
        cfg, fleet = self.config.eval, self.fleet
        folder = fleet.folder.run_dir / "eval" / f"step_{step:06d}"
        output = folder / "results"
        if "{checkpoint}" in cfg.command:
            assert fleet.trainer is not None
            manifest = await fleet.trainer.ask(ExportWeights(folder=str(folder / "buckets"), merged=True), ASK_S)
            await asyncio.to_thread(as_hf_folder, fleet.folder.model_dir, manifest, folder)
        shutil.rmtree(output, ignore_errors=True)  # a step evaluated again (a resumed run): its own results only
        output.mkdir(parents=True)
        url = fleet.engine_urls[fleet.engines[0].name] if fleet.engines else ""
        values = {"{url}": url, "{model}": str(fleet.folder.model_dir), "{checkpoint}": str(folder),
                  "{output}": str(output)}
        command = cfg.command
        for placeholder, value in values.items():
            command = command.replace(placeholder, shlex.quote(value))
        env = {**os.environ, "OPENAI_API_KEY": fleet.api_key} if fleet.api_key else None
        holder = fleet.scheduler if "{url}" in cfg.command else None  # the engine answers the command alone
        if holder is not None:
            await holder.ask(HoldRollouts(hold=True), timeout_s=ASK_S)
        try:
            out, err, code = await run_shell(command, env, cfg.command_timeout_s)
        finally:
            if holder is not None:
                await holder.ask(HoldRollouts(hold=False), timeout_s=ASK_S)
        lines = out.strip().splitlines()
        if code != 0:
            raise RuntimeError(f"eval command {command!r} failed (exit {code}): {err[-2000:]}")
        score = _score_line(lines[-1]) if lines else None
        results = read_lm_eval_results(output)
        if results:
            self._command_metrics[step] = results
            log.info("eval command at step %d: %s", step, results)
        if score is not None:
            return score
        if not results:
            raise RuntimeError(f"eval command {command!r}: its last stdout line must be {{\"score\": x}}, or it must "
                               f"write lm-eval's results under {{output}}; got {lines[-1] if lines else 'no output'!r} "
                               f"and no results_*.json under {output}")
        name = cfg.metric or next(iter(results))
        if name not in results:
            raise RuntimeError(f"eval.metric = {name!r} is not among the results of {command!r}: "
                               f"{', '.join(results)}")
        return results[name]


async def run_shell(command: str, env: dict[str, str] | None, timeout_s: float) -> tuple[str, str, int]:
    """(stdout, stderr, exit status) of a shell command; past `timeout_s` (or when the caller is
    cancelled) its whole process group is killed, so no evaluator outlives its evaluation."""
    proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"eval command {command!r} ran past {timeout_s:g}s (eval.command_timeout_s)") from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode is not None
    return out.decode(errors="replace"), err.decode(errors="replace"), proc.returncode


def _score_line(line: str) -> float | None:
    """x from a line {"score": x}; None for any other line."""
    try:
        obj = json.loads(line)
        return float(obj["score"]) if isinstance(obj, dict) and "score" in obj else None
    except (ValueError, TypeError):
        return None


def read_lm_eval_results(folder: Path) -> dict[str, float]:
    """The metrics of the lm-eval results files (`results_*.json`, oldest first) under `folder`:
    {"task/metric": value} in lm-eval's order, its ",none" filter suffix dropped; standard errors,
    non-numeric and "N/A" values left out."""
    metrics: dict[str, float] = {}
    for path in sorted(folder.rglob("results_*.json"), key=lambda p: p.stat().st_mtime):
        for task, values in json.loads(path.read_text()).get("results", {}).items():
            for key, value in values.items():
                metric, comma, _filter = key.partition(",")
                if comma and "_stderr" not in metric and type(value) in (int, float):
                    metrics[f"{task}/{key.removesuffix(',none')}"] = float(value)
    return metrics


def as_hf_folder(model_dir: Path, manifest: Any, folder: Path) -> None:
    """A checkpoint folder `load_pretrained` and transformers read: the model's config and tokenizer
    files beside one `model.safetensors` merged from the exported buckets."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for bucket in manifest.buckets:
        tensors.update(load_file(bucket.path))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix in (".json", ".txt", ".jinja") and "safetensors" not in path.name:
            shutil.copy2(path, folder / path.name)
    shutil.rmtree(Path(manifest.folder), ignore_errors=True)
