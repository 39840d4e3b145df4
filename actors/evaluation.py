"""Evaluation of the policy during a run (`[eval]`), and the scoring the SFT warm start's probe uses.

    Evaluator.evaluate(step) ─ "shared":    HoldRollouts ─► the run's engines answer the held-out items ─► resume
                             ─ "dedicated": the weights pushed to an engine of its own; rollouts go on
                             ─ "command":   a checkpoint folder ─► the user's command ─► {"score": x}

A single-turn task is scored by generating one answer per held-out item (`task.prompt_ids`) and
taking the task's reward; a multi-turn one by running the agent's episode per item through the
session server (the environment's verifier scores it). Each evaluation is one `eval` record of
the trace.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec

from miles_async.actors.fleet import Fleet
from miles_async.actors.scheduler import HoldRollouts
from miles_async.actors.sessions import CloseSessions
from miles_async.actors.trainer import ExportWeights
from miles_async.engine.backend import GenerateParams, connect
from miles_async.engine.client import bearer
from miles_async.observe import EvalTrace, TraceLog
from miles_async.task import Completion, Task, load_object

ASK_S = 600.0


class EvalConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[eval]`: how and how often the policy is scored on held-out items."""

    mode: Literal["none", "shared", "dedicated", "command"] = "shared"
    every: int = 20  # steps between evaluations (and after the last step); 0: never
    at_start: bool = False  # also score the starting weights (step 0, after any warm start) of a fresh run
    num_prompts: int = 64
    temperature: float = 0.0
    command: str = ""  # mode "command": run with {checkpoint} replaced; its last stdout line is {"score": x}

    def __post_init__(self) -> None:
        if self.mode == "command" and not self.command:
            raise ValueError('eval.mode = "command" needs eval.command (with {checkpoint} where the folder goes)')
        if self.every < 0 or self.num_prompts < 1:
            raise ValueError(f"eval.every must be >= 0 and eval.num_prompts >= 1, got {self.every} and {self.num_prompts}")

    def due(self, step: int, last: int) -> bool:
        return self.mode != "none" and self.every > 0 and (step % self.every == 0 or step == last)


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
        """Mean reward of one episode per item, through the session server (sessions closed after)."""
        from miles_async.agents.api import run_episode

        cfg = self.config
        assert self.fleet.sessions is not None
        agent = load_object(cfg.agent.agent, "agent")
        environment = load_object(cfg.agent.environment, "environment")()
        sampling = {"temperature": temperature, "max_tokens": cfg.rollout.sampling.max_new_tokens}
        self._probe_round += 1
        ids = [f"probe{self._probe_round}-{i}" for i in range(len(items))]
        url = self.fleet.sessions_url
        async with aiohttp.ClientSession(headers=bearer(self.fleet.api_key)) as http:  # a session server off node 0
            episodes = await asyncio.gather(*(run_episode(agent, environment, item, f"{url}/sessions/{sid}/v1",
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

    async def _run_command(self, step: int) -> float:
        """Write a loadable checkpoint folder, run the command on it, read {"score": x} from its last line."""
        assert self.fleet.trainer is not None
        folder = self.fleet.folder.run_dir / "eval" / f"step_{step:06d}"
        manifest = await self.fleet.trainer.ask(ExportWeights(folder=str(folder / "buckets"), merged=True), ASK_S)
        await asyncio.to_thread(as_hf_folder, self.fleet.folder.model_dir, manifest, folder)
        command = self.config.eval.command.replace("{checkpoint}", shlex.quote(str(folder)))
        proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), ASK_S)
        lines = out.decode().strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"eval command {command!r} failed (exit {proc.returncode}): {err.decode()[-2000:]}")
        try:
            return float(json.loads(lines[-1])["score"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"eval command {command!r}: its last stdout line must be {{\"score\": x}}, "
                               f"got {lines[-1]!r}") from e


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
