"""Per-token log-probs of given targets and per-token entropy, in chunks of tokens.

A full float32 [tokens, vocab] tensor is the largest thing an RL step would otherwise hold (4096
tokens x 152k vocab is 2.5 GB, and autograd keeps two or three of them). Here the logits are made,
reduced and dropped one chunk of `chunk_tokens` rows at a time, in the forward and again in the
backward (a custom autograd.Function recomputes each chunk rather than saving it), so the peak is
two [chunk_tokens, vocab] float32 buffers plus the weight's float32 gradient (measured on CPU:
2048 tokens x 152k vocab, chunks of 512: 0.70 GB against 6.3 GB unchunked).

- `token_logprobs_from_hidden` never materialises the logits: it takes the final hidden states
  (`model.model(...)`'s h) and the lm_head weight. Under FSDP2 pass the unsharded weight (call it
  where the lm_head's parameters are gathered, or keep lm_head unsharded).
- `token_logprobs_from_logits` takes logits the caller already has; its gradient is necessarily a
  full [tokens, vocab] tensor, in the logits' own dtype.
- `token_logprobs_unchunked` is the plain reference the tests compare to.

Both log-probs and entropy are of softmax(logits / temperature), the distribution the engine
sampled from, and are float32 whatever the input dtype (float64 for float64 input, which the
exact tests use). Targets must be valid token ids; a masked position may hold any valid id (0,
say) and be ignored by the loss.

Tensor names (STYLE rule 10): T tokens (leading dims flattened), V vocab, D hidden, C tokens of one
chunk.

Try it:
    h_TD, w_VD = torch.randn(8, 16, requires_grad=True), torch.randn(1000, 16, requires_grad=True)
    logp_T, entropy_T = token_logprobs_from_hidden(h_TD, w_VD, torch.randint(0, 1000, (8,)))
    (logp_T.sum() + entropy_T.sum()).backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 512


def token_logprobs_from_hidden(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    bf16_matmuls: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per token from hidden states [..., D] and the lm_head weight [V, D].

    Leading dims of `hidden_TD` (e.g. [B, T, D]) are kept in the outputs ([B, T]). Differentiable
    in both `hidden_TD` and `weight_VD`.

    `bf16_matmuls=True` lets a CPU's float32 vocabulary matmuls (forward and backward) take bf16
    inputs, accumulating and returning float32 (oneDNN's "bf16" math mode, set for these matmuls
    only): for a trainer computing in bf16, whose hidden states hold bf16 values already; the
    logits are never rounded to bf16, as they are under plain autocast. No effect on other devices.
    Measured here (2 threads, 1024 tokens x SmolLM2's 49k vocabulary, forward and backward): 2.1 s
    -> 1.3 s, log-probs within 2e-6 of the default's (oneDNN took its float32-exact path here; a
    CPU where it rounds the inputs would differ by bf16's input rounding, bounded in the tests).
    """
    _check_common(targets_T, hidden_TD.shape[:-1], weight_VD.shape[0], temperature, chunk_tokens)
    if weight_VD.dim() != 2 or weight_VD.shape[1] != hidden_TD.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden_TD.shape[-1]}] to match hidden's last dim, got "
                         f"shape {tuple(weight_VD.shape)}")
    lead = hidden_TD.shape[:-1]
    logp_T, entropy_T = _HiddenLogprobs.apply(
        hidden_TD.reshape(-1, hidden_TD.shape[-1]), weight_VD, targets_T.reshape(-1), temperature, chunk_tokens,
        bf16_matmuls)
    return logp_T.reshape(lead), entropy_T.reshape(lead)


