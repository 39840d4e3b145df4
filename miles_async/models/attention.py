"""Attention backends: the seam between the models and whoever owns the keys and values.

A model computes q, k and v (RoPE applied, q/k-norm too for Qwen3) and hands them to an
`AttentionBackend`; the backend returns the attended values. The default, `DenseCausalAttention`,
attends over the tokens of the call itself (training, scoring, parity tests); the embedded engine
supplies its own backend that stores k/v in its paged cache and attends over the cached prefix.

Packed rows: a sample's positions are consecutive, so a token whose position is not its left
neighbour's plus one starts a new sample (positions restarting at 0 do), and a token attends only
to earlier tokens of its own sample: the mask is block-diagonal causal.

Shared prefixes (`DenseCausalAttention(branches_BT=...)`): samples that begin with the same tokens
(a GRPO group's prompt) can be packed as one document, the common prefix (the trunk, branch 0)
once and then each sample's remaining tokens (branch 1, 2, ...) with positions continuing the
trunk's. A branch token attends to the trunk and to earlier tokens of its own branch, which is
exactly what it attends to in its own sample, so its output is the same while the trunk is run
once. A document starts at a trunk token whose position breaks the consecutive run.

Tensor names (STYLE rule 10): B batch, T query tokens, S key tokens, N query heads, K kv heads,
H head dim.

Try it: `DenseCausalAttention()(0, q_BTNH, k_BTKH, v_BTKH, positions_BT)`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from miles_async.kernels import batch_invariant


@runtime_checkable
class AttentionBackend(Protocol):
    """Attends q over k/v. q/k already carry RoPE; expanding K kv heads to N is the backend's job."""

    def __call__(
        self,
        layer_idx: int,
        q_BTNH: torch.Tensor,
        k_BTKH: torch.Tensor,
        v_BTKH: torch.Tensor,
        positions_BT: torch.Tensor,
    ) -> torch.Tensor: ...


def sample_starts(positions_BT: torch.Tensor) -> torch.Tensor:
    """True where a packed sample starts: where positions stop being consecutive."""
    starts_BT = torch.ones_like(positions_BT, dtype=torch.bool)
    starts_BT[:, 1:] = positions_BT[:, 1:] != positions_BT[:, :-1] + 1
    return starts_BT


def sample_ids(positions_BT: torch.Tensor) -> torch.Tensor:
    """Number the packed samples of each row (from 1)."""
    return torch.cumsum(sample_starts(positions_BT).to(torch.int64), dim=1)


def packed_causal_mask(positions_BT: torch.Tensor) -> torch.Tensor | None:
    """The boolean mask [B, 1, T, T] (True = may attend), or None when every row is one sample."""
    ids_BT = sample_ids(positions_BT)
    if bool((ids_BT[:, -1] == 1).all()):
        return None
    num_tokens = positions_BT.shape[1]
    causal_TT = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=positions_BT.device).tril()
    same_sample_BTT = ids_BT[:, :, None] == ids_BT[:, None, :]
    return (same_sample_BTT & causal_TT)[:, None]


