"""Verifiable tasks: prompt generators with exact checkers used as rewards.

Each task is one module with a frozen config, a deterministic `prompts(...)` split into train and
probe sets, `sft_examples(...)` for a warm start, and an `async def reward(sample) -> float`.
Recipes name a reward function by a dotted path, `"miles_async.tasks.reverse:reward"`; there is
no registry (STYLE rule 8: not before three real users).

- `reverse`: `r:fjqk=` -> `kqjf`, the CPU demo task (see its module docstring).
"""
