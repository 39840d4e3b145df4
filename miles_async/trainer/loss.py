"""The per-token log-probs and the loss of the train step: plain placeholders, one place to swap.

SWAP POINT: `token_logprobs` is to be replaced by the chunked log-probs of
`miles_async.kernels.logprobs` (no full float32 [tokens, vocab] tensor held at once), and
`policy_loss_sum` by the PPO/TIS/KL losses of `miles_async.rl`. Both keep these signatures' shape:
tensors in, a per-token tensor or a summed scalar out, normalised by the caller.

Tensor names (STYLE rule 10): T packed tokens, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """log p(target) per token, in float32 (log_softmax over the whole vocabulary, then gather)."""
    return F.log_softmax(logits_TV.float(), dim=-1).gather(-1, targets_T[:, None]).squeeze(-1)


def policy_loss_sum(logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor, advantages_T: torch.Tensor,
                    loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Masked REINFORCE, summed over tokens: -sum(advantage * log p * mask).

    With every advantage 1.0 it is SFT cross-entropy. `rollout_logprobs_T` is unused until the
    off-policy correction (TIS) of `miles_async.rl` replaces this function.
    """
    del rollout_logprobs_T
    return -(advantages_T * logprobs_T * loss_mask_T).sum()
