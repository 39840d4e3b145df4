"""The draft model of speculative decoding: a multi-token-prediction (MTP) head on the policy.

    model.add_draft_head()                       # CausalLM.mtp: the head, seeded (same on every side)
    g_RD = model.mtp(h_RD, model.model.embed_tokens(next_R))
    logits_RV = model.lm_head(g_RD)              # the policy's own vocabulary projection

What it is. DeepSeek-V3's MTP module without its attention: the policy's final hidden state at
position t (`h_t`, what `lm_head` reads) and the embedding of the token at t+1 are each RMS-normed,
concatenated and projected back to the hidden width (`eh_proj`); one SwiGLU MLP block with a
residual follows, then a final RMSNorm. The result `g_{t+1}` is a guess at the policy's hidden state
at t+1: `lm_head(g_{t+1})` drafts the token at t+2, and `g_{t+1}` with that token's embedding drafts
the next one (k tokens, chained, as EAGLE chains its features). The head's weights are named
`mtp.*` in checkpoints and weight updates; the embedding and `lm_head` are the policy's, shared.

Why a head and not a small model of the same tokenizer. No smaller sibling exists for the models we
serve (a tiny random model, SmolLM2-135M); a head reads the policy's hidden states, which already
carry the context, so a few million parameters (0.1M on the tiny model) draft well; sharing the
policy's embedding and `lm_head` means the draft's vocabulary projection moves with the policy for
free, and training it (trainer/draft.py) needs nothing the policy's own forward does not compute.
Why no attention. An attention layer would need KV of its own per request (a second paged cache kept
consistent through the prefix cache, retraction and pauses) for a modest gain in acceptance at one
layer: the policy's `h_t` has attended to the context already. The head is stateless: what a request
keeps between steps is one hidden state (`Request.draft_hidden`).

Tensor names (STYLE rule 10): R rows, D hidden, F MLP width.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from miles_async.models.config import ModelConfig

PREFIX = "mtp."  # the head's weights in checkpoints and updates
DRAFT_SEED = 20_251_202  # of the head's first weights: the trainer's and the engines' agree without a push


class DraftHead(nn.Module):
    """g_{t+1} = norm(x + mlp(mlp_norm(x))), x = eh_proj([enorm(embed(token_{t+1})), hnorm(h_t)])."""

    def __init__(self, config: ModelConfig) -> None:
        from miles_async.models.transformer import MLP, Linear, RMSNorm

        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(width, eps)
        self.hnorm = RMSNorm(width, eps)
        self.eh_proj = Linear(2 * width, width, bias=False)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = MLP(width, config.intermediate_size)
        self.norm = RMSNorm(width, eps)

    def forward(self, h_RD: torch.Tensor, e_RD: torch.Tensor) -> torch.Tensor:
        """The guessed hidden state at t+1 from the policy's (or the previous guess's) at t and the
        embedding of the token at t+1; feed it to the policy's `lm_head` for the token at t+2."""
        x_RD = self.eh_proj(torch.cat([self.enorm(e_RD), self.hnorm(h_RD)], dim=-1))
        return self.norm(x_RD + self.mlp(self.mlp_norm(x_RD)))

    def reset_parameters(self, seed: int = DRAFT_SEED) -> None:
        """Seeded first weights (norms 1, matrices N(0, 0.02)), the same in every process."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def has_draft(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names hold a draft head."""
    return any(name.startswith(PREFIX) for name in names)


def draft_loss(model: nn.Module, input_ids_T: torch.Tensor, h_TD: torch.Tensor, logits_TV: torch.Tensor,
               mask_T: torch.Tensor, *, feature_coef: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft head's distillation loss on one packed row the policy ran (sum over positions):
    at each t with mask_T[t + 2] set (a token the engine would have drafted: a sampled one whose
    predecessor was sampled too, so both lie in one sample), the head reads the policy's h_t and
    the embedding of token t+1, and is trained toward the policy's distribution at t+1 (forward KL
    to softmax(logits_{t+1}), the token-level target) and its hidden state h_{t+1} (smooth L1 times
    `feature_coef`, which is what lets the head chain its own guesses). Everything of the policy's
    is detached: gradients reach the head alone (the embedding and lm_head it shares are not moved).
    Returns (loss sum, KL sum, the number of positions where the head's argmax is the policy's)."""
    head = model.mtp
    if head is None:
        raise ValueError("draft_loss needs a model with a draft head (CausalLM.add_draft_head)")
    mask = mask_T[2:].bool()
    h_PD, target_h_PD = h_TD[:-2][mask].detach(), h_TD[1:-1][mask].detach()
    with torch.no_grad():
        e_PD = model.model.embed_tokens(input_ids_T[1:-1][mask])
        logp_PV = torch.log_softmax(logits_TV[1:-1][mask].detach().float(), dim=-1)
    g_PD = head(h_PD, e_PD)
    logq_PV = torch.log_softmax(torch.nn.functional.linear(g_PD, model.lm_head.weight.detach()).float(), dim=-1)
    kl_P = (logp_PV.exp() * (logp_PV - logq_PV)).sum(dim=-1)
    feature_P = torch.nn.functional.smooth_l1_loss(g_PD.float(), target_h_PD.float(), reduction="none").mean(dim=-1)
    agree = (logq_PV.argmax(dim=-1) == logp_PV.argmax(dim=-1)).sum()
    return (kl_P + feature_coef * feature_P).sum(), kl_P.sum().detach(), agree
