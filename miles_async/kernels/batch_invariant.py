"""Batch-invariant forward ops: a row's result does not depend on what else shares the call.

True on-policy RL needs the trainer's log-probs to equal the engine's bit for bit, although the
engine sees a token inside a decode batch or a prefill chunk (with whatever else was scheduled
that step) and the trainer sees it inside a packed row of several samples. Plain torch on CPU
does not give that: `F.linear` picks its GEMM kernel by the number of rows, so a row's output
moves (measured on torch 2.13 CPU: up to ~6e-6 on a [M, 64] x [64, 128] linear, 4e-5 on larger
ones) with the batch; SDPA's softmax reduces over however many keys the call holds; `F.silu`
computes the tail of a buffer with a scalar formula and the rest with a vector one, so an
element's value depends on where it falls in the buffer.

What holds here (tests/unit/test_kernels_batch_invariant.py checks each):
- a GEMM of one fixed shape gives every row the same result whatever its position in the
  operand and whatever the other rows hold; so `linear` runs on fixed tiles of `ROW_TILE` rows
  (the last tile zero-padded), and `attention` multiplies fixed [Q_TILE, H] x [H, KEY_TILE] and
  [Q_TILE, KEY_TILE] x [KEY_TILE, H] tiles (bmm over any number of them);
- `exp`, `cos`, `sin` (vectorised, tails by partial loads), add/mul/div, max, a sum over a
  fixed-length last dim, `x.pow(2).mean(-1)` and `log_softmax` over the last dim are row- and
  position-invariant; `silu` is not, so `silu` here is x / (1 + exp(-x)), built from ones that are.

Attention: keys sit at their position (key index = position, from 0) and a query at position p
sees keys 0..p. Keys are visited in tiles of KEY_TILE with an online softmax; a tile wholly past
p leaves the query's running max, sum and output exactly unchanged (its scores are -inf: the max
stays, the rescale factor is exp(0) = 1, the added terms are exact zeros), so a query's result
depends only on its own keys, whatever the number of keys, queries or requests in the call. The
engine's paged layout (keys gathered block by block, index = position) and the trainer's packed
rows (each sample laid out from position 0) both reduce to this.

Tensor names (STYLE rule 10): M rows (leading dims flattened), D in features, F out features,
B rows of attention (requests or samples), N query heads, K kv heads, Q queries, S keys, H head dim,
X tiles in a batched matmul, V vocabulary, T tokens.

Try it:
    x_MD, w_FD = torch.randn(5, 64), torch.randn(128, 64)
    assert torch.equal(linear(x_MD, w_FD)[2:3], linear(x_MD[2:3], w_FD))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 32
Q_TILE = 4
KEY_TILE = 64


def linear(x: torch.Tensor, weight_FD: torch.Tensor, bias_F: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` computed on fixed tiles of ROW_TILE rows, so each row's output is batch-invariant."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    x_MD = x.reshape(-1, in_features)
    num_rows = x_MD.shape[0]
    if num_rows == 0:
        return F.linear(x, weight_FD, bias_F)
    pad = -num_rows % ROW_TILE
    if pad:
        x_MD = torch.cat([x_MD, x_MD.new_zeros(pad, in_features)])
    tiles = [F.linear(x_MD[i:i + ROW_TILE], weight_FD, bias_F) for i in range(0, num_rows + pad, ROW_TILE)]
    out_MF = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out_MF[:num_rows].reshape(*lead, weight_FD.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) from position-invariant pieces (torch's fused silu is not; module docstring)."""
    return x / (1 + torch.exp(-x))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 log_softmax of logits / temperature over the last dim (row-invariant as it is)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def token_logprobs(logits_TV: torch.Tensor, targets_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per token, computed exactly as the engine's sampler computes it.

    The engine takes `log_softmax(logits / temperature)` and gathers the sampled token; the
    chunked kernels in `logprobs.py` go through logsumexp instead, which rounds differently.
    """
    return log_softmax(logits_TV, temperature).gather(-1, targets_T[..., None]).squeeze(-1)


def _tiles(x_BNLH: torch.Tensor, tile: int) -> torch.Tensor:
    """[B, N, L, H] zero-padded to whole tiles of L: [B, N, L / tile, tile, H]."""
    batch, heads, length, head_dim = x_BNLH.shape
    pad = -length % tile
    if pad:
        x_BNLH = torch.cat([x_BNLH, x_BNLH.new_zeros(batch, heads, pad, head_dim)], dim=2)
    return x_BNLH.reshape(batch, heads, -1, tile, head_dim)


def _key_tile(x_BNTSH: torch.Tensor, t: int, num_q_tiles: int, rows: torch.Tensor | None) -> torch.Tensor:
    """Key tile t repeated for each query tile: [X, KEY_TILE, H], or only the given X rows."""
    batch, heads, _, tile, head_dim = x_BNTSH.shape
    tile_BNSH = x_BNTSH[:, :, t]
    if rows is not None:
        return tile_BNSH.reshape(batch * heads, tile, head_dim)[rows]
    return tile_BNSH[:, :, None].expand(batch, heads, num_q_tiles, tile, head_dim).reshape(-1, tile, head_dim)


def attention(
    q_BNQH: torch.Tensor,
    k_BKSH: torch.Tensor,
    v_BKSH: torch.Tensor,
    q_positions_BQ: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention by position, batch-invariant per query; returns out_BNQH.

    Key s of row b stands at position s; query q of row b sees the keys at positions
    0..q_positions_BQ[b, q] (at least key 0, so padded queries should stand at position 0).
    K kv heads are expanded to N query heads (query head n reads kv head n // (N / K)).
    """
    batch, num_heads, num_queries, head_dim = q_BNQH.shape
    num_kv_heads = k_BKSH.shape[1]
    if num_kv_heads != num_heads:
        k_BKSH = k_BKSH.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v_BKSH = v_BKSH.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scale = head_dim**-0.5 if scale is None else scale
    q_BNCQH = _tiles(q_BNQH * scale, Q_TILE)  # C query tiles; X = B * N * C tiles in all
    num_q_tiles = q_BNCQH.shape[2]
    q_XQH = q_BNCQH.reshape(-1, Q_TILE, head_dim)
    num_x = q_XQH.shape[0]
    pos_BQ = q_positions_BQ.to(torch.long)
    pad = -num_queries % Q_TILE
    if pad:
        pos_BQ = torch.cat([pos_BQ, pos_BQ.new_zeros(batch, pad)], dim=1)
    pos_XQ = pos_BQ.view(batch, 1, num_q_tiles, Q_TILE).expand(batch, num_heads, num_q_tiles, Q_TILE)
    pos_XQ = pos_XQ.reshape(num_x, Q_TILE)
    last_pos_X = pos_XQ.amax(dim=1)
    row_of_X = torch.arange(num_x, device=q_BNQH.device) // num_q_tiles  # its (b, n) pair
    k_BNTSH, v_BNTSH = _tiles(k_BKSH, KEY_TILE), _tiles(v_BKSH, KEY_TILE)  # T key tiles
    max_X = q_XQH.new_full((num_x, Q_TILE), float("-inf"))
    sum_X = q_XQH.new_zeros(num_x, Q_TILE)
    acc_XQH = q_XQH.new_zeros(num_x, Q_TILE, head_dim)
    key_offsets_S = torch.arange(KEY_TILE, device=q_BNQH.device)
    for t in range(k_BNTSH.shape[2]):
        # A tile wholly past a query tile's positions would leave it exactly unchanged: skip it.
        active_A = (last_pos_X >= t * KEY_TILE).nonzero().squeeze(1)
        if active_A.numel() == 0:
            break
        every = active_A.numel() == num_x
        k_XSH, v_XSH = (_key_tile(x_BNTSH, t, num_q_tiles, None if every else row_of_X[active_A])
                        for x_BNTSH in (k_BNTSH, v_BNTSH))
        q_AQH, pos_AQ = (q_XQH, pos_XQ) if every else (q_XQH[active_A], pos_XQ[active_A])
        max_AQ = max_X if every else max_X[active_A]
        scores_AQS = torch.bmm(q_AQH, k_XSH.transpose(1, 2))
        hidden_AQS = (t * KEY_TILE + key_offsets_S) > pos_AQ[..., None]
        scores_AQS = scores_AQS.masked_fill(hidden_AQS, float("-inf"))
        new_max_AQ = torch.maximum(max_AQ, scores_AQS.amax(dim=-1))
        rescale_AQ = torch.exp(max_AQ - new_max_AQ)
        p_AQS = torch.exp(scores_AQS - new_max_AQ[..., None])
        sum_AQ = (sum_X if every else sum_X[active_A]) * rescale_AQ + p_AQS.sum(dim=-1)
        acc_AQH = (acc_XQH if every else acc_XQH[active_A]) * rescale_AQ[..., None] + torch.bmm(p_AQS, v_XSH)
        if every:
            max_X, sum_X, acc_XQH = new_max_AQ, sum_AQ, acc_AQH
        else:
            max_X = max_X.index_copy(0, active_A, new_max_AQ)
            sum_X = sum_X.index_copy(0, active_A, sum_AQ)
            acc_XQH = acc_XQH.index_copy(0, active_A, acc_AQH)
    out_XQH = acc_XQH / sum_X[..., None]
    out_BNQH = out_XQH.view(batch, num_heads, num_q_tiles * Q_TILE, head_dim)
    return out_BNQH[:, :, :num_queries]


def packed_causal_attention(
    q_BTNH: torch.Tensor, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor, sample_starts_BT: torch.Tensor
) -> torch.Tensor:
    """Block-diagonal causal attention over packed rows, batch-invariant; returns out_BTNH.

    `sample_starts_BT` is True where a sample starts. Each sample is laid out on its own from
    index 0 (so a sample whose positions start at 0 lines up with the engine's cache, key index
    = position) and attended with `attention`.
    """
    batch, num_tokens, num_heads, head_dim = q_BTNH.shape
    flat_starts = sample_starts_BT.clone()
    flat_starts[:, 0] = True
    start_idx = flat_starts.reshape(-1).nonzero().squeeze(1)
    lengths = torch.diff(start_idx, append=start_idx.new_tensor([batch * num_tokens]))
    max_len = int(lengths.max())
    offsets_L = torch.arange(max_len, device=q_BTNH.device)
    valid_SL = offsets_L[None, :] < lengths[:, None]
    # Padding repeats the sample's first token: finite keys, masked out by position anyway.
    index_SL = start_idx[:, None] + torch.where(valid_SL, offsets_L[None, :], 0)
    q_flat, k_flat, v_flat = (t.reshape(batch * num_tokens, t.shape[2], head_dim) for t in (q_BTNH, k_BTKH, v_BTKH))
    q_SNLH = q_flat[index_SL].transpose(1, 2)
    k_SKLH, v_SKLH = k_flat[index_SL].transpose(1, 2), v_flat[index_SL].transpose(1, 2)
    positions_SL = torch.where(valid_SL, offsets_L[None, :], 0)
    out_SLNH = attention(q_SNLH, k_SKLH, v_SKLH, positions_SL).transpose(1, 2)
    out_flat = q_flat.new_zeros(q_flat.shape).index_copy(0, index_SL[valid_SL], out_SLNH[valid_SL])
    return out_flat.view(batch, num_tokens, num_heads, head_dim)
