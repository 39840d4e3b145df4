"""`miles-async sft RECIPE.toml`: supervised fine-tuning as a mode of its own, on the RL runs' trainer ranks.

    [data] JSONL ──tokenize (miles_async.sft)──► examples ──seeded epochs, batch_size each step──►
        data plane ──TrainerGroup.train(objective="sft")──► metrics.jsonl row per step
        every loop.eval_every steps and at the end: the loss on data.num_heldout held-out examples
        checkpoints (background, with the data cursor) ──► final_model/ (a Hugging Face folder)

The same trainer ranks, packing (a batch is split into micro-batches by `trainer.micro_batch_tokens`
and over `trainer.world_size` ranks), loss aggregation, checkpoints and metrics as an RL run; no
engine is started. The order of the examples is a function of the seed alone (epoch e visits them
in a permutation seeded by the seed and e), so the step number says which examples come next: a resumed
run (`--resume`) loads the latest checkpoint, cuts metrics.jsonl back to it and goes on with the
very batches it would have trained, and its weights equal an uninterrupted run's bit for bit.
The output, `final_model/`, is what an RL recipe starts from (`[model] path`).

Each step is `actors.warmstart.sft_step`, the one SFT step this mode and the RL runs' warm start
both take: examples in, through the data plane, one trainer step out.

Recipe sections: `[model]` (as an RL recipe's), `[data]` (`miles_async.sft.SFTDataConfig`),
`[loop]` (`SFTLoopConfig`: epochs or steps, batch size, learning rate, checkpoints, seed) and
`[trainer]` (`TrainerConfig`; the run sets the objective, the paths and the seed), `[observe]`
(`miles_async.observe.ObserveConfig`: wandb, TensorBoard). A key the
run sets is refused naming where it comes from.

Try it: `miles-async sft recipes/sft-reverse.toml --out runs/sft-reverse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from miles_async.actors import PRELOAD
from miles_async.actors.evaluation import as_hf_folder
from miles_async.actors.preflight import model_and_tokenizer
from miles_async.actors.recipe import DERIVED, ModelSection, load_struct, recipe_toml
from miles_async.actors.trainer import ExportWeights, LoadCheckpoint, SaveCheckpoint, TrainerGroup
from miles_async.actors.warmstart import as_samples, lent_to_dataplane, sft_step
from miles_async.observe import ObserveConfig, Progress, check_trackers, open_trackers
from miles_async.observe.logs import MetricsLog, roll_back
from miles_async.runtime import ActorSystem, RuntimeConfig
from miles_async.runtime.dataplane import DataPlane
from miles_async.sft import SFTData, SFTDataConfig, load_sft_data
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig

log = logging.getLogger("miles_async.actors.sft")
ASK_S = 600.0
RUN_STATE = "run_state.json"


class SFTLoopConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An SFT recipe's `[loop]`."""

    epochs: float = 1.0  # passes over the examples (a fraction stops partway)
    eval_every: int = 0  # steps between held-out losses (data.num_heldout examples; 0: at the end only)
    max_steps: int = 0  # > 0: this many steps, whatever `epochs` says
    batch_size: int = 32  # examples per optimizer step
    lr: float = 1e-5  # AdamW's learning rate (the trainer's, for every step)
    checkpoint_every: int = 0  # steps (0: off)
    checkpoint_every_s: float = 120.0  # seconds (0: off); either trigger saves one
    keep_checkpoints: int = 3  # the newest this many checkpoints are kept, older ones deleted
    seed: int = 0  # the examples' order (shuffled anew each epoch) and the trainer's seed

    def __post_init__(self) -> None:
        if not self.epochs > 0 or self.max_steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"loop needs epochs > 0, max_steps >= 0, batch_size >= 1 and lr > 0, got {self.epochs}, "
                             f"{self.max_steps}, {self.batch_size} and {self.lr}")
        if self.eval_every < 0 or self.checkpoint_every < 0 or not self.checkpoint_every_s >= 0 or self.keep_checkpoints < 1:
            raise ValueError("loop.eval_every, checkpoint_every and checkpoint_every_s must be >= 0 and "
                             "keep_checkpoints >= 1")

    def num_steps(self, num_examples: int) -> int:
        return self.max_steps or max(1, math.ceil(self.epochs * num_examples / self.batch_size))


class SFTRecipe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    data: SFTDataConfig = SFTDataConfig()
    loop: SFTLoopConfig = SFTLoopConfig()
    trainer: TrainerConfig = TrainerConfig()
    observe: ObserveConfig = ObserveConfig()  # wandb, TensorBoard; log_samples is for RL runs (they generate)

    def __post_init__(self) -> None:
        if self.observe.log_samples:
            raise ValueError("observe.log_samples is for RL recipes: an SFT run generates no samples to log; "
                             "remove it")


