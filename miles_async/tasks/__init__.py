"""Verifiable tasks: prompt generators with exact checkers used as rewards.

Each task is one module with a frozen config and a task plug-in class (`miles_async.task.Task`):
deterministic train and probe splits, prompts, an exact reward, SFT examples for a warm start when
it has them. Recipes name the class by its path, `[task] plugin =
"miles_async.tasks.reverse:ReverseTask"`; there is no registry (STYLE rule 8: not before three real
users).

- `reverse`: `r:fjqk=` -> `kqjf`, the CPU demo task (see its module docstring).
- `calculator`: multiplication with a tool, the multi-turn demo task.
- `arithmetic`: two-digit addition asked in a chat model's template, for SmolLM2-135M-Instruct
  (`recipes/smollm2-math.toml`).
"""
