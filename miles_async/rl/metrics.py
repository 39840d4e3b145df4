"""The RL step's fidelity and loss metrics, as sums that add across micro-batches and ranks.

`metric_sums` turns one micro-batch into a float64 vector of sums, entry i being field i of
`MetricSums` (a `SumVector`: the Struct's field order is the vector's order, defined there once);
add the vectors of a step's micro-batches, all-reduce the one tensor across ranks (a single
collective), and `RLMetrics.from_sums` divides by the trained-token count. The trainer appends
its own sums by subclassing (`trainer.loss.StepSums`), so one vector still carries them all.
Float64 sums of exact zeros stay exactly zero, so in true-on-policy mode the mismatch reads 0.0.

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
    print(RLMetrics.from_sums(sums_K), MetricSums.of(sums_K))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import torch

from miles_async.rl.losses import PolicyLossOutput

if TYPE_CHECKING:
    from typing_extensions import Self

class SumVector(msgspec.Struct, frozen=True, kw_only=True):
    """Sums that travel as one float64 vector [K] (added over micro-batches, all-reduced once):
    entry i is field i, so a subclass's fields are the vector's order, and adding a sum is adding
    a field. A subclass appends its fields after its parent's."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    @classmethod
    def stack(cls, **values: torch.Tensor | float) -> torch.Tensor:
        """The vector of `values` by field name (a field not given: 0.0), float64 on the first
        tensor's device, without gradient. A name that is no field is a ValueError."""
        names = cls.__struct_fields__
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"{unknown} are not sums of {cls.__name__} (its fields: {list(names)})")
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        # (detached: a sum is a record of the step, never part of its graph)
        return torch.stack([torch.as_tensor(values[n], device=device).detach().double() if n in values else zero
                            for n in names])

    @classmethod
    def of(cls, sums_K: torch.Tensor) -> Self:
        """The record of a vector made by `stack` (and summed)."""
        names = cls.__struct_fields__
        if sums_K.shape != (len(names),):
            raise ValueError(f"{cls.__name__} sums must have shape ({len(names)},) as made by "
                             f"{cls.__name__}.stack, got {tuple(sums_K.shape)}")
        return cls(**dict(zip(names, sums_K.double().cpu().tolist())))


class MetricSums(SumVector, frozen=True, kw_only=True):
    """One micro-batch's (or a step's) sums over trained tokens, what `RLMetrics` divides."""

    num_trained_tokens: float = 0.0
    logprob_abs_diff: float = 0.0
    rollout_kl_k3: float = 0.0
    clipped: float = 0.0
    dual_clipped: float = 0.0
    tis_truncated: float = 0.0
    entropy: float = 0.0
    teacher_kl: float = 0.0
    mis_masked: float = 0.0


METRIC_SUM_NAMES: tuple[str, ...] = MetricSums.names()


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
        return cls.of(MetricSums.of(sums_K))

    @classmethod
    def of(cls, sums: MetricSums) -> RLMetrics:
        """Means of `sums` (a `MetricSums` or a subclass's record) over its trained tokens."""
        count = sums.num_trained_tokens

        def mean(value: float) -> float:
            return value / count if count > 0 else 0.0

        return cls(num_trained_tokens=int(count), logprob_abs_diff=mean(sums.logprob_abs_diff),
                   rollout_kl_k3=mean(sums.rollout_kl_k3), clip_fraction=mean(sums.clipped),
                   dual_clip_fraction=mean(sums.dual_clipped), tis_truncated_fraction=mean(sums.tis_truncated),
                   entropy=mean(sums.entropy), teacher_kl=mean(sums.teacher_kl),
                   mis_masked_fraction=mean(sums.mis_masked))


def metric_sums(*, trainer_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor, loss_mask_T: torch.Tensor,
                loss: PolicyLossOutput | None = None, entropy_T: torch.Tensor | None = None,
                teacher_logp_T: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's sums, float64 [K] on the inputs' device, in the order of `MetricSums`."""
    return MetricSums.stack(**metric_parts(trainer_logp_T=trainer_logp_T, rollout_logp_T=rollout_logp_T,
                                           loss_mask_T=loss_mask_T, loss=loss, entropy_T=entropy_T,
                                           teacher_logp_T=teacher_logp_T))


def metric_parts(*, trainer_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor, loss_mask_T: torch.Tensor,
                 loss: PolicyLossOutput | None = None, entropy_T: torch.Tensor | None = None,
                 teacher_logp_T: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch's sums by `MetricSums` field, float64 scalars on the inputs' device (what
    `metric_sums` stacks; a subclass of `MetricSums` stacks them with its own).

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

        return {
            "num_trained_tokens": mask_T.sum(),
            "logprob_abs_diff": masked_sum(log_ratio_T.abs()),
            "rollout_kl_k3": masked_sum(torch.expm1(log_ratio_T) - log_ratio_T),
            "clipped": masked_sum(None if loss is None else loss.clipped_T),
            "dual_clipped": masked_sum(None if loss is None else loss.dual_clipped_T),
            "tis_truncated": masked_sum(None if loss is None else loss.tis_truncated_T),
            "entropy": masked_sum(entropy_T),
            "teacher_kl": masked_sum(None if teacher_logp_T is None
                                     else trainer_logp_T.double() - teacher_logp_T.double()),
            "mis_masked": masked_sum(None if loss is None else loss.mis_masked_T),
        }
