"""The task plug-in: what a run trains on, named in the recipe, behind one small Protocol.

    [task]
    plugin = "miles_async.tasks.reverse:ReverseTask"   # package.module:Class, or a built-in name: "reverse"
    num_prompts = 20000
    [task.config]                                       # the plug-in's own `Config` struct
    min_len = 4

A task is a class with a `Config` (a msgspec Struct: its settings, with defaults; unknown keys are
refused naming the valid ones) built as `Task(config, tokenizer)`. It gives the run:
- `items(split, count)`: the training set ("train") and a held-out set ("probe": the SFT warm
  start's stop rule and the evaluations), deterministic;
- `prompt_ids(item)` and `reward(item, completion)`: a single generation's prompt and its score;
- `sft_examples(items)`: (token ids, loss mask) per item for the SFT warm start ([] if it has none);
- `multi_turn`: True when each item is an agent's episode ([agent] in the recipe: the agent talks
  to the policy through the TITO session server, and the environment's `verify` scores it);
- `Item`: the type of its items, to decode one that crossed a node as plain data.

No role (`miles_async.actors`) imports a task module: the controller and the rollout workers load
the plug-in by its path (`load_task`). The shipped tasks, each also named by its short name
(`BUILT_IN_TASKS`): `reverse` (`miles_async.tasks.reverse:ReverseTask`, the main job), `dataset`
(`miles_async.tasks.dataset:DatasetTask`: your JSONL, JSON, Parquet or Hub dataset of prompts and
answers, with a math, exact, regex or own reward), `calculator`
(`miles_async.tasks.calculator:CalculatorTask`, multi-turn, with a tool) and `arithmetic`
(`miles_async.tasks.arithmetic:ArithmeticTask`, addition for a pretrained chat model).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

import msgspec

Split = Literal["train", "probe"]
# The shipped tasks' short names, for `[task] plugin` (the long form works too).
BUILT_IN_TASKS = {
    "reverse": "miles_async.tasks.reverse:ReverseTask",
    "dataset": "miles_async.tasks.dataset:DatasetTask",
    "calculator": "miles_async.tasks.calculator:CalculatorTask",
    "arithmetic": "miles_async.tasks.arithmetic:ArithmeticTask",
}


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One generation, as a reward function sees it."""

    text: str  # the decoded response (not the prompt)
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class Task(Protocol):
    """A task plug-in (module docstring)."""

    Config: ClassVar[type[msgspec.Struct]]
    Item: ClassVar[type]
    multi_turn: bool

    def __init__(self, config: Any, tokenizer: Any) -> None: ...  # config: an instance of Config

    def items(self, split: Split, count: int) -> Sequence[Any]: ...

    def prompt_ids(self, item: Any) -> list[int]: ...

    async def reward(self, item: Any, completion: Completion) -> float: ...

    def sft_examples(self, items: Sequence[Any]) -> list[tuple[list[int], list[int]]]: ...


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[task]` table."""

    # The task: a built-in name ("reverse", "dataset", "calculator", "arithmetic") or `package.module:Class`
    plugin: str = "miles_async.tasks.reverse:ReverseTask"
    num_prompts: int = 20000  # the training set (positions cycle when the run outlasts it)
    config: dict[str, Any] = {}  # the plug-in's Config, as a table

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"task.num_prompts must be >= 1, got {self.num_prompts}")


def load_object(path: str, what: str) -> Any:
    """`package.module:name` -> the object; ValueError naming what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: {module_name} has no {attr!r}")
    return getattr(module, attr)


def task_class(spec: TaskSpec) -> type[Task]:
    """The plug-in's class (a built-in name, or `package.module:Class`), checked to look like a task."""
    if spec.plugin not in BUILT_IN_TASKS and ":" not in spec.plugin:
        close = difflib.get_close_matches(spec.plugin, BUILT_IN_TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"task.plugin {spec.plugin!r} is neither a built-in task{hint} ({', '.join(BUILT_IN_TASKS)}) "
                         "nor 'package.module:Class'")
    cls = load_object(BUILT_IN_TASKS.get(spec.plugin, spec.plugin), "task.plugin")
    missing = [name for name in ("Config", "Item", "items", "prompt_ids", "reward", "sft_examples")
               if not hasattr(cls, name)]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"task.plugin {spec.plugin!r} is not a task class: it lacks {', '.join(missing) or 'a class'} "
                         "(see miles_async.task.Task)")
    return cast("type[Task]", cls)  # a class with Task's members: what a type checker cannot see in a plug-in


def task_config(spec: TaskSpec) -> msgspec.Struct:
    """The plug-in's `Config` from `[task.config]`; ValueError naming an unknown or ill-typed key."""
    cls = task_class(spec)
    fields = [f.encode_name for f in msgspec.structs.fields(cls.Config)]
    unknown = sorted(set(spec.config) - set(fields))
    if unknown:
        matches = (difflib.get_close_matches(key, fields, n=1) for key in unknown)
        close = [f"task.config.{match[0]}" for match in matches if match]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown key(s) task.config.{', task.config.'.join(unknown)} for {spec.plugin}{hint}; "
                         f"its Config has: {', '.join(fields)}")
    try:
        return msgspec.convert(spec.config, cls.Config)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"task.config ({spec.plugin}): {e}") from e


def load_task(spec: TaskSpec, tokenizer: Any) -> Task:
    """Build the task a recipe names, with the model's tokenizer."""
    return task_class(spec)(task_config(spec), tokenizer)


def decode_item(task: Task, item: Any) -> Any:
    """An item as the task's own type (one that crossed a node arrives as plain data)."""
    return item if isinstance(item, task.Item) else msgspec.convert(item, task.Item)
