"""The SFT warm start before RL (the recipe's `[sft]`): train on the task's own examples until the
policy solves some held-out items by sampling.

    task.sft_examples(items) ──sft_step: TokenData──► data plane ──Trajectory refs──► TrainerGroup.train(objective="sft")
          every probe_every steps: push the weights, score probe items at temperature 1 (Evaluator.score)
          stop at target_accuracy, at max_steps, or when the run is asked to stop

Why a warm start: GRPO learns only from groups whose rewards differ; a random model never answers
right, so every group scores 0 and is filtered. A short SFT to a sampled accuracy of 0.1-0.3 is
where GRPO learns fastest on the demo tasks (shared/peers/rl-demo-calibration.md).

Each step is `sft_step`, the one SFT step of `miles-async sft` too (miles_async/actors/sft.py: SFT as a mode of
its own, from a data file, ending in a model folder a recipe's `model.path` can start from).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

import msgspec

from miles_async.actors.trainer import TrainerGroup
from miles_async.observe import Progress
from miles_async.runtime.dataplane import DataPlane
from miles_async.task import Task
from miles_async.trainer.step import StepMetrics
from miles_async.trajectory import TokenData, Trajectory, blobs, encode_data

log = logging.getLogger("miles_async.actors.warmstart")
ASK_S = 600.0


class ProbeScorer(Protocol):
    """What the warm start needs of the run's evaluator (miles_async/actors/evaluation.py's `Evaluator`): the
    run's clock and the score of a probe set. A protocol, so this module (which the recipe imports
    for `WarmStartConfig`) does not import the evaluator and, through it, the fleet."""

    def now(self) -> float: ...

    async def score(self, items: list[Any], *, temperature: float) -> float: ...


class WarmStartConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[sft]`."""

    # At most this many SFT steps before RL; 0 (the default) skips the warm start: a pretrained model
    # needs none, and a recipe that starts from a random-init model asks for one.
    max_steps: int = 0
    batch_size: int = 32  # the task's items per SFT step (rendered by task.sft_examples)
    lr: float = 1e-3  # the warm start's learning rate (RL then uses trainer.lr)
    target_accuracy: float = 0.15  # sampled (temperature 1) accuracy on the probe set that ends it
    probe_every: int = 10  # steps between probes (weights pushed, probe set scored), and after the last
    num_probe: int = 64  # held-out items in the probe set, one sample each

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.batch_size < 1 or self.probe_every < 1 or self.num_probe < 1:
            raise ValueError(f"sft needs max_steps >= 0 and batch_size, probe_every, num_probe >= 1, got "
                             f"{self.max_steps}, {self.batch_size}, {self.probe_every}, {self.num_probe}")


def as_samples(examples: Sequence[tuple[list[int], list[int]]]) -> list[Trajectory]:
    """(token ids, loss mask) examples as trainer samples, their arrays inline (each a group of its
    own: SFT examples share no prompt)."""
    samples = []
    for i, (tokens, mask) in enumerate(examples):
        num_generated = sum(1 for m in mask if m)
        first = list(mask).index(1) if num_generated else len(tokens)
        samples.append(Trajectory(prompt_id=i, num_tokens=len(tokens), num_prompt_tokens=first,
                                  num_generated_tokens=num_generated,
                                  data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=[0.0] * len(tokens))))
    return samples


def into_dataplane(samples: list[Trajectory], dataplane: DataPlane) -> list[Trajectory]:
    """`samples` with their inline arrays moved into `dataplane` (what a message may carry)."""
    return [msgspec.structs.replace(s, data=dataplane.put(encode_data(s.data))) if isinstance(s.data, TokenData)
            else s for s in samples]


@contextlib.contextmanager
def lent_to_dataplane(samples: list[Trajectory], dataplane: DataPlane) -> Iterator[list[Trajectory]]:
    """`samples` moved into `dataplane` for one use (an SFT step, a held-out loss): the caller owns
    the blobs while the block runs, and they are freed once when it ends, however it ends."""
    moved = into_dataplane(samples, dataplane)
    try:
        yield moved
    finally:
        dataplane.free(blobs(moved))


async def sft_step(trainer: TrainerGroup, dataplane: DataPlane, examples: Sequence[tuple[list[int], list[int]]], *,
                   lr: float, data_cursor: int = -1) -> StepMetrics:
    """One SFT step on `examples` (token ids, loss mask), through the data plane to the trainer's
    ranks: the step of the warm start and of `miles-async sft` (miles_async/actors/sft.py)."""
    with lent_to_dataplane(await asyncio.to_thread(as_samples, examples), dataplane) as samples:
        return await trainer.train(samples, objective="sft", lr=lr, data_cursor=data_cursor, timeout_s=ASK_S)


async def warm_start(config: WarmStartConfig, *, task: Task, dataset: list[Any], probe: list[Any],
                     trainer: TrainerGroup, dataplane: DataPlane, evaluator: ProbeScorer,
                     push: Callable[[], Awaitable[Any]], stop: asyncio.Event, progress: Progress,
                     on_version: Callable[[int], None]) -> tuple[int, float | None]:
    """Run the warm start (module docstring); (steps taken, last probe accuracy). `push()` pushes the
    trainer's weights to the engines; `on_version(v)` hears each new weight version; `progress`
    shows each step (phase "SFT": the loss, and the sampled probe accuracy as `eval/score`)."""
    if config.max_steps <= 0:
        return 0, None
    probe = probe[:config.num_probe]
    accuracy = None
    step = 0
    with progress.in_phase("SFT", config.max_steps) as view:
        for step in range(1, config.max_steps + 1):
            start = (step - 1) * config.batch_size
            items = [dataset[(start + i) % len(dataset)] for i in range(config.batch_size)]
            examples = await asyncio.to_thread(task.sft_examples, items)  # rendering is work: off the loop
            metrics = await sft_step(trainer, dataplane, examples, lr=config.lr)
            on_version(metrics.weight_version)
            row: dict[str, float] = {"step": step, "train/loss": metrics.loss, "perf/wall_s": evaluator.now()}
            if step % config.probe_every == 0 or step == config.max_steps:
                await push()
                probed = row["eval/score"] = await evaluator.score(probe, temperature=1.0)
                accuracy = probed
                view.update(row)
                log.debug("SFT step %d: loss %.3f, sampled probe accuracy %.3f", step, metrics.loss, probed)
                if probed >= config.target_accuracy or stop.is_set():
                    break
            else:
                view.update(row)
    log.info("SFT warm start: %d steps, sampled probe accuracy %s", step,
             "n/a" if accuracy is None else f"{accuracy:.3f}")
    return step, accuracy
