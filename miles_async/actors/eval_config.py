"""The recipe's `[eval]`: how and how often the policy is scored during a run (miles_async/actors/evaluation.py).

It lives apart from the evaluator, which works through the run's fleet (miles_async/actors/fleet.py, which
reads the whole `actors.recipe.RunConfig`), so that the recipe can hold this section without
importing either.

Try it: `EvalConfig(every=10).due(step=10, last=100)`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PLACEHOLDERS = ("{url}", "{model}", "{checkpoint}", "{output}")


class EvalConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    r"""The recipe's `[eval]`: how and how often the policy is scored on held-out items.

    mode "command" runs `command` through the shell at each evaluation, with these replaced:
      {url}         the HTTP API of the run's first rollout engine, which serves the weights being
                    evaluated (SGLang's and OpenAI's for the embedded engine); rollouts are held
                    while the command runs, as in "shared"
      {model}       the run's model folder: its config and a tokenizer transformers loads
      {checkpoint}  a Hugging Face folder of the weights being evaluated (exported only when named)
      {output}      an empty folder for the command's results (RUN_DIR/eval/step_N/results)
    The command also gets OPENAI_API_KEY when the engines want a key (multi-node runs; lm-eval's
    local-completions sends it, its sglang-generate none). Its score: its last stdout line if that
    is {"score": x}; otherwise lm-eval's results, the
    `results_*.json` files lm-eval wrote under {output}: every task's metrics ("task/metric", the
    filter kept when it is not "none": "gsm8k/exact_match,strict-match") are recorded for the step
    (`Evaluator.metrics_of`), and `metric` names the one that is the eval score (default: the
    first task's first metric). lm-eval (0.4.x) runs against the embedded engine unchanged:

        [eval]
        mode = "command"
        every = 50
        metric = "arc_easy/acc"
        command = '''lm_eval --model local-completions \
            --model_args base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface \
            --tasks arc_easy,gsm8k --output_path {output}'''

    (`--model sglang-generate --model_args base_url={url}/generate,tokenizer={model}` works too;
    `--include_path DIR` adds local task YAMLs, as tests/data/lm_eval/ has; `max_length=N` in
    model_args, the context lm-eval fills (2048 by default), must not pass the engine's max_seq_len.)
    """

    # "none": no evaluation; "shared": the run's engines answer (rollouts held meanwhile); "dedicated": an
    # engine of its own, pushed the weights (rollouts go on); "command": `command` below
    mode: Literal["none", "shared", "dedicated", "command"] = "shared"
    every: int = 20  # steps between evaluations (and after the last step); 0: never
    at_start: bool = False  # also score the starting weights (step 0, after any warm start) of a fresh run
    num_prompts: int = 64  # modes "shared"/"dedicated": held-out items scored per evaluation, one sample each
    temperature: float = 0.0  # modes "shared"/"dedicated": sampling temperature of those samples; 0: greedy
    command: str = ""  # mode "command": the shell command line, with the placeholders above
    metric: str = ""  # mode "command", lm-eval's results: "task/metric" that is the score; "": the first
    command_timeout_s: float = 3600.0  # mode "command": the command is killed (and the run fails) past it

    def __post_init__(self) -> None:
        if self.mode == "command" and not any(p in self.command for p in PLACEHOLDERS):
            raise ValueError(f'eval.mode = "command" needs eval.command naming what it evaluates '
                             f'({", ".join(PLACEHOLDERS)}), got {self.command!r}')
        if self.every < 0 or self.num_prompts < 1:
            raise ValueError(f"eval.every must be >= 0 and eval.num_prompts >= 1, got {self.every} and {self.num_prompts}")
        if self.command_timeout_s <= 0:
            raise ValueError(f"eval.command_timeout_s must be > 0, got {self.command_timeout_s}")

    def due(self, step: int, last: int) -> bool:
        return self.mode != "none" and self.every > 0 and (step % self.every == 0 or step == last)
