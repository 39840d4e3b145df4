"""RL math of the train step: advantages, losses, off-policy correction and fidelity metrics.

Pure torch, deterministic, no process group: the trainer ranks call these on their micro-batches.
- `advantages`: GRPO group-relative and REINFORCE-with-baseline advantages, broadcast to tokens.
- `losses`: PPO clip with dual clip, truncated importance sampling (TIS), KL to a reference
  (k1/k2/k3), entropy bonus, SFT cross-entropy; token / sequence / seq-mean-token-sum aggregation.
- `metrics`: |trainer - rollout| log-prob gap, their k3 KL, clip and TIS fractions, entropy.
Per-token log-probs and entropy come from `miles_async.kernels.logprobs` (chunked over tokens).

Try it:
    from miles_async.rl import AdvantageConfig, PolicyLossConfig, compute_advantages, policy_loss
    adv_GS = compute_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), AdvantageConfig())
"""

from miles_async.rl.advantages import (
    AdvantageConfig,
    advantages_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
)
from miles_async.rl.losses import (
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate,
    aggregation_denominator,
    distill_advantages,
    kl_estimate,
    policy_loss,
    ppo_clip_loss,
    sft_loss,
    tis_weights,
)
from miles_async.rl.metrics import (
    METRIC_SUM_NAMES,
    MetricSums,
    RLMetrics,
    SumVector,
    metric_parts,
    metric_sums,
)

__all__ = [
    "METRIC_SUM_NAMES",
    "AdvantageConfig",
    "MetricSums",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "RLMetrics",
    "SumVector",
    "advantages_to_tokens",
    "aggregate",
    "aggregation_denominator",
    "compute_advantages",
    "distill_advantages",
    "grpo_advantages",
    "kl_estimate",
    "metric_parts",
    "metric_sums",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_advantages",
    "sft_loss",
    "tis_weights",
]