class SFTResult(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    num_steps: int
    num_examples: int
    left_out: int  # examples too long or with nothing to learn
    loss_first: float | None  # mean of the first 5 steps' training loss
    loss_last: float | None  # mean of the last 5
    heldout_loss_first: float | None  # on data.num_heldout examples, before the first step (None: none held out)
    heldout_loss_last: float | None  # after the last step
    tokens_per_s: float
    wall_s: float
    final_model: str
    interrupted: bool
    resumed_from: str | None


# What the run sets in an SFT recipe: the RL recipe's (DERIVED), and the objective and learning rate.
SFT_DERIVED = {**DERIVED, "trainer.objective": "the mode (sft)", "trainer.lr": "loop.lr"}


def load_sft_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SFTRecipe:
    """Read an SFT recipe and apply `key=value` overrides; ValueError naming the bad key and where
    it was written (actors.recipe.load_struct: relative paths from the recipe's folder, too)."""
    return load_struct(SFTRecipe, path, overrides, derived=SFT_DERIVED)


def sft_recipe_toml(recipe: SFTRecipe) -> str:
    """The resolved SFT recipe, every default filled in, as TOML `load_sft_recipe` reads back."""
    return recipe_toml(msgspec.to_builtins(recipe), SFTRecipe, derived=SFT_DERIVED)


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """The examples of step `step` (from 0): positions step * batch_size onwards of the sequence
    that visits every example once per epoch, epoch e in the order random.Random(f"{seed}:{e}") shuffles."""
    out = []
    orders: dict[int, list[int]] = {}
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_examples)
        if epoch not in orders:
            order = list(range(num_examples))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            orders[epoch] = order
        out.append(orders[epoch][offset])
    return out


