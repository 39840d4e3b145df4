"""The metric names: every key a metrics row may hold, its meaning, and the flat name it had before.

One table (`METRICS`) for metrics.jsonl, TensorBoard and wandb alike. Names are grouped by what
they measure, as the field groups them (verl, slime):

    rollout/  what generation produced: rewards, lengths, the engines' speculative decoding
    train/    the optimizer step: loss and its parts, gradient, the batch it trained on
    perf/     time and throughput: seconds per part of a step, samples per second, busy fractions
    eval/     held-out evaluation: the task's score, an lm-eval command's eval/<task>/<metric>
    buffer/   the buffer between rollout and training: occupancy, groups dropped

`step` stays plain: it is the x-axis (the RL step, or the SFT step of `miles-async sft`).

Runs written before the names were grouped used the flat names (`reward_mean`, `loss`, ...);
`upgrade_row` renames those, so readers (`miles-async plot`) read old run folders too.

The RL controller's row is typed: `RLRow`, one field per key (the field is the name with its
namespace's slash made an underscore: `rollout_reward_mean` is `rollout/reward_mean`), a field left
None is not in the row. Adding a metric is a field there and its meaning here in `METRICS`;
tests/unit/test_observe_logs.py checks that each field has its line and each line its field.

Print the table: `python -m miles_async.observe.names` (markdown); docs/reference/metrics.md is
generated from it (miles_async/launch/reference.py).
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

__all__ = ["METRICS", "NAMESPACES", "RENAMED", "Metric", "RLRow", "field_name", "is_known", "upgrade_row"]

NAMESPACES = ("rollout", "train", "perf", "eval", "buffer")


class Metric(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # as written in metrics.jsonl and to the trackers
    meaning: str
    writer: str = "rl"  # "rl" (the RL controller), "sft" (`miles-async sft`), "both"
    old: str = ""  # the flat name of runs written before the names were grouped ("" for new keys)


def _m(name: str, meaning: str, writer: str = "rl", old: str | None = None) -> Metric:
    # Most keys were renamed by adding the namespace: their old name is the part after it.
    return Metric(name=name, meaning=meaning, writer=writer,
                  old=name.split("/", 1)[1] if old is None else old)


METRICS: tuple[Metric, ...] = (
    Metric(name="step", meaning="the step (x-axis): RL step, or SFT step in `miles-async sft`", writer="both",
           old="step"),
    # rollout/
    _m("rollout/reward_mean", "mean reward of every sample finished since the last step, scored samples only"),
    _m("rollout/unscored_fraction", "the batch's samples whose environment gave no reward"),
    _m("rollout/response_len_mean", "generated tokens per trained sample"),
    _m("rollout/spec_accept_rate", "draft tokens the engines accepted (0 without speculative decoding)"),
    _m("rollout/spec_accept_length", "tokens per decoding step, SGLang's accept length (1 without)"),
    _m("rollout/prefix_cache_hit_rate", "multi-turn: prompt tokens of every turn the engines' prefix caches held"),
    # train/
    _m("train/loss", "the loss optimized (RL: pg_loss + kl_coef * kl - entropy_coef * entropy; SFT: cross-entropy)",
       "both"),
    _m("train/pg_loss", "the policy-gradient part of the loss", old=""),
    _m("train/grad_norm", "gradient norm before clipping", "both"),
    _m("train/entropy", "per-token entropy of the trainer's distribution over the trained tokens"),
    _m("train/kl", "KL to the reference policy (0 unless trainer kl_coef > 0)", old=""),
    _m("train/rollout_kl_k3", "k3 KL between the rollout's and the trainer's log-probs", old=""),
    _m("train/clip_fraction", "trained tokens whose term the PPO clip set", old=""),
    _m("train/logprob_abs_diff", "mean |trainer log-prob - engine log-prob| over the trained tokens"),
    _m("train/tis_truncated_fraction", "trained tokens whose TIS weight hit the cap"),
    _m("train/mis_masked_fraction", "trained tokens MIS dropped"),
    _m("train/teacher_kl", "distillation: trainer (student) log-prob - teacher log-prob over the trained tokens"),
    _m("train/draft_ce", "the draft head's cross-entropy in this step's training (0 when not trained)"),
    _m("train/batch_reward_mean", "mean reward of the trained batch's scored samples"),
    _m("train/staleness_mean", "weight versions the trained batch lagged behind the trainer, mean"),
    _m("train/staleness_max", "the same, maximum"),
    _m("train/weight_version", "the weight version after this step"),
    _m("train/num_samples", "samples trained", "both"),
    _m("train/num_tokens", "tokens trained on (prompt + output)", "both"),
    _m("train/num_forward_tokens", "tokens the model ran: num_tokens less the repeats of prompts shared in a group"),
    _m("train/num_trained_tokens", "tokens under the loss mask", "sft"),
    _m("train/epoch", "passes over the examples so far", "sft"),
    _m("train/lr", "learning rate", "sft"),
    # perf/
    _m("perf/wall_s", "seconds since the run (or the resumed run) started", "both"),
    _m("perf/step_s", "seconds of this step", "both"),
    _m("perf/samples_per_s", "samples trained per second of this step"),
    _m("perf/tokens_per_s", "tokens trained per second of this step", "sft"),
    _m("perf/wait_data_s", "seconds waiting for a full batch"),
    _m("perf/train_s", "seconds of forward, backward and optimizer"),
    _m("perf/update_s", "seconds of the weight export and waiting for the previous push"),
    _m("perf/trainer_idle_fraction", "share of the step the trainer did not train"),
    _m("perf/engine_busy_fraction", "share of the step the engines had work"),
    _m("perf/checkpoint_s", "a checkpoint taken before this step: its seconds in the loop's way"),
    _m("perf/engine_release_s", "loop.offload_engines: the engines giving back their memory before training"),
    _m("perf/engine_resume_s", "loop.offload_engines: the engines taking it back before the last push"),
    _m("perf/teacher_s", "distillation: the teacher's scoring requests, summed over the step's samples"),
    _m("perf/teacher_wait_s", "distillation: their wait for a request slot, summed"),
    _m("perf/teacher_busy_fraction", "distillation: share of the step the teacher had work"),
    # eval/
    _m("eval/score", "the task's held-out score (eval steps only)", old="eval_score"),
    _m("eval/heldout_loss", "the loss on data.num_heldout held-out examples", "sft"),
    # buffer/
    _m("buffer/occupancy", "groups waiting in the buffer / buffer.capacity_groups", old="buffer_occupancy"),
    _m("buffer/waiting_staleness_mean", "weight versions the groups waiting in the buffer lag behind, mean"),
    _m("buffer/dropped_stale", "groups dropped as too stale, so far"),
    _m("buffer/dropped_aborted", "groups dropped for an aborted sample, so far"),
    _m("buffer/dropped_filtered", "groups the filter dropped (e.g. equal rewards), so far"),
)
# Besides these, an lm-eval command (eval.mode = "command") writes eval/<task>/<metric> per metric.

_BY_NAME = {m.name: m for m in METRICS}
RENAMED: dict[str, str] = {m.old: m.name for m in METRICS if m.old and m.old != m.name}


def field_name(field: str) -> str:
    """The metric name of an `RLRow` field: `rollout_reward_mean` -> `rollout/reward_mean` (`step`
    stays plain)."""
    head, _, rest = field.partition("_")
    return f"{head}/{rest}" if head in NAMESPACES and rest else field


class RLRow(msgspec.Struct, kw_only=True, omit_defaults=True, rename=field_name):
    """One metrics.jsonl row of the RL controller (the meanings: `METRICS`). Optional fields are
    None when the run has no such thing (no teacher, no eval this step, ...): not in the row."""

    step: int
    rollout_reward_mean: float
    rollout_unscored_fraction: float
    rollout_response_len_mean: float
    rollout_spec_accept_rate: float
    rollout_spec_accept_length: float
    rollout_prefix_cache_hit_rate: float | None = None  # multi-turn tasks
    train_loss: float
    train_pg_loss: float
    train_grad_norm: float
    train_entropy: float
    train_kl: float
    train_rollout_kl_k3: float
    train_clip_fraction: float
    train_logprob_abs_diff: float
    train_tis_truncated_fraction: float
    train_mis_masked_fraction: float
    train_draft_ce: float
    train_teacher_kl: float | None = None  # distillation
    train_batch_reward_mean: float
    train_staleness_mean: float
    train_staleness_max: int
    train_weight_version: int
    train_num_samples: int
    train_num_tokens: int
    train_num_forward_tokens: int
    perf_wall_s: float
    perf_step_s: float
    perf_samples_per_s: float
    perf_wait_data_s: float
    perf_train_s: float
    perf_update_s: float
    perf_trainer_idle_fraction: float
    perf_engine_busy_fraction: float
    perf_checkpoint_s: float | None = None  # a checkpoint was taken before this step
    perf_engine_release_s: float | None = None  # loop.offload_engines
    perf_engine_resume_s: float | None = None
    perf_teacher_s: float | None = None  # distillation
    perf_teacher_wait_s: float | None = None
    perf_teacher_busy_fraction: float | None = None
    eval_score: float | None = None  # eval steps
    buffer_occupancy: float
    buffer_waiting_staleness_mean: float
    buffer_dropped_stale: int
    buffer_dropped_aborted: int
    buffer_dropped_filtered: int
    # an lm-eval command's own metrics, already named eval/<task>/<metric>: flattened into the row
    lm_eval: dict[str, float] = msgspec.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The row as metrics.jsonl and the trackers take it: metric name -> number."""
        row = msgspec.to_builtins(self, enc_hook=_plain)
        return row | row.pop("lm_eval", {})


def _plain(obj: Any) -> Any:
    # numpy and torch scalars may reach a row from the trainer's side: `.item()` makes them plain
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"a metrics row holds numbers, not a {type(obj).__name__}: {obj!r}")


def is_known(name: str) -> bool:
    """Whether `name` is in the table, or an lm-eval command's `eval/<task>/<metric>`."""
    return name in _BY_NAME or (name.startswith("eval/") and name.count("/") >= 2)


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with the flat names of older runs renamed to the grouped ones (a row already
    grouped comes back equal)."""
    if not any(key in RENAMED for key in row):
        return row
    return {RENAMED.get(key, key): value for key, value in row.items()}


def markdown() -> str:
    """The table as markdown: name, flat name before, meaning."""
    lines = ["| name | before | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{m.name}` | {f'`{m.old}`' if m.old and m.old != m.name else ''} | {m.meaning} |"
              for m in METRICS]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
