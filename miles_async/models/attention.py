"""Attention backends: the seam between the models and whoever owns the keys and values.

A model computes q, k and v (RoPE applied, q/k-norm too for Qwen3) and hands them to an
`AttentionBackend`; the backend returns the attended values. The default, `DenseCausalAttention`,
attends over the tokens of the call itself (training, scoring, parity tests); the embedded engine
supplies its own backend that stores k/v in its paged cache and attends over the cached prefix.

Packed rows: a sample's positions are consecutive, so a token whose position is not its left
neighbour's plus one starts a new sample (positions restarting at 0 do), and a token attends only
to earlier tokens of its own sample: the mask is block-diagonal causal.

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
    reads it from a real token; padded rows' outputs are dropped.
    """

    def __init__(self, positions_BT: torch.Tensor) -> None:
        starts = sample_starts(positions_BT).reshape(-1)
        num_tokens = starts.numel()
        sample_T = torch.cumsum(starts.to(torch.int64), 0) - 1
        first_S = torch.nonzero(starts).reshape(-1)
        self.num_samples = first_S.numel()
        device = positions_BT.device
        lengths_S = torch.diff(first_S, append=torch.tensor([num_tokens], device=device))
        self.longest = int(lengths_S.max())
        offset_T = torch.arange(num_tokens, device=device) - first_S[sample_T]
        self.flat_index_T = sample_T * self.longest + offset_T  # token -> slot in [S * L]
        self.shape_BT = tuple(positions_BT.shape)

    def worth_it(self) -> bool:
        num_tokens = self.flat_index_T.numel()
        return self.num_samples * self.longest**2 * 2 <= num_tokens**2

    def pad(self, x_BTNH: torch.Tensor) -> torch.Tensor:
        """[B, T, N, H] packed -> [S, L, N, H] padded with zeros."""
        flat_TNH = x_BTNH.reshape(-1, *x_BTNH.shape[2:])
        out = flat_TNH.new_zeros(self.num_samples * self.longest, *flat_TNH.shape[1:])
        out = out.index_copy(0, self.flat_index_T, flat_TNH)
        return out.view(self.num_samples, self.longest, *flat_TNH.shape[1:])

    def unpad(self, x_SLNH: torch.Tensor) -> torch.Tensor:
        flat = x_SLNH.reshape(-1, *x_SLNH.shape[2:]).index_select(0, self.flat_index_T)
        return flat.view(*self.shape_BT, *x_SLNH.shape[2:])


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
    """

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self._positions_BT: torch.Tensor | None = None
        self._mask_B1TT: torch.Tensor | None = None
        self._padded: PaddedLayout | None = None

    def mask_for(self, positions_BT: torch.Tensor) -> torch.Tensor | None:
        if positions_BT is not self._positions_BT:
            self._positions_BT, self._mask_B1TT, self._padded = positions_BT, None, None
            layout = PaddedLayout(positions_BT) if positions_BT.shape[0] == 1 else None
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
        k_BTNH, v_BTNH = expand_kv(k_BTKH, num_heads), expand_kv(v_BTKH, num_heads)
        mask_B1TT = self.mask_for(positions_BT)
        if self._padded is not None:  # many short packed samples: pad them instead of masking T x T
            layout = self._padded
            out_SNLH = F.scaled_dot_product_attention(
                layout.pad(q_BTNH).transpose(1, 2), layout.pad(k_BTNH).transpose(1, 2),
                layout.pad(v_BTNH).transpose(1, 2), is_causal=True)
            return layout.unpad(out_SNLH.transpose(1, 2))
        out_BNTH = F.scaled_dot_product_attention(
            q_BTNH.transpose(1, 2),
            k_BTNH.transpose(1, 2),
            v_BTNH.transpose(1, 2),
            attn_mask=mask_B1TT,
            is_causal=mask_B1TT is None,
        )
        return out_BNTH.transpose(1, 2)