class SFTRun:
    """One SFT run in `run_dir` (module docstring); `await SFTRun(...).run()`."""

    def __init__(self, recipe: SFTRecipe, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 progress_interval_s: float = 10.0) -> None:
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.progress = progress
        self.progress_interval_s = progress_interval_s
        self.stop = asyncio.Event()
        self.model_dir: Path | None = None
        self.data: SFTData | None = None
        self.started = time.perf_counter()
        self.losses: list[float] = []
        self.tokens = 0
        self.train_s = 0.0
        self.heldout_first: float | None = None
        self.heldout_last: float | None = None

    def prepare(self) -> None:
        """The model (its folder; None when the run makes its own) and the tokenized data, checked
        as a run's pre-flight checks them (actors.preflight) and writing nothing: ValueError naming
        what is wrong with either, before the run folder is made."""
        check_trackers(self.recipe.observe)
        source = self.recipe.model.source()  # a bad model path, Hub id or revision: ValueError
        if source is not None and source.commit:
            log.info("%s", source.describe())
        self.model_dir, tokenizer = model_and_tokenizer(self.recipe.model, self.run_dir)
        self.data = load_sft_data(self.recipe.data, tokenizer)

    async def run(self) -> SFTResult:
        recipe, run_dir = self.recipe, self.run_dir
        self.started = time.perf_counter()
        if self.data is None:
            await asyncio.to_thread(self.prepare)
        run_dir.mkdir(parents=True, exist_ok=True)
        data, model_dir = self.data, self.model_dir or recipe.model.folder(run_dir)  # the run's own model: made once
        assert data is not None
        total = recipe.loop.num_steps(len(data.examples))
        log.info("SFT on %d examples (%d tokens; %d left out, %d held out), %d steps of %d", len(data.examples),
                 data.num_tokens, data.too_long + data.nothing_to_learn, len(data.heldout), total,
                 recipe.loop.batch_size)
        (run_dir / "config.json").write_text(json.dumps(msgspec.to_builtins(recipe), indent=1))
        latest = self._roll_back() if self.resume else None
        config = msgspec.structs.replace(
            recipe.trainer, model_dir=str(model_dir), objective="sft", lr=recipe.loop.lr, seed=recipe.loop.seed,
            checkpoint_dir=str(run_dir / "checkpoints"), weights_dir=str(run_dir / "weights"))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        try:
            async with ActorSystem("sft", config=RuntimeConfig(preload=PRELOAD)) as system:
                trainer = await TrainerGroup.spawn(system, config)
                try:
                    first = 0
                    if latest is not None:
                        first = (await trainer.ask(LoadCheckpoint(path=str(latest)), ASK_S)).step
                        log.info("resumed from %s at step %d", latest, first)
                    trackers = await asyncio.to_thread(  # [observe]: wandb, TensorBoard (wandb.init takes a second)
                        open_trackers, recipe.observe, run_dir, recipe=msgspec.to_builtins(recipe),
                        resume_step=first if self.resume else None)
                    with MetricsLog(run_dir, trackers=trackers) as metrics:
                        if first == 0 and data.heldout:  # the starting point of the held-out curve
                            self.heldout_first = await self._heldout_loss(trainer, system.dataplane)
                            metrics.log({"step": 0, "perf/wall_s": self._now(), "eval/heldout_loss": self.heldout_first})
                        step = await self._train(trainer, system.dataplane, metrics, first, total)
                        if step > first or latest is None:
                            await self._checkpoint(trainer, metrics, background=False)
                    final = ExportWeights(folder=str(run_dir / "final_model" / "buckets"), merged=True)
                    manifest = await trainer.ask(final, ASK_S)
                    await asyncio.to_thread(as_hf_folder, model_dir, manifest, run_dir / "final_model")
                finally:
                    await trainer.stop()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
        head, tail = self.losses[:5], self.losses[-5:]
        return SFTResult(run_dir=str(run_dir), num_steps=step, num_examples=len(data.examples),
                         left_out=data.too_long + data.nothing_to_learn,
                         loss_first=sum(head) / len(head) if head else None,
                         loss_last=sum(tail) / len(tail) if tail else None,
                         heldout_loss_first=self.heldout_first, heldout_loss_last=self.heldout_last,
                         tokens_per_s=self.tokens / max(self.train_s, 1e-9), wall_s=self._now(),
                         final_model=str(run_dir / "final_model"), interrupted=self.stop.is_set() and step < total,
                         resumed_from=None if latest is None else str(latest))

    async def _train(self, trainer: TrainerGroup, dataplane: DataPlane, metrics: MetricsLog, step: int,
                     total: int) -> int:
        """Steps `step` + 1 .. `total` (or until a stop), each written down; the last step taken."""
        loop, data = self.recipe.loop, self.data
        assert data is not None
        examples = data.examples
        last_saved = (step, time.monotonic())
        with Progress(total, phase="SFT", silent=not self.progress, interval_s=self.progress_interval_s) as view:
            while step < total and not self.stop.is_set():
                batch = [examples[i] for i in batch_indices(step, loop.batch_size, len(examples), loop.seed)]
                t0 = time.perf_counter()
                out = await sft_step(trainer, dataplane, batch, lr=loop.lr, data_cursor=(step + 1) * loop.batch_size)
                elapsed = time.perf_counter() - t0
                step += 1
                self.losses.append(out.loss)
                self.tokens += out.num_tokens
                self.train_s += elapsed
                row: dict[str, Any] = {
                    "step": step, "train/epoch": step * loop.batch_size / len(examples), "perf/wall_s": self._now(),
                    "train/loss": out.loss, "train/grad_norm": out.grad_norm, "train/num_samples": out.num_samples,
                    "train/num_tokens": out.num_tokens, "train/num_trained_tokens": out.num_trained_tokens,
                    "perf/tokens_per_s": out.num_tokens / max(elapsed, 1e-9), "perf/step_s": elapsed,
                    "train/lr": loop.lr}
                if data.heldout and (step == total or (loop.eval_every and step % loop.eval_every == 0)):
                    row["eval/heldout_loss"] = self.heldout_last = await self._heldout_loss(trainer, dataplane)
                metrics.log(row)
                view.update(row)
                since_steps, since_s = step - last_saved[0], time.monotonic() - last_saved[1]
                if step < total and ((loop.checkpoint_every and step % loop.checkpoint_every == 0)
                                     or (loop.checkpoint_every_s and since_s >= loop.checkpoint_every_s
                                         and since_steps)):
                    await self._checkpoint(trainer, metrics, background=True)
                    last_saved = (step, time.monotonic())
        return step

    async def _heldout_loss(self, trainer: TrainerGroup, dataplane: DataPlane) -> float:
        assert self.data is not None
        with lent_to_dataplane(await asyncio.to_thread(as_samples, self.data.heldout), dataplane) as samples:
            return await trainer.eval_loss(samples, timeout_s=ASK_S)

    def _now(self) -> float:
        return time.perf_counter() - self.started

    async def _checkpoint(self, trainer: TrainerGroup, metrics: MetricsLog, *, background: bool) -> None:
        state = {"metrics_bytes": metrics.path.stat().st_size}
        info = await trainer.ask(SaveCheckpoint(background=background, files={RUN_STATE: json.dumps(state).encode()},
                                                keep=self.recipe.loop.keep_checkpoints), ASK_S)
        log.info("checkpoint after SFT step %d: %s", info.step, info.path)

    def _roll_back(self) -> Path | None:
        """The latest checkpoint (None: start over) with metrics.jsonl cut back to its length there."""
        latest = checkpoint.latest(self.run_dir / "checkpoints")
        state = json.loads((latest / RUN_STATE).read_text()) if latest is not None else {}
        roll_back(self.run_dir / "metrics.jsonl", state.get("metrics_bytes", 0))
        if latest is None:
            log.info("no checkpoint under %s: starting over", self.run_dir / "checkpoints")
        return latest
