"""The RL losses of a train step: PPO clip with dual clip, TIS, KL to a reference, entropy, SFT.

All per-token inputs share one token layout (packed [T], or padded [B, T] flattened or not) and
are aligned: position t holds the log-prob of the token the loss trains at t.
- `logp_T`: the trainer's log-probs now (with gradient), from `miles_async.kernels.logprobs`.
- `old_logp_T`: the trainer's log-probs at the weights before this step's updates (no gradient);
  None means `logp_T.detach()`, right when each batch gets one optimizer step (ratio 1, no clip).
- `rollout_logp_T`: the engine's log-probs of the sampled tokens. TIS reweights each token by
  min(exp(old_logp - rollout_logp), cap): it corrects for the engine's numerics and for weights
  that moved while the sample was generated (asynchronous training), and truncation bounds the
  variance. The weight carries no gradient.
- `ref_logp_T`: a reference policy's log-probs, computed elsewhere (the reference model is kept
  off the training model); KL(policy || reference) by Schulman's k1, k2 or k3 estimator on
  tokens sampled from the policy.

Aggregation turns per-token values into the scalar loss. Every mode is a sum divided by a
`denominator`, so a step split into micro-batches (and ranks) gives the same gradient as one
big batch when the caller passes the step-wide denominator (`aggregation_denominator` summed
over micro-batches and ranks; sequences must not be split across micro-batches):
- "token": sum over trained tokens / number of trained tokens (every token weighs the same),
- "sequence": sum over sequences of the sequence's token mean / number of sequences,
- "seq-mean-token-sum": sum over sequences of the sequence's token sum / number of sequences.
Sequences without a trained token are not counted.

Tensor names (STYLE rule 10): T tokens (any layout), B sequences.

Try it:
    out = policy_loss(logp_T, advantages_T, loss_mask_T, seq_ids_T, PolicyLossConfig(),
                      old_logp_T=old_T, rollout_logp_T=rollout_T)
    out.loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

AGGREGATIONS: tuple[str, ...] = ("token", "sequence", "seq-mean-token-sum")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
Aggregation = Literal["token", "sequence", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]
DISTILL_MODES: tuple[str, ...] = ("advantage", "kl")
DistillMode = Literal["advantage", "kl"]
# exp() of a log-ratio past this overflows float32 long before it means anything: clamp first.
_MAX_LOG_RATIO = 20.0


class PolicyLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The policy loss: PPO clip, dual clip, TIS, KL and entropy terms, and how tokens aggregate.

    eps_clip_low / eps_clip_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's clip-higher
        sets high > low).
    dual_clip_c: for negative advantages the loss is bounded by c * |A| (c > 1); None disables.
    tis_cap: truncated importance sampling cap on exp(old_logp - rollout_logp); None disables TIS.
    mis_band: masked importance sampling: (low, high) bounds on the same ratio; a token whose ratio
        falls outside [low, high] is dropped from the loss (its term and gradient are 0; the
        aggregation's denominator is unchanged), the rest are weighted as TIS says (or by 1 without
        TIS). Where TIS caps an off-policy token's weight, MIS discards it; None disables.
    kl_coef / kl_estimator: weight and estimator of KL(policy || reference); 0 disables.
    distill_coef: on-policy distillation's weight; 0 disables. How the signal enters
        (`distill_mode`): "advantage" (`distill_advantages`: each trained token's advantage loses
        distill_coef x (student log-prob - teacher log-prob), a one-sample estimate of the reverse
        KL to the teacher at that position; the student's are the log-probs the step starts from,
        `old_logp_T`: the trainer's at the weights being trained, not the engine's, which may be
        versions behind), or "kl" (the plain reverse-KL loss, for comparison:
        distill_coef x the k2 estimate of KL(policy || teacher) added to the loss, the KL term with
        the teacher as its reference; its gradient per sampled token is
        (log p - log p_teacher) grad log p, the reverse KL's on-policy gradient).
    entropy_coef: weight of the entropy bonus (subtracted from the loss); 0 disables.
    aggregation: "token", "sequence" or "seq-mean-token-sum" (see the module docstring).
    """

    eps_clip_low: float = 0.2  # PPO: the ratio is clipped below at 1 - eps_clip_low, in [0, 1)
    eps_clip_high: float = 0.2  # PPO: and above at 1 + eps_clip_high (DAPO's clip-higher: above low)
    dual_clip_c: float | None = 3.0  # negative advantages: the loss is bounded by c * |A|, c > 1; unset: off
    tis_cap: float | None = 2.0  # cap on the TIS weight exp(old_logp - rollout_logp); unset: no TIS
    # MIS: (low, high) with 0 <= low < 1 < high; a token whose exp(old_logp - rollout_logp) falls
    # outside is dropped from the loss; unset: off
    mis_band: tuple[float, float] | None = None
    kl_coef: float = 0.0  # weight of KL(policy || reference) in the loss; 0: off
    kl_estimator: KLEstimator = "k3"  # Schulman's estimator of that KL: "k1", "k2" or "k3"
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0: off
    distill_coef: float = 0.0  # weight of on-policy distillation's teacher signal ([teacher]); 0: off
    # How that signal enters: "advantage" (each token's advantage loses distill_coef x (student -
    # teacher log-prob)) or "kl" (distill_coef x the k2 reverse KL to the teacher added to the loss)
    distill_mode: DistillMode = "advantage"
    # How token terms make the loss: "token" (mean over tokens), "sequence" (mean of each sequence's
    # mean), "seq-mean-token-sum" (mean of each sequence's sum)
    aggregation: Aggregation = "token"

    def __post_init__(self) -> None:
        if not 0 <= self.eps_clip_low < 1:
            raise ValueError(f"PolicyLossConfig.eps_clip_low must be in [0, 1), got {self.eps_clip_low}")
        if not self.eps_clip_high >= 0:
            raise ValueError(f"PolicyLossConfig.eps_clip_high must be >= 0, got {self.eps_clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"PolicyLossConfig.dual_clip_c must be > 1 (or None to disable), got {self.dual_clip_c}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"PolicyLossConfig.tis_cap must be > 0 (or None to disable TIS), got {self.tis_cap}")
        if self.mis_band is not None and not 0 <= self.mis_band[0] < 1 < self.mis_band[1]:
            raise ValueError(f"PolicyLossConfig.mis_band must be (low, high) with 0 <= low < 1 < high (or None to "
                             f"disable MIS), got {list(self.mis_band)}")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.distill_coef < 0:
            raise ValueError(f"PolicyLossConfig.kl_coef, entropy_coef and distill_coef must be >= 0, got "
                             f"{self.kl_coef}, {self.entropy_coef} and {self.distill_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"PolicyLossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got "
                             f"{self.kl_estimator!r}")
        if self.distill_mode not in DISTILL_MODES:
            raise ValueError(f"PolicyLossConfig.distill_mode must be one of {DISTILL_MODES}, got {self.distill_mode!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"PolicyLossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")


@dataclass(frozen=True)
class PolicyLossOutput:
    """The loss (with gradient), its detached parts, and per-token flags for the step's metrics.

    The parts are aggregated like the loss: loss = pg_loss + kl_coef * kl - entropy_coef * entropy (+ distill_coef
    * the reverse KL to the teacher with distill_mode "kl").
    `clipped_T`: the PPO clip set the token's term (its gradient is 0); `dual_clipped_T`: the dual
    clip did; `tis_truncated_T`: the TIS weight hit the cap; `mis_masked_T`: MIS dropped the token.
    All four are False off the loss mask.
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped_T: torch.Tensor
    dual_clipped_T: torch.Tensor
    tis_truncated_T: torch.Tensor
    mis_masked_T: torch.Tensor | None = None


def ppo_clip_loss(logp_T: torch.Tensor, old_logp_T: torch.Tensor, advantages_T: torch.Tensor, *,
                  eps_clip_low: float, eps_clip_high: float,
                  dual_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clip loss -min(r A, clip(r) A), dual-clipped at c |A| for A < 0.

    Returns (loss_T, clipped_T, dual_clipped_T) with r = exp(logp - old_logp).
    """
    ratio_T = torch.exp(torch.clamp(logp_T - old_logp_T, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped_T = -advantages_T * ratio_T
    clipped_loss_T = -advantages_T * torch.clamp(ratio_T, 1.0 - eps_clip_low, 1.0 + eps_clip_high)
    loss_T = torch.maximum(unclipped_T, clipped_loss_T)
    clipped_T = clipped_loss_T > unclipped_T
    dual_clipped_T = torch.zeros_like(clipped_T)
    if dual_clip_c is not None:
        # For A < 0 a huge ratio makes -r A unbounded; dual clip caps the loss at -c A.
        bound_T = -dual_clip_c * advantages_T
        dual_clipped_T = (advantages_T < 0) & (loss_T > bound_T)
        loss_T = torch.where(dual_clipped_T, torch.minimum(loss_T, bound_T), loss_T)
    return loss_T, clipped_T & ~dual_clipped_T, dual_clipped_T


def tis_weights(old_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor,
                cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights min(exp(old_logp - rollout_logp), cap), detached; and where capped."""
    with torch.no_grad():
        raw_T = torch.exp(torch.clamp(old_logp_T - rollout_logp_T, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        truncated_T = raw_T > cap
        return torch.clamp(raw_T, max=cap), truncated_T


def mis_keep(old_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    """Masked importance sampling: True where low <= exp(old_logp - rollout_logp) <= high (compared
    in log space, so no ratio overflows), the tokens MIS keeps."""
    with torch.no_grad():
        log_ratio_T = old_logp_T - rollout_logp_T
        low = math.log(band[0]) if band[0] > 0 else -math.inf
        return (log_ratio_T >= low) & (log_ratio_T <= math.log(band[1]))


def distill_advantages(advantages_T: torch.Tensor, student_logp_T: torch.Tensor, teacher_logp_T: torch.Tensor,
                       coef: float) -> torch.Tensor:
    """On-policy distillation folded into the advantage: A_t - coef * (log p_student(x_t) - log p_teacher(x_t)).

    x_t is the token the student sampled and `student_logp_T` the student's log-prob of it, so the
    difference is a one-sample estimate of KL(student || teacher) at position t: positive where
    the student favours the token more than the teacher does (its advantage falls), negative
    where the teacher favours it more. Folded into the advantage rather than the loss, it combines
    with any advantage (GRPO's, PPO's, or zero task reward). Detached: no gradient flows through it.
    """
    with torch.no_grad():
        return advantages_T - coef * (student_logp_T - teacher_logp_T)


def kl_estimate(logp_T: torch.Tensor, ref_logp_T: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy.

    With log r = ref_logp - logp: k1 = -log r (unbiased, high variance, can be negative),
    k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased, >= 0, low variance).
    """
    log_ratio_T = torch.clamp(ref_logp_T - logp_T, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_ratio_T
    if estimator == "k2":
        return 0.5 * log_ratio_T.square()
    if estimator == "k3":
        return torch.exp(log_ratio_T) - 1.0 - log_ratio_T
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregation_denominator(mode: Aggregation, loss_mask_T: torch.Tensor,
                            seq_ids_T: torch.Tensor | None = None) -> int:
    """What `aggregate` divides by for this batch: trained tokens, or sequences with a trained token.

    Sum it over micro-batches (and ranks) and pass the total to `aggregate` / `policy_loss`.
    """
    _check_mode(mode)
    if mode == "token":
        return int((loss_mask_T != 0).sum())
    seq_ids_T = _seq_ids(loss_mask_T, seq_ids_T)
    return int(torch.unique(seq_ids_T[loss_mask_T != 0]).numel())


def aggregate(values_T: torch.Tensor, loss_mask_T: torch.Tensor, seq_ids_T: torch.Tensor | None = None,
              mode: Aggregation = "token", *, denominator: float | None = None) -> torch.Tensor:
    """Masked per-token values to one scalar by `mode` (see the module docstring).

    `seq_ids_T` gives each token's sequence index (any non-negative ids); None reads a 2-D input
    as [B, T] rows. `denominator` defaults to this batch's own (`aggregation_denominator`); an
    empty batch gives 0 (still differentiable).
    """
    _check_mode(mode)
    if values_T.shape != loss_mask_T.shape:
        raise ValueError(f"values shape {tuple(values_T.shape)} must equal loss_mask shape "
                         f"{tuple(loss_mask_T.shape)}")
    if denominator is None:
        denominator = max(aggregation_denominator(mode, loss_mask_T, seq_ids_T), 1)
    elif not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    mask_T = loss_mask_T.to(values_T.dtype)
    masked_T = values_T * mask_T
    if mode == "token" or mode == "seq-mean-token-sum":
        # Both are sum of masked values / denominator; they differ only in what the denominator counts.
        return masked_T.sum() / denominator
    seq_ids_T = _seq_ids(loss_mask_T, seq_ids_T).reshape(-1)
    num_seqs = int(seq_ids_T.max()) + 1 if seq_ids_T.numel() else 0
    seq_sum_B = masked_T.new_zeros(num_seqs).index_add(0, seq_ids_T, masked_T.reshape(-1))
    seq_count_B = mask_T.new_zeros(num_seqs).index_add(0, seq_ids_T, mask_T.reshape(-1))
    return (seq_sum_B / seq_count_B.clamp(min=1)).sum() / denominator


def policy_loss(logp_T: torch.Tensor, advantages_T: torch.Tensor, loss_mask_T: torch.Tensor,
                seq_ids_T: torch.Tensor | None, config: PolicyLossConfig, *,
                old_logp_T: torch.Tensor | None = None, rollout_logp_T: torch.Tensor | None = None,
                ref_logp_T: torch.Tensor | None = None, entropy_T: torch.Tensor | None = None,
                teacher_logp_T: torch.Tensor | None = None, denominator: float | None = None) -> PolicyLossOutput:
    """PPO-clip policy loss with TIS, KL and entropy terms, aggregated by `config.aggregation`.

    `rollout_logp_T` is needed when `config.tis_cap` or `config.mis_band` is set, `ref_logp_T` when `config.kl_coef` > 0,
    `teacher_logp_T` when `config.distill_coef` > 0 (with `distill_mode` "advantage" the advantages
    are first folded with `distill_advantages`, from the student's log-probs the step starts from:
    `old_logp_T`; with "kl" the reverse-KL term is added to the loss), and `entropy_T` (with
    gradient) when `config.entropy_coef` > 0.
    """
    _check_same_shape(logp_T, advantages_T=advantages_T, loss_mask_T=loss_mask_T, old_logp_T=old_logp_T,
                      rollout_logp_T=rollout_logp_T, ref_logp_T=ref_logp_T, entropy_T=entropy_T,
                      teacher_logp_T=teacher_logp_T)
    if config.distill_coef > 0 and teacher_logp_T is None:
        raise ValueError("PolicyLossConfig.distill_coef > 0 needs teacher_logp_T (the teacher's log-probs of the "
                         "same tokens); pass them or set distill_coef=0")
    old_logp_T = logp_T.detach() if old_logp_T is None else old_logp_T.detach()
    if config.distill_coef > 0 and config.distill_mode == "advantage":
        assert teacher_logp_T is not None
        advantages_T = distill_advantages(advantages_T, old_logp_T, teacher_logp_T, config.distill_coef)
    mask_T = loss_mask_T != 0
    pg_T, clipped_T, dual_clipped_T = ppo_clip_loss(
        logp_T, old_logp_T, advantages_T, eps_clip_low=config.eps_clip_low,
        eps_clip_high=config.eps_clip_high, dual_clip_c=config.dual_clip_c)
    tis_truncated_T = torch.zeros_like(mask_T)
    if config.tis_cap is not None:
        if rollout_logp_T is None:
            raise ValueError("PolicyLossConfig.tis_cap is set but no rollout_logp_T was given; pass the engine's "
                             "log-probs or set tis_cap=None")
        weight_T, tis_truncated_T = tis_weights(old_logp_T, rollout_logp_T, config.tis_cap)
        pg_T = pg_T * weight_T
    mis_masked_T = torch.zeros_like(mask_T)
    if config.mis_band is not None:
        if rollout_logp_T is None:
            raise ValueError("PolicyLossConfig.mis_band is set but no rollout_logp_T was given; pass the engine's "
                             "log-probs or set mis_band=None")
        keep_T = mis_keep(old_logp_T, rollout_logp_T, config.mis_band)
        mis_masked_T = ~keep_T
        tis_truncated_T = tis_truncated_T & keep_T
        pg_T = torch.where(keep_T, pg_T, torch.zeros_like(pg_T))

    if denominator is None:  # computed once here rather than by each aggregate() call
        denominator = max(aggregation_denominator(config.aggregation, loss_mask_T, seq_ids_T), 1)

    def agg(values_T: torch.Tensor) -> torch.Tensor:
        return aggregate(values_T, loss_mask_T, seq_ids_T, config.aggregation, denominator=denominator)

    pg_loss = agg(pg_T)
    loss = pg_loss
    kl = pg_loss.new_zeros(())
    if config.kl_coef > 0:
        if ref_logp_T is None:
            raise ValueError("PolicyLossConfig.kl_coef > 0 but no ref_logp_T was given; pass the reference "
                             "log-probs or set kl_coef=0")
        kl = agg(kl_estimate(logp_T, ref_logp_T.detach(), config.kl_estimator))
        loss = loss + config.kl_coef * kl
    if config.distill_coef > 0 and config.distill_mode == "kl":
        assert teacher_logp_T is not None  # checked above
        loss = loss + config.distill_coef * agg(kl_estimate(logp_T, teacher_logp_T.detach(), "k2"))
    entropy = pg_loss.new_zeros(())
    if config.entropy_coef > 0:
        if entropy_T is None:
            raise ValueError("PolicyLossConfig.entropy_coef > 0 but no entropy_T was given; pass the per-token "
                             "entropy from kernels.logprobs or set entropy_coef=0")
        entropy = agg(entropy_T)
        loss = loss - config.entropy_coef * entropy
    elif entropy_T is not None:
        entropy = agg(entropy_T.detach())
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss.detach(), kl=kl.detach(), entropy=entropy.detach(),
                            clipped_T=clipped_T & mask_T, dual_clipped_T=dual_clipped_T & mask_T,
                            tis_truncated_T=tis_truncated_T & mask_T, mis_masked_T=mis_masked_T & mask_T)


def sft_loss(logp_T: torch.Tensor, loss_mask_T: torch.Tensor, seq_ids_T: torch.Tensor | None = None,
             aggregation: Aggregation = "token", *, denominator: float | None = None) -> torch.Tensor:
    """Cross-entropy -log p(target) on the masked tokens, aggregated like the policy loss."""
    _check_same_shape(logp_T, loss_mask_T=loss_mask_T)
    return aggregate(-logp_T, loss_mask_T, seq_ids_T, aggregation, denominator=denominator)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def _seq_ids(loss_mask_T: torch.Tensor, seq_ids_T: torch.Tensor | None) -> torch.Tensor:
    if seq_ids_T is None:
        if loss_mask_T.dim() != 2:
            raise ValueError(f"sequence aggregation needs seq_ids for a {loss_mask_T.dim()}-D (packed) batch; only a "
                             "2-D [B, T] batch is read as one sequence per row")
        rows_B = torch.arange(loss_mask_T.shape[0], device=loss_mask_T.device)
        return rows_B[:, None].expand_as(loss_mask_T)
    if seq_ids_T.shape != loss_mask_T.shape:
        raise ValueError(f"seq_ids shape {tuple(seq_ids_T.shape)} must equal loss_mask shape "
                         f"{tuple(loss_mask_T.shape)}")
    if seq_ids_T.dtype != torch.int64 or (seq_ids_T.numel() and int(seq_ids_T.min()) < 0):
        raise ValueError(f"seq_ids must be non-negative int64 sequence indices, got dtype {seq_ids_T.dtype}")
    return seq_ids_T


def _check_same_shape(logp_T: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, tensor_T in others.items():
        if tensor_T is not None and tensor_T.shape != logp_T.shape:
            raise ValueError(f"{name} has shape {tuple(tensor_T.shape)}, but logp_T has {tuple(logp_T.shape)}; "
                             "every per-token input must share one layout")
