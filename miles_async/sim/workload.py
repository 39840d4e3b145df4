"""What the simulated samples are: their lengths, turns, tool time, rewards and recorded durations.

The simulator asks `workload.spec(prompt_id, index, attempt)` for each sample it issues and gets
a `SampleSpec`. Two workloads:

- `RecordedWorkload(trace)`: the trace's own samples, by key, so a replay with the run's settings
  sees the same lengths and rewards (the buffer's filter then drops the same groups). A key the
  trace lacks (more prompts, another retry, a bigger group) takes the same index of a recorded
  complete group chosen by a fixed hash of (prompt, attempt): same question, same answer.
- `SyntheticWorkload(...)`: drawn from distributions (long-tailed output lengths, multi-turn
  episodes with tool time, a success rate), seeded per key, for planning runs not yet made.
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from typing import Protocol

import msgspec
import numpy as np

from miles_async.sim.trace import Trace

_UNUSABLE = ("abort", "error", "reward_error")


class SampleSpec(msgspec.Struct, frozen=True, kw_only=True):
    """output_tokens: generated tokens over all turns (split evenly across `num_turns`).
    tool_s: time outside the engine over the whole episode (split evenly between turns).
    duration_s: the recorded submit-to-end time (replay mode), None when there is none."""

    output_tokens: int
    reward: float
    prompt_tokens: int = 0
    num_turns: int = 1
    tool_s: float = 0.0
    duration_s: float | None = None


class Workload(Protocol):
    def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec: ...


def _mix(*values: int) -> int:
    """A fixed integer hash (Python's hash of a tuple is stable for ints, but say it outright)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class RecordedWorkload:
    def __init__(self, trace: Trace) -> None:
        self.by_key: dict[tuple[int, int, int], SampleSpec] = {}
        groups: dict[tuple[int, int], dict[int, SampleSpec]] = defaultdict(dict)
        for s in trace.samples:
            if s.dropped or s.finish_reason in _UNUSABLE:
                continue
            spec = SampleSpec(output_tokens=s.output_tokens, reward=s.reward, prompt_tokens=s.prompt_tokens,
                              num_turns=s.num_turns, tool_s=s.tool_s,
                              duration_s=s.end_s - s.submit_s)
            self.by_key[(s.prompt_id, s.index, s.attempt)] = spec
            groups[(s.prompt_id, s.attempt)][s.index] = spec
        n = trace.header.group_size
        self.groups = [[g[i] for i in range(n)] for _, g in sorted(groups.items()) if all(i in g for i in range(n))]
        if not self.groups:
            raise ValueError(f"{trace.path}: no complete group of {n} usable samples to replay")

    def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec:
        found = self.by_key.get((prompt_id, index, attempt))
        if found is not None:
            return found
        group = self.groups[_mix(prompt_id, attempt) % len(self.groups)]
        return group[index % len(group)]


class SyntheticWorkload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Output tokens per turn: log-normal with median `tokens_median` and shape `tokens_sigma`,
    clipped to [1, max_tokens_per_turn]. Turns per episode: uniform in [turns_min, turns_max].
    Tool time per turn: log-normal (median `tool_s_median`, shape `tool_s_sigma`). Reward: 1 with
    probability `success_rate` (per prompt a difficulty drawn around it, so some groups are all
    0 or all 1 and the filter drops them), else 0."""

    prompt_tokens: int = 512
    tokens_median: float = 512.0
    tokens_sigma: float = 1.0
    max_tokens_per_turn: int = 8192
    turns_min: int = 1
    turns_max: int = 1
    tool_s_median: float = 0.0
    tool_s_sigma: float = 1.0
    success_rate: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens_median < 1 or self.max_tokens_per_turn < 1:
            raise ValueError("SyntheticWorkload.tokens_median and max_tokens_per_turn must be >= 1")
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError(f"SyntheticWorkload needs 1 <= turns_min <= turns_max, got {self.turns_min}, "
                             f"{self.turns_max}")
        if not 0.0 <= self.success_rate <= 1.0:
            raise ValueError(f"SyntheticWorkload.success_rate must be in [0, 1], got {self.success_rate}")
        if self.tokens_sigma < 0 or self.tool_s_sigma < 0 or self.tool_s_median < 0:
            raise ValueError("SyntheticWorkload sigmas and tool_s_median must be >= 0")

    def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec:
        return _block(self, prompt_id, attempt, index // _BLOCK)[index % _BLOCK]


_BLOCK = 16  # samples drawn together: a group's n samples come from one generator


@functools.lru_cache(maxsize=8192)
def _block(w: SyntheticWorkload, prompt_id: int, attempt: int, block: int) -> tuple[SampleSpec, ...]:
    """The specs of samples block*16 .. block*16+15 of one prompt's attempt, from one generator
    seeded by (seed, prompt, attempt, block): the same key always gives the same sample, in any
    order of asking, and seeding once per group instead of per sample keeps this cheap."""
    rng = np.random.default_rng([w.seed, prompt_id, attempt, block])
    turns = rng.integers(w.turns_min, w.turns_max + 1, _BLOCK)
    starts = np.concatenate(([0], np.cumsum(turns)[:-1]))
    per_turn = np.clip(np.rint(w.tokens_median * np.exp(rng.standard_normal(int(turns.sum())) * w.tokens_sigma)),
                       1, w.max_tokens_per_turn)
    tokens = np.add.reduceat(per_turn, starts)
    if w.tool_s_median > 0:
        tool = np.add.reduceat(w.tool_s_median * np.exp(rng.standard_normal(int(turns.sum())) * w.tool_s_sigma), starts)
    else:
        tool = np.zeros(_BLOCK)
    rewards = rng.random(_BLOCK) < _difficulty(w.seed, w.success_rate, prompt_id)
    return tuple(SampleSpec(output_tokens=int(tokens[i]), reward=float(rewards[i]), prompt_tokens=w.prompt_tokens,
                            num_turns=int(turns[i]), tool_s=float(tool[i])) for i in range(_BLOCK))


@functools.lru_cache(maxsize=65536)
def _difficulty(seed: int, success_rate: float, prompt_id: int) -> float:
    """A prompt's success probability, shared by its group (all its attempts): what makes whole
    groups agree, and the filter drop them. Beta-distributed around `success_rate`."""
    rng = random.Random(_mix(seed, prompt_id, 1 << 40))
    return rng.betavariate(2 * success_rate + 0.01, 2 * (1 - success_rate) + 0.01)


def clear_caches() -> None:
    """Forget the synthetic samples drawn so far (they are cached per group): a cold start."""
    _block.cache_clear()
    _difficulty.cache_clear()
