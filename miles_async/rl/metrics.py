"""The RL step's fidelity and loss metrics, as sums that add across micro-batches and ranks.

`metric_sums` turns one micro-batch into a float64 vector of sums (one entry per name in
`METRIC_SUM_NAMES`); add the vectors of a step's micro-batches, all-reduce the one tensor across
ranks (a single collective), and `RLMetrics.from_sums` divides by the trained-token count. Float64
sums of exact zeros stay exactly zero, so in true-on-policy mode the mismatch reads 0.0.

- logprob_abs_diff: mean |trainer log-prob - rollout log-prob| over trained tokens.
- rollout_kl_k3: k3 estimate of KL(rollout policy || trainer policy) on the sampled tokens:
  with log r = trainer_logp - rollout_logp, k3 = r - 1 - log r (>= 0; 0 iff the two agree).
- clip_fraction / dual_clip_fraction / tis_truncated_fraction / mis_masked_fraction: share of
  trained tokens whose PPO term was clipped, dual-clipped, whose TIS weight hit the cap, or which
  MIS dropped (from `PolicyLossOutput`).
- entropy: mean per-token entropy of the trainer's distribution.
- teacher_kl: mean of trainer log-prob - teacher log-prob over trained tokens, the one-sample
  estimate of the student's reverse KL to a distillation teacher at the weights being trained
  (0.0 without teacher log-probs).
Grad norm and tokens/s are the trainer's own.

Tensor names (STYLE rule 10): T tokens (any layout), K metric sums.

Try it:
    sums_K = metric_sums(trainer_logp_T=old_T, rollout_logp_T=rollout_T, loss_mask_T=mask_T, loss=out)
    print(RLMetrics.from_sums(sums_K))
"""

from __future__ import annotations

import msgspec
import torch

from miles_async.rl.losses import PolicyLossOutput

METRIC_SUM_NAMES: tuple[str, ...] = (
    "num_trained_tokens", "logprob_abs_diff", "rollout_kl_k3", "clipped", "dual_clipped", "tis_truncated",
    "entropy", "teacher_kl", "mis_masked",
)


class RLMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """Per-step means over trained tokens (0.0 when the step trained no token)."""

    num_trained_tokens: int
    logprob_abs_diff: float
    rollout_kl_k3: float
    clip_fraction: float
    dual_clip_fraction: float
    tis_truncated_fraction: float
    entropy: float
    teacher_kl: float = 0.0
    mis_masked_fraction: float = 0.0

    @classmethod
    def from_sums(cls, sums_K: torch.Tensor) -> RLMetrics:
        """Means from a (summed, all-reduced) vector made by `metric_sums`."""
        if sums_K.shape != (len(METRIC_SUM_NAMES),):
            raise ValueError(f"metric sums must have shape ({len(METRIC_SUM_NAMES)},) as made by metric_sums, got "
                             f"{tuple(sums_K.shape)}")
        values = dict(zip(METRIC_SUM_NAMES, sums_K.double().cpu().tolist()))
        count = values["num_trained_tokens"]

        def mean(name: str) -> float:
            return values[name] / count if count > 0 else 0.0

        return cls(num_trained_tokens=int(count), logprob_abs_diff=mean("logprob_abs_diff"),
                   rollout_kl_k3=mean("rollout_kl_k3"), clip_fraction=mean("clipped"),
                   dual_clip_fraction=mean("dual_clipped"), tis_truncated_fraction=mean("tis_truncated"),
                   entropy=mean("entropy"), teacher_kl=mean("teacher_kl"),
                   mis_masked_fraction=mean("mis_masked"))


def metric_sums(*, trainer_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor, loss_mask_T: torch.Tensor,
                loss: PolicyLossOutput | None = None, entropy_T: torch.Tensor | None = None,
                teacher_logp_T: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's sums, float64 [K] on the inputs' device, in the order of `METRIC_SUM_NAMES`.

    `trainer_logp_T` is the trainer's log-prob of the sampled tokens at the weights the rollout
    used, as closely as the trainer has them (the old log-probs, before this step's update).
    """
    for name, tensor_T in (("rollout_logp_T", rollout_logp_T), ("loss_mask_T", loss_mask_T),
                           ("entropy_T", entropy_T), ("teacher_logp_T", teacher_logp_T)):
        if tensor_T is not None and tensor_T.shape != trainer_logp_T.shape:
            raise ValueError(f"{name} has shape {tuple(tensor_T.shape)}, but trainer_logp_T has "
                             f"{tuple(trainer_logp_T.shape)}")
    with torch.no_grad():
        mask_T = (loss_mask_T != 0).double()
        log_ratio_T = trainer_logp_T.double() - rollout_logp_T.double()
        zero = mask_T.new_zeros(())

        def masked_sum(values_T: torch.Tensor | None) -> torch.Tensor:
            return zero if values_T is None else (values_T.double() * mask_T).sum()

        return torch.stack([
            mask_T.sum(),
            masked_sum(log_ratio_T.abs()),
            masked_sum(torch.expm1(log_ratio_T) - log_ratio_T),
            masked_sum(None if loss is None else loss.clipped_T),
            masked_sum(None if loss is None else loss.dual_clipped_T),
            masked_sum(None if loss is None else loss.tis_truncated_T),
            masked_sum(entropy_T),
            masked_sum(None if teacher_logp_T is None else trainer_logp_T.double() - teacher_logp_T.double()),
            masked_sum(None if loss is None else loss.mis_masked_T),
        ])
