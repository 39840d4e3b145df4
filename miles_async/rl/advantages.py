"""Advantages without a value model: GRPO's group-relative rewards and REINFORCE with a baseline.

Rewards arrive per group of samples drawn from the same prompt, as a [groups, samples] tensor.
- GRPO: reward minus the group mean, divided by the group's standard deviation plus `std_eps`
  when `normalize_std` (Dr. GRPO turns that off: it scales each group's gradient by how spread its
  rewards are).
- REINFORCE: reward minus a baseline, either one the caller gives (broadcastable to [G, S]) or by
  default the mean of the *other* samples of the group (leave-one-out, RLOO), which keeps the
  estimator unbiased because a sample's baseline does not depend on its own reward.
Each sample's advantage then applies to all its trained tokens (`advantages_to_tokens`).

Tensor names (STYLE rule 10): G groups, S samples per group, B sequences (G * S, group-major),
T tokens (packed or flattened; any token layout works as long as `seq_ids_T` matches it).

Try it:
    adv_GS = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), AdvantageConfig())
    adv_T = advantages_to_tokens(adv_GS.flatten(), seq_ids_T, loss_mask_T)
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

ESTIMATORS: tuple[str, ...] = ("grpo", "reinforce")


class AdvantageConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How rewards become advantages.

    estimator: "grpo" (group-relative) or "reinforce" (reward minus a baseline).
    normalize_std: GRPO only; divide the centred rewards by the group's std (unbiased) + std_eps.
    std_eps: keeps a group whose rewards are all equal at advantage 0 rather than 0/0.
    reward_coef: the task reward's weight in the advantage (applied after the estimator: GRPO's
        normalized advantage is scale-free). 0 records the reward but trains on other signals
        only (on-policy distillation with task reward zero).
    """

    # "grpo": reward minus its group's mean; "reinforce": reward minus the mean of the group's others
    estimator: Literal["grpo", "reinforce"] = "grpo"
    normalize_std: bool = True  # "grpo": also divide by the group's std (unbiased) + std_eps
    std_eps: float = 1e-6  # added to that std: a group of equal rewards gets advantage 0, not 0/0
    reward_coef: float = 1.0  # the task reward's weight in the advantage; 0: trained on other signals only

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"AdvantageConfig.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not self.std_eps > 0:
            raise ValueError(f"AdvantageConfig.std_eps must be > 0, got {self.std_eps}")
        if not self.reward_coef >= 0:
            raise ValueError(f"AdvantageConfig.reward_coef must be >= 0, got {self.reward_coef}")


def grpo_advantages(rewards_GS: torch.Tensor, *, normalize_std: bool = True, std_eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of the group) [/ (std of the group + std_eps)], per sample, as float32."""
    rewards_GS = _check_rewards(rewards_GS, min_group_size=2)
    centred_GS = rewards_GS - rewards_GS.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred_GS
    return centred_GS / (rewards_GS.std(dim=1, keepdim=True) + std_eps)


def reinforce_advantages(rewards_GS: torch.Tensor, baseline: torch.Tensor | float | None = None) -> torch.Tensor:
    """r - baseline per sample; the default baseline is the mean of the group's other samples."""
    if baseline is not None:
        rewards_GS = _check_rewards(rewards_GS, min_group_size=1)
        baseline_GS = torch.as_tensor(baseline, dtype=rewards_GS.dtype, device=rewards_GS.device)
        try:
            return rewards_GS - baseline_GS.expand_as(rewards_GS)
        except RuntimeError:
            raise ValueError(f"baseline of shape {tuple(baseline_GS.shape)} does not broadcast to the rewards' "
                             f"{tuple(rewards_GS.shape)}; give a scalar, [G, 1] or [G, S]") from None
    rewards_GS = _check_rewards(rewards_GS, min_group_size=2)
    num_samples = rewards_GS.shape[1]
    others_mean_GS = (rewards_GS.sum(dim=1, keepdim=True) - rewards_GS) / (num_samples - 1)
    return rewards_GS - others_mean_GS


def compute_advantages(rewards_GS: torch.Tensor, config: AdvantageConfig,
                       baseline: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-sample advantages [G, S] by the configured estimator (`baseline` is REINFORCE's only)."""
    if config.estimator == "grpo":
        if baseline is not None:
            raise ValueError("a baseline was given but AdvantageConfig.estimator is 'grpo' (which uses the "
                             "group mean); set estimator='reinforce' to use it")
        return grpo_advantages(rewards_GS, normalize_std=config.normalize_std, std_eps=config.std_eps)
    return reinforce_advantages(rewards_GS, baseline)


def advantages_to_tokens(advantages_B: torch.Tensor, seq_ids_T: torch.Tensor,
                         loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Each token gets its sequence's advantage where the loss mask is set, 0 elsewhere.

    `seq_ids_T[t]` is the index in `advantages_B` of the sequence token t belongs to (for a padded
    [B, T] batch: `torch.arange(B)[:, None].expand(B, T)`).
    """
    if advantages_B.dim() != 1:
        raise ValueError(f"advantages must be one per sequence, [B], got shape {tuple(advantages_B.shape)}; "
                         "flatten a [G, S] tensor group-major first")
    if seq_ids_T.shape != loss_mask_T.shape:
        raise ValueError(f"seq_ids shape {tuple(seq_ids_T.shape)} must equal loss_mask shape "
                         f"{tuple(loss_mask_T.shape)}")
    if seq_ids_T.numel() and (int(seq_ids_T.min()) < 0 or int(seq_ids_T.max()) >= advantages_B.shape[0]):
        raise ValueError(f"seq_ids must lie in [0, {advantages_B.shape[0]}) (one advantage per sequence), got "
                         f"{int(seq_ids_T.min())}..{int(seq_ids_T.max())}")
    return advantages_B[seq_ids_T] * loss_mask_T.to(advantages_B.dtype)


def _check_rewards(rewards_GS: torch.Tensor, *, min_group_size: int) -> torch.Tensor:
    if rewards_GS.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples per group], got shape {tuple(rewards_GS.shape)}")
    if rewards_GS.shape[1] < min_group_size:
        raise ValueError(f"groups of {rewards_GS.shape[1]} sample(s) have no group baseline; use groups of "
                         f">= {min_group_size} samples or give REINFORCE an explicit baseline")
    if not torch.isfinite(rewards_GS).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function or drop those samples")
    return rewards_GS.to(torch.promote_types(rewards_GS.dtype, torch.float32))
