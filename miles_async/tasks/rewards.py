"""The dataset task's rewards: a completion's text against a row's label, scored 0.0 to 1.0.

A recipe names one in `[task.config] reward` (`miles_async.tasks.dataset`):

- `"math"`: the answers compared by `math-verify`, Hugging Face's grader (it parses LaTeX and
  plain expressions into SymPy and compares them: `\\boxed{\\frac{3}{4}}`, `3/4` and `0.75` are one
  answer; `1,000` is 1000). Of the completion it reads the text after its last `####` (GSM8K's
  convention) when there is one, else what math-verify finds: a `\\boxed{}`, an "answer is ...", or
  the last number. Of the label the same: GSM8K's rationale `... #### 72` is 72.
- `"exact"`: the completion equal to the label's answer (its text after a last `####`, else the
  whole label) once both are normalised: surrounding space and a final period removed, runs of
  space made one, case folded.
- `"regex:PATTERN"`: the first match of PATTERN (Python's `re`) in the completion, its first group
  if it has one, else the whole match, normalised as for "exact" and compared with the label's
  answer; no match scores 0. E.g. `"regex:answer is (-?\\d+)"`.
- `"package.module:function"`: your own, `function(completion: str, label: str) -> float` (a bool
  counts as 0/1), plain or `async def`. A plain one runs in a worker thread (off the event loop:
  so it must not use signals, e.g. math-verify's default timeouts); an async one on the loop. The
  label is the row's label as written (a number in the file arrives as its text).

`reward_fn(name)` turns a name into the function; `check_name(name)` checks a name without
importing anything (what a recipe's config does when it is read). Bad names are one `ValueError`
line: an unknown one (with "did you mean"), a pattern that does not compile, a function that cannot
be imported.

Where math-verify runs: the rollout workers and the evaluator call the task's reward on their
event loop, in the process's main thread; grading is SymPy work (about a millisecond for a
number, more for LaTeX), so the task runs it in a worker thread, and there math-verify's own
timeout cannot work (it is `signal.alarm`, main thread only): `math_reward` passes
`parsing_timeout=None` and `timeout_seconds=None`, and the task bounds the wait itself
(`reward_timeout_s`: past it the completion scores 0).

Try it:
    from miles_async.tasks.rewards import math_reward
    math_reward("so \\boxed{3/4}", "0.75")      # 1.0
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from miles_async.task import load_object

RewardFn = Callable[[str, str], "float | bool | Awaitable[float | bool]"]
BUILT_IN = ("math", "exact", "regex:PATTERN")
_SPACE = re.compile(r"\s+")


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns, once, that its timeout is off: here that is on purpose (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutNotice())
    return math_verify


def gold_answer(label: str) -> str:
    """The answer of a label: the text after its last `####` (GSM8K's rationale), else all of it."""
    _, sep, tail = label.rpartition("####")
    return tail.strip() if sep else label.strip()


def final_answer(text: str) -> str:
    """The part of a completion to grade: the line after its last `####` when it has one, else all of it."""
    _, sep, tail = text.rpartition("####")
    return tail.strip().split("\n", 1)[0] if sep else text


def normalise(text: str) -> str:
    return _SPACE.sub(" ", text.strip()).removesuffix(".").strip().casefold()


@functools.lru_cache(maxsize=8192)
def _parsed_gold(answer: str) -> tuple[Any, ...]:
    # A label is graded against every completion of its group: parsed once. math-verify reads LaTeX
    # inside delimiters (or a few bare forms, \frac); a label is often bare LaTeX (`\sqrt{2}`), but
    # words in delimiters would read as a product of symbols: only a label with a command is wrapped.
    mv = _math_verify()
    parsed = mv.parse(answer, parsing_timeout=None)
    if not parsed and "\\" in answer and "$" not in answer:
        parsed = mv.parse(f"${answer}$", parsing_timeout=None)
    return tuple(parsed)


def parses(label: str) -> bool:
    """Whether math-verify reads an answer in `label` (a label it cannot read scores 0 whatever the answer)."""
    return bool(_parsed_gold(gold_answer(label)))


def math_reward(completion: str, label: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the label's (module docstring), else 0.0."""
    mv = _math_verify()
    gold = list(_parsed_gold(gold_answer(label)))
    if not gold:
        return 0.0
    answer = mv.parse(final_answer(completion), parsing_timeout=None)
    return 1.0 if answer and mv.verify(gold, answer, timeout_seconds=None) else 0.0


def exact_reward(completion: str, label: str) -> float:
    """1.0 when the completion is the label's answer, both normalised (module docstring), else 0.0."""
    return 1.0 if normalise(completion) == normalise(gold_answer(label)) else 0.0


class RegexReward:
    """`regex:PATTERN` (module docstring)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = compile_pattern(pattern)

    def __call__(self, completion: str, label: str) -> float:
        match = self.pattern.search(completion)
        if match is None:
            return 0.0
        found = match.group(1) if self.pattern.groups else match.group(0)
        return 1.0 if found is not None and normalise(found) == normalise(gold_answer(label)) else 0.0


def compile_pattern(pattern: str) -> re.Pattern[str]:
    if not pattern:
        raise ValueError('task.config.reward "regex:" has no pattern: write one after the colon, e.g. '
                         '"regex:answer is (-?\\d+)"')
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"task.config.reward regex {pattern!r} does not compile: {e}") from e


def check_name(name: str) -> None:
    """A reward name's form (module docstring), without importing a user's module; ValueError if bad."""
    if name in ("math", "exact"):
        return
    if name.startswith("regex:"):
        compile_pattern(name[len("regex:"):])
        return
    module, sep, attr = name.partition(":")
    if sep and module and attr and all(part.isidentifier() for part in (*module.split("."), attr)):
        return
    close = difflib.get_close_matches(name, ("math", "exact", "regex:"), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"task.config.reward {name!r} is not a reward{hint}: use \"math\", \"exact\", "
                     "\"regex:PATTERN\" or \"package.module:function\"")


def reward_fn(name: str) -> RewardFn:
    """The reward a name stands for (module docstring); ValueError naming what is wrong."""
    check_name(name)
    if name == "math":
        return math_reward
    if name == "exact":
        return exact_reward
    if name.startswith("regex:"):
        return RegexReward(name[len("regex:"):])
    try:
        fn = load_object(name, "task.config.reward")
    except ValueError:
        raise
    except Exception as e:  # the user's module failed as it was imported: said in one line
        raise ValueError(f"task.config.reward {name!r}: importing {name.partition(':')[0]} failed: "
                         f"{type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"task.config.reward {name!r} is a {type(fn).__name__}, not a function "  # noqa: TRY004
                         "(completion, label) -> float")
    try:
        inspect.signature(fn).bind("completion", "label")
    except TypeError as e:
        raise ValueError(f"task.config.reward {name!r} must take (completion: str, label: str): {e}") from e
    except ValueError:  # a builtin without a readable signature: it will tell when called
        pass
    return fn


def is_async(fn: RewardFn) -> bool:
    """Whether calling `fn` gives a coroutine (an `async def`, or an object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
