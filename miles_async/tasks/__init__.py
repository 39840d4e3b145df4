"""Verifiable tasks: prompt generators with exact checkers used as rewards.

Each task is one module with a frozen config and a task plug-in class (`miles_async.task.Task`):
deterministic train and probe splits, prompts, an exact reward, SFT examples for a warm start when
it has them. Recipes name the class by its path, `[task] plugin =
"miles_async.tasks.reverse:ReverseTask"`, or a shipped one by its short name (`plugin = "reverse"`:
`miles_async.task.BUILT_IN_TASKS`, a table of names, not a registry that modules join).

- `reverse`: `r:fjqk=` -> `kqjf`, the CPU demo task (see its module docstring).
- `calculator`: multiplication with a tool, the multi-turn demo task.
- `arithmetic`: two-digit addition asked in a chat model's template, for SmolLM2-135M-Instruct
  (`recipes/smollm2-math.toml`).
- `dataset`: the user's own rows (JSONL, JSON, Parquet, a `datasets` folder or a Hub dataset) of
  prompts and answers, scored by `rewards` (math-verify, exact, regex, or the user's function):
  `recipes/gsm8k-qwen3-0.6b.toml`, `recipes/smollm2-word-problems.toml` (its data written by
  `word_problems`).
"""
