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
from miles_async.models.layers import MLP, Linear, RMSNorm

PREFIX = "mtp."  # the head's weights in checkpoints and updates
DRAFT_SEED = 20_251_202  # of the head's first weights: the trainer's and the engines' agree without a push


class DraftHead(nn.Module):
    """g_{t+1} = norm(x + mlp(mlp_norm(x))), x = eh_proj([enorm(embed(token_{t+1})), hnorm(h_t)])."""

    def __init__(self, config: ModelConfig) -> None:
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



def draft_loss(model: nn.Module, h_PD: torch.Tensor, tokens_P: torch.Tensor, next_h_PD: torch.Tensor,
               targets_P: torch.Tensor, *, feature_coef: float = 0.1,
               chunk_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head's loss over P positions where the engine would draft (summed): from the
    policy's hidden state h_t and token t+1 (`tokens_P`), the head guesses g_{t+1}; the loss is the
    cross-entropy of `lm_head(g_{t+1})` to token t+2 (`targets_P`, sampled from the policy: in
    expectation the forward KL to the policy's distribution) plus `feature_coef` times a smooth-L1
    pull of g_{t+1} toward the policy's h_{t+1} (what lets the head chain its own guesses, as the
    engine does). Everything of the policy's is detached: the gradient reaches the head alone, not
    the embedding and lm_head it shares. The vocabulary projection goes through the chunked
    log-prob kernel (no [P, V] logits held). Returns (loss sum, cross-entropy sum, detached)."""
    from miles_async.kernels.logprobs import token_logprobs_from_hidden

    head = model.mtp
    if head is None:
        raise ValueError("draft_loss needs a model with a draft head (CausalLM.add_draft_head)")
    with torch.no_grad():
        e_PD = model.model.embed_tokens(tokens_P)
    g_PD = head(h_PD.detach(), e_PD)
    logq_P, _ = token_logprobs_from_hidden(g_PD.float(), model.lm_head.weight.detach().float(), targets_P,
                                           chunk_tokens=chunk_tokens)
    feature_P = torch.nn.functional.smooth_l1_loss(g_PD.float(), next_h_PD.detach().float(),
                                                   reduction="none").mean(dim=-1)
    return (feature_coef * feature_P - logq_P).sum(), -logq_P.detach().sum()


def distill_head(model: nn.Module, sequences_BT: torch.Tensor, num_prompt_tokens: int, *, steps: int = 150,
                 lr: float = 3e-3) -> list[float]:
    """Train `model`'s draft head offline on sequences the model generated itself ([B, T], the first
    `num_prompt_tokens` of each a prompt): `draft_loss` at every position whose next two tokens were
    generated, full batch, Adam, `steps` steps; the policy is not touched. A draft head for a model
    before any RL run (the online training keeps it up to date during one: trainer.draft). Returns
    the mean cross-entropy of each step."""
    from miles_async.models.attention import DenseCausalAttention

    head = model.add_draft_head()
    positions_BT = torch.arange(sequences_BT.shape[1]).expand_as(sequences_BT)
    with torch.no_grad():
        h_BTD, _ = model.model(sequences_BT, positions_BT, DenseCausalAttention(), None)
    t = torch.arange(max(num_prompt_tokens - 2, 0), sequences_BT.shape[1] - 2)
    width = h_BTD.shape[-1]
    pairs = (h_BTD[:, t].reshape(-1, width), sequences_BT[:, t + 1].reshape(-1),
             h_BTD[:, t + 1].reshape(-1, width), sequences_BT[:, t + 2].reshape(-1))
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        loss, ce = draft_loss(model, *pairs)
        optimizer.zero_grad()
        (loss / len(t) / sequences_BT.shape[0]).backward()
        optimizer.step()
        curve.append(float(ce) / pairs[1].numel())
    return curve
