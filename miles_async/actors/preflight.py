"""The pre-flight: what a run can check before it starts, checked before its run folder exists.

`miles-async run`, `launch` (on node 0) and `sft` call it between reading the recipe and making
the run folder (`--out`), so that a bad input costs one line on stderr and leaves nothing behind;
`--dry-run` is these checks without the run. In order:

- placement: every node the recipe's `[placement]` names is one of the run's;
- the trackers: `[observe]` wandb importable, with a key unless it logs offline (WANDB_MODE);
- the model: `[model]` resolved (`ModelSection.resolve`: a local folder, a Hub id's snapshot, the
  packaged `pretrained` one), its config.json of a family we run, its tokenizer read. A run that
  makes its own model (`init_model` under the run folder) has it made once more here, in a scratch
  folder outside the run's and removed after, seeded as the run's, for its tokenizer (0.04 s for
  the tiny preset); a resumed run's own model is read where it is;
- the teacher's model (distillation), as the model;
- the task: the plug-in built with the model's tokenizer and its items drawn, the training set
  (`task.num_prompts`) and the held-out one (`sft.num_probe` or `eval.num_prompts`, the larger):
  a dataset task reads and checks its files there, naming file:line.

`check_run` returns what it built (`Checked`: the tokenizer, the task, its items); the controller
takes it instead of building them again. Every failure is a `ValueError` whose one line names the
value and the fix.

Try it: `miles-async run recipes/reverse.toml --dry-run`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_async.actors.recipe import ModelSection, RunConfig
from miles_async.models import ModelConfig, Tokenizer, init_model, load_tokenizer
from miles_async.observe import check_trackers
from miles_async.task import Task, load_task

__all__ = ["Checked", "check_run", "model_and_tokenizer"]


@dataclass(frozen=True, slots=True)
class Checked:
    """What the pre-flight built, for the run to use (in-process only: it holds live objects)."""

    model_dir: Path | None  # the model's folder; None: the run makes its own under the run folder
    tokenizer: Tokenizer
    task: Task
    dataset: list[Any]  # the task's "train" items
    probe: list[Any]  # its "probe" items: the warm start's stop rule and the evaluations
    teacher_dir: Path | None  # distillation's teacher; None: no teacher


def model_and_tokenizer(model: ModelSection, run_dir: Path | None = None, what: str = "model") -> tuple[
        Path | None, Tokenizer]:
    """The model's folder (None: the run makes its own under `run_dir`) and its tokenizer, checked
    as the module docstring says; writes nothing under `run_dir`."""
    if run_dir is not None:
        model = model.pinned(run_dir)  # a resumed run: the Hub commit it started from
    folder = model.resolve()
    if folder is not None:
        return folder, _read_model(folder, f"{what}.path" if model.path else f"{what}.pretrained")
    own = run_dir / "model" if run_dir is not None else None
    if own is not None and (own / "config.json").is_file():  # a resumed run's model, made by its first start
        return None, _read_model(own, "the run's own model")
    with tempfile.TemporaryDirectory(prefix="miles-async-preflight-") as scratch:
        try:
            init_model(model.family, model.preset, scratch, seed=model.seed)
        except ValueError as e:  # an unknown family or preset
            raise ValueError(f"{what}: {e}") from e
        return None, load_tokenizer(scratch)


def _read_model(folder: Path, what: str) -> Tokenizer:
    """The tokenizer of a model folder, once its config.json reads as a family we run."""
    try:
        ModelConfig.from_hf(folder)
        return load_tokenizer(folder)
    except (OSError, KeyError, ValueError) as e:  # no or a broken config.json, an unsupported family, no tokenizer
        detail = f"no {e.args[0]} in its config.json" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{what} {folder}: {detail}") from e


def check_run(config: RunConfig, run_dir: str | Path | None = None, *, num_nodes: int = 1) -> Checked:
    """Check a run of `config` on `num_nodes` nodes into `run_dir` (module docstring) and return
    what was built; ValueError naming the first problem. Writes nothing under `run_dir`."""
    beyond = sorted(n for n in config.placement.nodes if n >= num_nodes)
    if beyond:
        fix = "launch that many nodes (miles-async launch)" if num_nodes == 1 else f"--nnodes is {num_nodes}"
        raise ValueError(f"[placement] puts work on node(s) {beyond} but the run has {num_nodes} node(s): {fix}, or "
                         "change [placement]")
    check_trackers(config.observe)  # wandb asked for: importable, and a key unless it logs offline
    model_dir, tokenizer = model_and_tokenizer(config.model, Path(run_dir) if run_dir is not None else None)
    teacher_dir = config.teacher.resolve()
    if teacher_dir is not None:
        _read_model(teacher_dir, "teacher.path" if config.teacher.path else "teacher.pretrained")
    num_probe = max(config.sft.num_probe, config.eval.num_prompts)
    try:
        task = load_task(config.task, tokenizer)
        dataset = list(task.items("train", config.task.num_prompts))
        probe = list(task.items("probe", num_probe))
    except OSError as e:  # a plug-in's file that is not there or cannot be read: its own error, in one line
        raise ValueError(f"task.plugin {config.task.plugin}: {e}") from e
    return Checked(model_dir=model_dir, tokenizer=tokenizer, task=task, dataset=dataset, probe=probe,
                   teacher_dir=teacher_dir)
