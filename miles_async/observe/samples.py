"""Decoded samples of a run, for reading what the model says: `RUN_DIR/samples.jsonl`.

With `observe.log_samples = N` the controller decodes N samples of each RL step's batch (spread
over its groups: `pick`) and writes one `SampleText` per line, beside the metrics row of that
step; the trackers get the same rows as a table (wandb) or text (TensorBoard). A resumed run cuts
the file back with metrics.jsonl, so each step's samples appear once.

    from miles_async.observe.samples import read_samples
    for s in read_samples("runs/demo/samples.jsonl"):
        print(s.step, s.reward, s.completion[:80])
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from miles_async.observe.records import decode_jsonl

__all__ = ["SAMPLES_FILE", "SAMPLE_COLUMNS", "SampleText", "decode", "pick", "read_samples"]

SAMPLES_FILE = "samples.jsonl"


class SampleText(msgspec.Struct, frozen=True, kw_only=True):
    """One decoded sample of a trained batch (a line of samples.jsonl)."""

    step: int  # the RL step that trained it
    prompt_id: int  # the prompt's dataset position
    index: int  # which of the group's completions (0 .. group_size - 1)
    prompt: str  # the prompt tokens, decoded (special tokens kept: the chat template shows)
    completion: str  # every token after the prompt: generated text (and, multi-turn, tool outputs)
    reward: float
    scored: bool = True  # False: the environment gave no reward (`reward` means nothing)
    versions: list[int] = []  # weight versions its tokens were sampled under, in order
    finish_reason: str = ""  # "stop", "length", ...
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


SAMPLE_COLUMNS = tuple(field.name for field in msgspec.structs.fields(SampleText))  # the trackers' table


def pick(count: int, num: int) -> list[int]:
    """`num` positions out of `count`, spread evenly from the first (a batch is ordered by group,
    so the samples shown come from different prompts); all of them when `num >= count`."""
    if num >= count:
        return list(range(count))
    return [i * count // num for i in range(num)]


def decode(tokenizer: Any, token_ids: Sequence[int], num_prompt_tokens: int, **fields: Any) -> SampleText:
    """A sample's tokens as text: the first `num_prompt_tokens` are the prompt, the rest the
    completion; `fields` are SampleText's others (step, prompt_id, index, reward, ...)."""
    return SampleText(prompt=tokenizer.decode(token_ids[:num_prompt_tokens]),
                      completion=tokenizer.decode(token_ids[num_prompt_tokens:]),
                      num_prompt_tokens=num_prompt_tokens, **fields)


_decoder = msgspec.json.Decoder(SampleText)


def read_samples(path: str | Path) -> list[SampleText]:
    """Every line of a samples.jsonl; ValueError naming the line of a malformed one."""
    return decode_jsonl(path, _decoder, "a sample")
