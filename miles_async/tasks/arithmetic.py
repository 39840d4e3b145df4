"""Addition in words, for a real chat model: the task of `recipes/smollm2-math.toml`.

The user asks, through the model's own chat template, `Add 59 and 63. Write the equation.`; a
chat model answers in its own words, `The equation is 59 + 63 = 122.` The reward is exact: 1.0
when the first number after the first `=` of the answer is the sum, else 0.0 (`answer_of`). What
the model writes around it is free, so the reward is about the arithmetic, not a format the model
has never seen; an answer with no `=` scores 0.

Why this task for SmolLM2-135M-Instruct (measured greedy on 100 problems each with the embedded
engine, the GGUF conversion of `miles_async.models.smollm2`): one-digit operands 0.91, two-digit
0.23, three-digit 0.04. Two digits is where the model is right sometimes, so GRPO has groups
with both outcomes to learn from. Asked instead for "only the number", the model never answered
with only the number (0 of 300); asked `59 + 63 =`, 2-9%.

The plug-in (`miles_async.task`): `ArithmeticTask`, named in a recipe as
`plugin = "miles_async.tasks.arithmetic:ArithmeticTask"` with `[task.config]` filling
`ArithmeticTaskConfig`. Its items are `Problem`s: every pair (a, b) of the operand range belongs
to one split, by a stable hash of the seed and the pair, so the held-out problems are never
trained on; `problem_id` is the pair's index in the range. It has no SFT examples (the model
starts from what it can do). The prompt is rendered with the tokenizer's chat template (its
default system message included, as the model expects), ending with the assistant's header.

Try it:
    from miles_async.models import load_tokenizer
    from miles_async.models.smollm2 import smollm2_checkpoint
    from miles_async.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
    task = ArithmeticTask(ArithmeticTaskConfig(), load_tokenizer(smollm2_checkpoint()))
    print(task.items("probe", 3))
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import msgspec

from miles_async.task import Completion, Split

_RESULT = re.compile(r"=\s*(-?\d[\d,]*)")


class ArithmeticTaskConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Operand range, the question's wording and how the held-out problems are chosen."""

    min_value: int = 10  # smallest operand (inclusive)
    max_value: int = 99  # largest operand (inclusive)
    # The user's message; {a} and {b} are the operands.
    question: str = "Add {a} and {b}. Write the equation."
    system: str = ""  # a system message; "" leaves the chat template's default (SmolLM2 has one)
    seed: int = 0  # which pairs are held out, and the order of each split's pairs
    probe_every: int = 8  # about 1 pair in `probe_every` is held out

    def __post_init__(self) -> None:
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {self.min_value} and {self.max_value}")
        if "{a}" not in self.question or "{b}" not in self.question:
            raise ValueError(f"question must contain {{a}} and {{b}}, got {self.question!r}")
        if self.probe_every < 2:
            raise ValueError(f"probe_every must be >= 2 (1 would hold out every pair), got {self.probe_every}")


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One question: the operands, its prompt's token ids and the sum expected."""

    problem_id: int
    a: int
    b: int
    input_ids: list[int]

    @property
    def answer(self) -> int:
        return self.a + self.b


class ChatTokenizer(Protocol):
    """The part of `miles_async.models.tokenizer.Tokenizer` the task uses."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
                            **kwargs: Any) -> str: ...


def answer_of(text: str) -> int | None:
    """The first number after the first `=` of `text` (thousands commas allowed), or None."""
    match = _RESULT.search(text)
    if match is None:
        return None
    digits = match.group(1).replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


def split_of(config: ArithmeticTaskConfig, a: int, b: int) -> Split:
    # A stable hash (not Python's salted hash()): the split survives processes and restarts.
    return "probe" if zlib.crc32(f"{config.seed}:{a}+{b}".encode()) % config.probe_every == 0 else "train"


def pairs(config: ArithmeticTaskConfig, split: Split) -> list[tuple[int, int]]:
    """Every operand pair of `split`, in a fixed shuffled order (the same for the same config)."""
    if split not in ("train", "probe"):
        raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
    values = range(config.min_value, config.max_value + 1)
    out = [(a, b) for a in values for b in values if split_of(config, a, b) == split]
    random.Random(f"arithmetic:{config.seed}:{split}").shuffle(out)
    return out


def prompt_text(config: ArithmeticTaskConfig, tokenizer: ChatTokenizer, a: int, b: int) -> str:
    messages = [{"role": "user", "content": config.question.format(a=a, b=b)}]
    if config.system:
        messages.insert(0, {"role": "system", "content": config.system})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


class ArithmeticTask:
    """The task plug-in (`miles_async.task.Task`) over `Problem`s of this module."""

    Config: ClassVar[type[msgspec.Struct]] = ArithmeticTaskConfig
    Item: ClassVar[type] = Problem
    multi_turn = False

    def __init__(self, config: ArithmeticTaskConfig, tokenizer: ChatTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def items(self, split: Split, count: int) -> list[Problem]:
        """The first `count` problems of `split` (distinct pairs); ValueError if it has fewer."""
        chosen = pairs(self.config, split)
        if not 0 <= count <= len(chosen):
            raise ValueError(f"asked for {count} {split} problems but the operand range "
                             f"{self.config.min_value}..{self.config.max_value} has {len(chosen)}: "
                             "widen it or ask for fewer")
        span = self.config.max_value - self.config.min_value + 1
        return [Problem(problem_id=(a - self.config.min_value) * span + (b - self.config.min_value), a=a, b=b,
                        input_ids=self.tokenizer.encode(prompt_text(self.config, self.tokenizer, a, b)))
                for a, b in chosen[:count]]

    def prompt_ids(self, item: Problem) -> list[int]:
        return item.input_ids

    async def reward(self, item: Problem, completion: Completion) -> float:
        return 1.0 if answer_of(completion.text) == item.answer else 0.0

    def sft_examples(self, items: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
        return []