class PaddedLayout:
    """Where each token of packed rows goes in a [samples, longest, ...] padded batch, and back.

    Attention over many short packed samples with a [T, T] block-diagonal mask costs T^2; padded
    to [S, L] with SDPA's causal path it costs S * L^2 (64 samples of 14 tokens: 896^2 vs
    64 * 14^2, 64x less). Padding sits after each sample's tokens, so causal attention never
    reads it from a real token; padded rows' outputs are dropped. `starts_BT` is True where a
    sample (or a shared-prefix document) starts.
    """

    def __init__(self, starts_BT: torch.Tensor) -> None:
        starts = starts_BT.reshape(-1)
        num_tokens = starts.numel()
        sample_T = torch.cumsum(starts.to(torch.int64), 0) - 1
        first_S = torch.nonzero(starts).reshape(-1)
        self.num_samples = first_S.numel()
        device = starts_BT.device
        lengths_S = torch.diff(first_S, append=torch.tensor([num_tokens], device=device))
        self.longest = int(lengths_S.max())
        offset_T = torch.arange(num_tokens, device=device) - first_S[sample_T]
        self.flat_index_T = sample_T * self.longest + offset_T  # token -> slot in [S * L]
        self.shape_BT = tuple(starts_BT.shape)

    def worth_it(self) -> bool:
        num_tokens = self.flat_index_T.numel()
        return self.num_samples * self.longest**2 * 2 <= num_tokens**2

    def pad(self, x_BTNH: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[B, T, N, H] (or [B, T]) packed -> [S, L, N, H] padded with `fill`."""
        flat_TNH = x_BTNH.reshape(-1, *x_BTNH.shape[2:])
        out = flat_TNH.new_full((self.num_samples * self.longest, *flat_TNH.shape[1:]), fill)
        out = out.index_copy(0, self.flat_index_T, flat_TNH)
        return out.view(self.num_samples, self.longest, *flat_TNH.shape[1:])

    def unpad(self, x_SLNH: torch.Tensor) -> torch.Tensor:
        flat = x_SLNH.reshape(-1, *x_SLNH.shape[2:]).index_select(0, self.flat_index_T)
        return flat.view(*self.shape_BT, *x_SLNH.shape[2:])


def shared_prefix_mask(branches_SL: torch.Tensor) -> torch.Tensor:
    """The boolean mask [S, 1, L, L] of padded shared-prefix documents (True = may attend).

    `branches_SL` holds 0 for trunk tokens, b >= 1 for branch b's and -1 for padding (which sits
    after every real token). A query attends to earlier trunk tokens and to earlier tokens of its
    own branch; the diagonal is always allowed, so no row (padding included) is empty.
    """
    length = branches_SL.shape[1]
    causal_LL = torch.ones(length, length, dtype=torch.bool, device=branches_SL.device).tril()
    key_S1L, query_SL1 = branches_SL[:, None, :], branches_SL[:, :, None]
    allowed_SLL = causal_LL & ((key_S1L == 0) | (key_S1L == query_SL1))
    return (allowed_SLL | torch.eye(length, dtype=torch.bool, device=branches_SL.device))[:, None]


def grouped_matmul_attention(q_SNLH: torch.Tensor, k_SKLH: torch.Tensor, v_SKLH: torch.Tensor,
                             mask_S1LL: torch.Tensor | None) -> torch.Tensor:
    """Attention as two batched matmuls with the scores and softmax in fp32, differentiable.

    The R = N / K query heads that share a kv head are one batch entry's rows, so the kv heads are
    never expanded. With `mask_S1LL` None the attention is causal. For bf16 training on a CPU:
    forward and backward of SmolLM2's heads over 32 padded samples of 75 tokens take 19 ms here
    where SDPA's CPU kernel takes 75 (its backward is the slow part); in fp32 SDPA is the faster.
    """
    num_samples, num_heads, length, head_dim = q_SNLH.shape
    num_kv_heads = k_SKLH.shape[1]
    group = num_heads // num_kv_heads
    if mask_S1LL is None:
        mask_S1LL = torch.ones(length, length, dtype=torch.bool, device=q_SNLH.device).tril()[None, None]
    q_SKYH = q_SNLH.reshape(num_samples, num_kv_heads, group * length, head_dim)  # Y = (head in group, query)
    scores_SKRLL = torch.matmul(q_SKYH, k_SKLH.transpose(-1, -2)).float().view(
        num_samples, num_kv_heads, group, length, length)
    scores_SKRLL = (scores_SKRLL * head_dim ** -0.5).masked_fill(~mask_S1LL[:, :, None], float("-inf"))
    probs_SKYL = torch.softmax(scores_SKRLL, dim=-1).to(q_SNLH.dtype).view(
        num_samples, num_kv_heads, group * length, length)
    return torch.matmul(probs_SKYL, v_SKLH).view(num_samples, num_heads, length, head_dim)


def _cpu_low_precision(x: torch.Tensor) -> bool:
    """True where attention over `x` computes in bf16/fp16 on a CPU (its dtype, or autocast's)."""
    if x.device.type != "cpu":
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") != torch.float32
    return x.dtype != torch.float32


def expand_kv(x_BSKH: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat each kv head for its group of query heads (query head n reads kv head n // group)."""
    num_kv_heads = x_BSKH.shape[2]
    if num_kv_heads == num_heads:
        return x_BSKH
    return x_BSKH.repeat_interleave(num_heads // num_kv_heads, dim=2)


class DenseCausalAttention:
    """Causal attention over the call's own tokens, block-diagonal where rows are packed.

    A row that is one sample uses SDPA's built-in causal path; packed rows build the mask from
    `positions_BT` (see the module docstring). The mask is built once per forward: every layer
    gets the same positions tensor, so the last one's mask is kept.

    `batch_invariant=True` (true on-policy mode) attends each sample on its own with
    `kernels.batch_invariant.attention`, whose result for a query does not depend on the rest of
    the call; a sample must then start at position 0 to line up with the engine's KV cache.

    `branches_BT` (int64, one row) lays the row out as shared-prefix documents (module docstring):
    each document is padded to the longest and attends under `shared_prefix_mask`.
    """

    def __init__(self, *, batch_invariant: bool = False, branches_BT: torch.Tensor | None = None) -> None:
        if branches_BT is not None and (batch_invariant or branches_BT.dim() != 2 or branches_BT.shape[0] != 1):
            raise ValueError("shared prefixes (branches_BT) need one packed row [1, T] and batch_invariant=False")
        self.batch_invariant = batch_invariant
        self.branches_BT = branches_BT
        self._positions_BT: torch.Tensor | None = None
        self._mask_B1TT: torch.Tensor | None = None
        self._padded: PaddedLayout | None = None

    def mask_for(self, positions_BT: torch.Tensor) -> torch.Tensor | None:
        if positions_BT is not self._positions_BT:
            self._positions_BT, self._mask_B1TT, self._padded = positions_BT, None, None
            if self.branches_BT is not None:
                if self.branches_BT.shape != positions_BT.shape:
                    raise ValueError(f"branches shape {tuple(self.branches_BT.shape)} must equal positions shape "
                                     f"{tuple(positions_BT.shape)}")
                branches_BT = self.branches_BT.to(positions_BT.device)
                self._padded = PaddedLayout(sample_starts(positions_BT) & (branches_BT == 0))
                self._mask_B1TT = shared_prefix_mask(self._padded.pad(branches_BT, fill=-1))
                return self._mask_B1TT
            layout = PaddedLayout(sample_starts(positions_BT)) if positions_BT.shape[0] == 1 else None
            if layout is not None and layout.num_samples > 1 and layout.worth_it():
                self._padded = layout
            else:
                self._mask_B1TT = packed_causal_mask(positions_BT)
        return self._mask_B1TT

    def __call__(
        self,
        layer_idx: int,
        q_BTNH: torch.Tensor,
        k_BTKH: torch.Tensor,
        v_BTKH: torch.Tensor,
        positions_BT: torch.Tensor,
    ) -> torch.Tensor:
        if self.batch_invariant:
            return batch_invariant.packed_causal_attention(q_BTNH, k_BTKH, v_BTKH, sample_starts(positions_BT))
        num_heads = q_BTNH.shape[2]
        mask_B1TT = self.mask_for(positions_BT)
        if self._padded is not None and _cpu_low_precision(q_BTNH):
            layout = self._padded
            out_SNLH = grouped_matmul_attention(layout.pad(q_BTNH).transpose(1, 2), layout.pad(k_BTKH).transpose(1, 2),
                                                layout.pad(v_BTKH).transpose(1, 2), mask_B1TT)
            return layout.unpad(out_SNLH.transpose(1, 2))
        k_BTNH, v_BTNH = expand_kv(k_BTKH, num_heads), expand_kv(v_BTKH, num_heads)
        if self._padded is not None:  # pad samples (or documents) instead of masking T x T
            layout = self._padded
            out_SNLH = F.scaled_dot_product_attention(
                layout.pad(q_BTNH).transpose(1, 2), layout.pad(k_BTNH).transpose(1, 2),
                layout.pad(v_BTNH).transpose(1, 2), attn_mask=mask_B1TT, is_causal=mask_B1TT is None)
            return layout.unpad(out_SNLH.transpose(1, 2))
        out_BNTH = F.scaled_dot_product_attention(
            q_BTNH.transpose(1, 2),
            k_BTNH.transpose(1, 2),
            v_BTNH.transpose(1, 2),
            attn_mask=mask_B1TT,
            is_causal=mask_B1TT is None,
        )
        return out_BNTH.transpose(1, 2)