def token_logprobs_from_logits(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per token from logits [..., V], upcast to float32 a chunk at a time."""
    _check_common(targets_T, logits_TV.shape[:-1], logits_TV.shape[-1], temperature, chunk_tokens)
    lead = logits_TV.shape[:-1]
    logp_T, entropy_T = _LogitsLogprobs.apply(
        logits_TV.reshape(-1, logits_TV.shape[-1]), targets_T.reshape(-1), temperature, chunk_tokens)
    return logp_T.reshape(lead), entropy_T.reshape(lead)


def token_logprobs_unchunked(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference: float32 log_softmax over the whole [T, V], then gather; plain autograd."""
    _check_common(targets_T, logits_TV.shape[:-1], logits_TV.shape[-1], temperature, 1)
    logp_TV = F.log_softmax(logits_TV.to(_compute_dtype(logits_TV.dtype)) / temperature, dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(-1, targets_T[..., None]).squeeze(-1), entropy_T


def _check_common(targets_T: torch.Tensor, lead: torch.Size, vocab: int, temperature: float,
                  chunk_tokens: int) -> None:
    if targets_T.shape != lead:
        raise ValueError(f"targets shape {tuple(targets_T.shape)} must equal the leading dims {tuple(lead)} "
                         "of the hidden states / logits")
    if targets_T.dtype != torch.int64:
        raise ValueError(f"targets must be int64 token ids, got {targets_T.dtype}")
    if targets_T.numel() and (int(targets_T.min()) < 0 or int(targets_T.max()) >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}), got ids from {int(targets_T.min())} to "
                         f"{int(targets_T.max())}; put a valid id (e.g. 0) at masked positions")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def _chunk_forward(z_CV: torch.Tensor, targets_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    """logp, logsumexp and entropy of float32 scaled logits; overwrites `z_CV` to save a buffer."""
    lse_C = torch.logsumexp(z_CV, dim=-1)
    logp_C = z_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    logp_CV = z_CV.sub_(lse_C[:, None])
    entropy_C = -logp_CV.exp().mul_(logp_CV).sum(-1)  # two [C, V] buffers at most
    return logp_C, lse_C, entropy_C


def _chunk_grad(z_CV: torch.Tensor, targets_C: torch.Tensor, lse_C: torch.Tensor, entropy_C: torch.Tensor,
                grad_logp_C: torch.Tensor, grad_entropy_C: torch.Tensor, temperature: float) -> torch.Tensor:
    """d(loss)/d(unscaled logits) of one chunk, in place of `z_CV`.

    With logp = z - lse and p = exp(logp): d logp[target]/dz = onehot - p and
    d entropy/dz = -p * (logp + entropy); the 1/temperature is the chain rule through z = x / t.
    """
    logp_CV = z_CV.sub_(lse_C[:, None])
    p_CV = logp_CV.exp()
    grad_CV = logp_CV.add_(entropy_C[:, None]).mul_(grad_entropy_C[:, None]).add_(grad_logp_C[:, None])
    grad_CV.mul_(p_CV).neg_()
    del p_CV
    grad_CV.scatter_add_(1, targets_C[:, None], grad_logp_C[:, None])
    if temperature != 1.0:
        grad_CV.div_(temperature)
    return grad_CV


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/bf16/fp16 inputs; float64 inputs stay float64 (what the exact tests use)."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_logits(x_CV: torch.Tensor, temperature: float, *, owned: bool) -> torch.Tensor:
    """One chunk's logits / temperature in float32 (float64 for float64 input), safe to overwrite.

    `owned`: `x_CV` was just made for this chunk (a matmul's output) and may be reused in place;
    otherwise (the caller's logits) it is copied.
    """
    z_CV = x_CV.to(_compute_dtype(x_CV.dtype), copy=not owned)
    return z_CV.div_(temperature) if temperature != 1.0 else z_CV


def _grads_or_zeros(grad_logp_T: torch.Tensor | None, grad_entropy_T: torch.Tensor | None,
                    like_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    zeros_T = torch.zeros_like(like_T)
    return (zeros_T if grad_logp_T is None else grad_logp_T.to(like_T.dtype),
            zeros_T if grad_entropy_T is None else grad_entropy_T.to(like_T.dtype))


@contextlib.contextmanager
def _matmul_math(bf16: bool) -> Iterator[None]:
    """oneDNN's float32 matmuls allowed bf16 inputs (`bf16`) inside, the setting restored after."""
    if not bf16:
        yield
        return
    settings = torch.backends.mkldnn.matmul
    before = settings.fp32_precision
    settings.fp32_precision = "bf16"
    try:
        yield
    finally:
        settings.fp32_precision = before


def _forward_in_chunks(rows_TX: torch.Tensor, targets_T: torch.Tensor, chunk_tokens: int,
                       chunk_logits: Callable[[slice], torch.Tensor],
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp_T, lse_T, entropy_T), with only one chunk's [C, V] scaled logits alive at a time."""
    num_tokens = rows_TX.shape[0]
    logp_T = torch.empty(num_tokens, dtype=_compute_dtype(rows_TX.dtype), device=rows_TX.device)
    lse_T, entropy_T = torch.empty_like(logp_T), torch.empty_like(logp_T)
    for start in range(0, num_tokens, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        z_CV = chunk_logits(rows)
        logp_T[rows], lse_T[rows], entropy_T[rows] = _chunk_forward(z_CV, targets_T[rows])
        del z_CV
    return logp_T, lse_T, entropy_T


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor,
                temperature: float, chunk_tokens: int, bf16_matmuls: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with _matmul_math(bf16_matmuls):
            logp_T, lse_T, entropy_T = _forward_in_chunks(
                hidden_TD, targets_T, chunk_tokens,
                lambda rows: _scaled_logits(F.linear(hidden_TD[rows], weight_VD), temperature, owned=True))
        ctx.save_for_backward(hidden_TD, weight_VD, targets_T, lse_T, entropy_T)
        ctx.temperature, ctx.chunk_tokens, ctx.bf16_matmuls = temperature, chunk_tokens, bf16_matmuls
        ctx.set_materialize_grads(False)
        return logp_T, entropy_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logp_T: torch.Tensor | None,
                 grad_entropy_T: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden_TD, weight_VD, targets_T, lse_T, entropy_T = ctx.saved_tensors
        grad_logp_T, grad_entropy_T = _grads_or_zeros(grad_logp_T, grad_entropy_T, lse_T)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden_TD = torch.empty_like(hidden_TD) if need_hidden else None
        # Accumulate the weight's gradient in float32 (at least) whatever the weight's dtype.
        acc_dtype = _compute_dtype(weight_VD.dtype)
        grad_weight_VD = torch.zeros(weight_VD.shape, dtype=acc_dtype, device=weight_VD.device) \
            if need_weight else None
        with _matmul_math(ctx.bf16_matmuls):
            for start in range(0, hidden_TD.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                z_CV = _scaled_logits(F.linear(hidden_TD[rows], weight_VD), ctx.temperature, owned=True)
                grad_CV = _chunk_grad(z_CV, targets_T[rows], lse_T[rows], entropy_T[rows], grad_logp_T[rows],
                                      grad_entropy_T[rows], ctx.temperature).to(weight_VD.dtype)
                if grad_hidden_TD is not None:
                    grad_hidden_TD[rows] = grad_CV @ weight_VD
                if grad_weight_VD is not None:
                    grad_weight_VD.addmm_(grad_CV.T.to(acc_dtype), hidden_TD[rows].to(acc_dtype))
                del z_CV, grad_CV
        if grad_weight_VD is not None:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        return grad_hidden_TD, grad_weight_VD, None, None, None, None


class _LogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_TV: torch.Tensor, targets_T: torch.Tensor, temperature: float,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp_T, lse_T, entropy_T = _forward_in_chunks(
            logits_TV, targets_T, chunk_tokens,
            lambda rows: _scaled_logits(logits_TV[rows], temperature, owned=False))
        ctx.save_for_backward(logits_TV, targets_T, lse_T, entropy_T)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)
        return logp_T, entropy_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logp_T: torch.Tensor | None,
                 grad_entropy_T: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits_TV, targets_T, lse_T, entropy_T = ctx.saved_tensors
        grad_logp_T, grad_entropy_T = _grads_or_zeros(grad_logp_T, grad_entropy_T, lse_T)
        grad_logits_TV = torch.empty_like(logits_TV)
        for start in range(0, logits_TV.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            z_CV = _scaled_logits(logits_TV[rows], ctx.temperature, owned=False)
            grad_logits_TV[rows] = _chunk_grad(z_CV, targets_T[rows], lse_T[rows], entropy_T[rows],
                                               grad_logp_T[rows], grad_entropy_T[rows], ctx.temperature)
            del z_CV
        return grad_logits_TV, None, None, None
