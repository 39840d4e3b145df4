"""The engine's attention backend: write new keys/values into KV blocks, attend over the cache.

One engine step runs the model once on a single packed row that holds every scheduled request's
new tokens (a decoding request's one token, a prefilling request's prompt chunk), each at its
absolute position. `build_plan` turns the step's schedule into index tensors once; then, in
every layer, `PagedAttention`
  1. writes the new k/v into their slots (one `index_copy_` each; the fused kernel below does it
     in its own call),
  2. on a CPU whose fused kernels built (miles_async/kernels/cpu_kernels.py; `build_plan(per_token=True)`):
     attends every query of the step in one kernel call, each token a row of its own that reads
     its request's first position + 1 keys and values in place through the block table: causal
     without a mask, nothing gathered, nothing padded, decoding and prefilling alike;
  3. elsewhere, for each group of requests: gathers the group's keys and values into a padded
     [K, G, S] layout with one `index_select` into a reused buffer (the blocks are kv-head major,
     kv_cache.py, so each kv head's keys come out contiguous) and attends with a causal mask
     built from positions (query at position p sees keys 0..p): on a CPU, decoding groups and
     bf16 chunks of up to `MATMUL_MAX_QUERIES` queries by two batched matmuls
     (`matmul_attention`), the rest by one `scaled_dot_product_attention` call; then writes the
     group's outputs back to their packed rows.

The fused kernel against the gathered path, measured here (SmolLM2's 9 query and 3 kv heads,
bf16, one thread, caches flushed before each call, the KV writes included; one layer): a prompt
chunk of 12 x 86 tokens 2.7 ms against 7.6, one 1024-token prompt 14 against 34, 64 decoding
requests x 80 positions 0.44 against 1.1, one 0.09 against 0.30. Over a whole workload (SmolLM2,
`bench engine`'s 64 requests, bf16, one thread) the kernel's prompt steps took 3.7-3.9 s where
the gathered path's took 4.5-6.1 s. Its scores stay in float32, where `matmul_attention` rounds
them to bf16.

Why matmuls on the gathered path: torch 2.13's SDPA CPU kernel is slow for one query per row,
in bf16 most of all. Measured here (one core, SmolLM2's 9 query and 3 kv heads, 64 requests x 80
positions, per layer): SDPA 3.7 ms in bf16 and 0.58 ms in fp32, the two matmuls 0.29 ms in bf16;
SmolLM2's whole decode step at batch 64 in bf16 went from 215 ms to 82 ms with the head-major
blocks and bf16 KV. Tried and dropped: inductor (`torch.compile`) of gather + attention in one
function, 18 ms against 12 ms eager for 256 requests x 320 positions of the bench model.

Why groups, not one call, on the gathered path: the padded layout costs memory traffic in
proportion to G x S_max, and on CPU that traffic is the step's main cost (measured here:
gathering 128 requests x 256 positions of a 4-head, 64-dim layer takes ~1.4 ms into a reused
buffer, ~10 ms into a fresh one). So decoding requests (one query each) are bucketed by length,
a bucket closing when the next request is much shorter, and prefill chunks (many queries each)
form their own group; a step with requests of similar lengths runs one call per layer.

Device: the plan's index tensors and masks are made on the KV cache's device (`build_plan`'s
`device`), and nothing in a step reads a tensor back to the host, so on a GPU a layer's attention
queues kernels without waiting for them.

Tensor names (STYLE rule 10): T packed tokens of the step, G requests in a group, Q queries per
request (padded), S key positions (padded to whole blocks), N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_async.engine.kv_cache import KVCache
from miles_async.kernels import batch_invariant, cpu_kernels

# A decode bucket closes when the next (shorter) request would waste more than this fraction of
# the bucket's padded positions, unless the bucket is still small (a call costs ~50 us itself).
MAX_PADDING_FRACTION = 0.35
MIN_BUCKET_POSITIONS = 2048
# bf16 on a CPU: groups with up to this many queries per request attend with `matmul_attention`
# (one thread, SmolLM2's heads, 16 requests x 64 queries x 64 positions: 1.2 ms against SDPA's
# 2.6; 8 x 128 x 128: 2.0 against 4.6; one 1024-token chunk: 35 ms against SDPA's 29).
MATMUL_MAX_QUERIES = 256


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) over its block table."""

    block_table: Sequence[int]
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    q_index_GQ: torch.Tensor  # packed row of each query (padding repeats a valid row)
    blocks_F: torch.Tensor  # flattened [G, S / block_size] block table
    mask_G1QS: torch.Tensor  # additive: 0 where the query sees the key, -inf elsewhere
    # (group row, query) of each real query, row-major (None: all are real). Indices, not a
    # boolean mask: indexing by a mask counts its True entries first, a read back to the host.
    valid_GV: tuple[torch.Tensor, torch.Tensor] | None
    out_index_V: torch.Tensor  # packed rows of the real queries, in valid_GV order
    num_positions: int  # S
    q_pos_GQ: torch.Tensor  # each query's position (padding at 0), for the batch-invariant kernel


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Every query of the step as a row of its own, for the fused CPU kernel: packed row t
    attends to the first `lengths_T[t]` (its position + 1) keys of its request, through the
    request's block table, row t of `tables_TW` (padded with block 0 to the widest)."""

    rows_T: torch.Tensor  # 0..T-1: the query rows and the output rows
    tables_TW: torch.Tensor
    lengths_T: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepPlan:
    positions_T: torch.Tensor
    write_slots_T: torch.Tensor
    groups: tuple[AttentionGroup, ...]  # empty when `tokens` is set
    last_rows: list[int]  # packed row of each chunk's last token
    tokens: TokenRows | None = None  # set by build_plan(per_token=True)


def build_plan(chunks: Sequence[ScheduledChunk], block_size: int,
               device: torch.device | str = "cpu", *, per_token: bool = False) -> StepPlan:
    """Index tensors for one step, on `device` (the KV cache's); chunks are packed in the order given.

    `per_token=True` (a CPU engine whose fused kernels built) plans one row per query token for
    `cpu_kernels.paged_attention`, decoding and prefilling alike; otherwise the queries go in
    padded groups."""
    positions: list[int] = []
    slots: list[int] = []
    offsets: list[int] = []
    for chunk in chunks:
        offsets.append(len(positions))
        for p in range(chunk.start, chunk.start + chunk.num_tokens):
            positions.append(p)
            slots.append(chunk.block_table[p // block_size] * block_size + p % block_size)
    positions_T = torch.tensor(positions, dtype=torch.long, device=device)
    last_rows = [offsets[i] + c.num_tokens - 1 for i, c in enumerate(chunks)]
    write_slots_T = torch.tensor(slots, dtype=torch.long, device=device)
    if per_token:
        return StepPlan(positions_T=positions_T, write_slots_T=write_slots_T, groups=(), last_rows=last_rows,
                        tokens=_token_rows(chunks, positions_T, block_size, device))
    decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    groups = [_group(chunks, offsets, rows, block_size, device)
              for rows in _decode_buckets(chunks, decode, block_size)]
    if prefill:
        groups.append(_group(chunks, offsets, prefill, block_size, device))
    return StepPlan(positions_T=positions_T, write_slots_T=write_slots_T, groups=tuple(groups), last_rows=last_rows)


def _token_rows(chunks: Sequence[ScheduledChunk], positions_T: torch.Tensor, block_size: int,
                device: torch.device | str) -> TokenRows:
    width = max(-(-(c.start + c.num_tokens) // block_size) for c in chunks)
    tables = [list(c.block_table[:width]) + [0] * (width - min(width, len(c.block_table))) for c in chunks]
    counts = torch.tensor([c.num_tokens for c in chunks], device=device)
    tables_TW = torch.tensor(tables, dtype=torch.long, device=device).repeat_interleave(counts, dim=0)
    return TokenRows(rows_T=torch.arange(positions_T.numel(), device=device), tables_TW=tables_TW,
                     lengths_T=positions_T + 1)


def _decode_buckets(chunks: Sequence[ScheduledChunk], rows: list[int], block_size: int) -> list[list[int]]:
    def padded_len(i: int) -> int:
        return -(-(chunks[i].start + 1) // block_size) * block_size

    ordered = sorted(rows, key=padded_len, reverse=True)
    buckets: list[list[int]] = []
    used = 0
    for i in ordered:
        if buckets:
            bucket = buckets[-1]
            width = padded_len(bucket[0])
            padded = width * (len(bucket) + 1)
            if padded < MIN_BUCKET_POSITIONS or used + padded_len(i) >= (1 - MAX_PADDING_FRACTION) * padded:
                bucket.append(i)
                used += padded_len(i)
                continue
        buckets.append([i])
        used = padded_len(i)
    return buckets


def _group(chunks: Sequence[ScheduledChunk], offsets: list[int], rows: list[int], block_size: int,
           device: torch.device | str) -> AttentionGroup:
    num_queries = max(chunks[i].num_tokens for i in rows)
    num_blocks = max(-(-(chunks[i].start + chunks[i].num_tokens) // block_size) for i in rows)
    q_index, q_pos, blocks = [], [], []
    valid_g, valid_q, out_index = [], [], []  # the real queries: group row, query, packed row
    for g, i in enumerate(rows):
        chunk = chunks[i]
        n = chunk.num_tokens
        q_index.append([offsets[i] + min(j, n - 1) for j in range(num_queries)])
        # A padded query stands at position 0 so its row of the mask is not all -inf (NaN).
        q_pos.append([chunk.start + j if j < n else 0 for j in range(num_queries)])
        valid_g.extend([g] * n)
        valid_q.extend(range(n))
        out_index.extend(range(offsets[i], offsets[i] + n))
        table = list(chunk.block_table[: -(-(chunk.start + n) // block_size)])
        blocks.extend(table + [0] * (num_blocks - len(table)))  # padding blocks are masked out
    q_pos_GQ = torch.tensor(q_pos, dtype=torch.long, device=device)
    num_positions = num_blocks * block_size
    sees_GQS = torch.arange(num_positions, device=device)[None, None, :] <= q_pos_GQ[:, :, None]
    mask_G1QS = torch.zeros(sees_GQS.shape, dtype=torch.float32, device=device).masked_fill_(
        ~sees_GQS, float("-inf"))[:, None]
    all_valid = len(out_index) == len(rows) * num_queries
    return AttentionGroup(
        q_index_GQ=torch.tensor(q_index, dtype=torch.long, device=device),
        blocks_F=torch.tensor(blocks, dtype=torch.long, device=device),
        mask_G1QS=mask_G1QS,
        valid_GV=None if all_valid else (torch.tensor(valid_g, dtype=torch.long, device=device),
                                         torch.tensor(valid_q, dtype=torch.long, device=device)),
        out_index_V=torch.tensor(out_index, dtype=torch.long, device=device),
        num_positions=num_positions,
        q_pos_GQ=q_pos_GQ,
    )


class PagedAttention:
    """`AttentionBackend` (miles_async.models.attention) over the engine's KV blocks, for one step.

    The model calls it once per layer with the packed row's q/k/v (rotary applied); batch size is
    1. The gather buffers are the engine's, reused from step to step. A plan with `tokens` (a CPU
    engine whose fused kernels built) attends in one kernel call that reads the blocks in place,
    through the block tables: no gather. `batch_invariant=True`
    (true on-policy mode) attends with `kernels.batch_invariant.attention` instead of SDPA: the
    gathered layout already holds each key at its position, as that kernel wants.
    """

    def __init__(self, cache: KVCache, plan: StepPlan, workspace: GatherWorkspace, *,
                 batch_invariant: bool = False) -> None:
        self._cache = cache
        self._plan = plan
        self._workspace = workspace
        self._batch_invariant = batch_invariant

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor,
                 positions_BT: torch.Tensor) -> torch.Tensor:
        assert q_BTNH.shape[0] == 1, "the engine packs each step into one row"
        q_TNH, k_TKH, v_TKH = q_BTNH[0], k_BTKH[0], v_BTKH[0]
        k_blocks, v_blocks = self._cache.k_blocks[layer_idx], self._cache.v_blocks[layer_idx]
        num_kv_heads, head_dim = k_blocks.shape[0], k_blocks.shape[3]
        slots = self._plan.write_slots_T
        out_TNH = torch.empty_like(q_TNH)
        tokens = self._plan.tokens
        if tokens is not None:  # the fused CPU kernel: the KV write and every query in one call, in place
            cpu_kernels.paged_attention(q_TNH, tokens.rows_T, k_blocks, v_blocks, tokens.tables_TW, tokens.lengths_T,
                                        out_TNH, tokens.rows_T, head_dim ** -0.5, new_kv=(k_TKH, v_TKH, slots))
            return out_TNH[None]
        k_blocks.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k_TKH.transpose(0, 1).to(k_blocks.dtype))
        v_blocks.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v_TKH.transpose(0, 1).to(v_blocks.dtype))
        gqa = q_TNH.shape[1] != num_kv_heads
        for group in self._plan.groups:
            num_rows, num_positions = group.q_index_GQ.shape[0], group.num_positions
            k_KGSH = self._workspace.gather(0, k_blocks, group.blocks_F).view(
                num_kv_heads, num_rows, num_positions, head_dim).to(q_TNH.dtype)
            v_KGSH = self._workspace.gather(1, v_blocks, group.blocks_F).view(
                num_kv_heads, num_rows, num_positions, head_dim).to(q_TNH.dtype)
            q_GQNH = q_TNH[group.q_index_GQ]
            if self._batch_invariant:
                o_GQNH = batch_invariant.attention(q_GQNH.transpose(1, 2), k_KGSH.transpose(0, 1),
                                                   v_KGSH.transpose(0, 1), group.q_pos_GQ).transpose(1, 2)
            elif use_matmul_attention(q_GQNH):
                o_GQNH = matmul_attention(q_GQNH, k_KGSH, v_KGSH, group.mask_G1QS[:, 0])
            else:
                o_GQNH = F.scaled_dot_product_attention(
                    q_GQNH.transpose(1, 2), k_KGSH.transpose(0, 1), v_KGSH.transpose(0, 1),
                    attn_mask=group.mask_G1QS.to(q_GQNH.dtype), enable_gqa=gqa).transpose(1, 2)
            real = o_GQNH.flatten(0, 1) if group.valid_GV is None else o_GQNH[group.valid_GV]
            out_TNH.index_copy_(0, group.out_index_V, real)
        return out_TNH[None]


def use_matmul_attention(q_GQNH: torch.Tensor) -> bool:
    """Whether a gathered group attends with `matmul_attention` rather than SDPA: on a CPU, a
    decoding group (one query per request) in any dtype, and bf16 chunks of up to
    `MATMUL_MAX_QUERIES` queries per request."""
    if q_GQNH.device.type != "cpu":
        return False
    return q_GQNH.shape[1] == 1 or (q_GQNH.dtype == torch.bfloat16 and q_GQNH.shape[1] <= MATMUL_MAX_QUERIES)


def matmul_attention(q_GQNH: torch.Tensor, k_KGSH: torch.Tensor, v_KGSH: torch.Tensor,
                     mask_GQS: torch.Tensor) -> torch.Tensor:
    """Attention as two batched matmuls over the gathered kv-head-major layout, as it lies.

    Batch = (kv head, request): the R = N / K query heads that share a kv head are that batch
    entry's rows (R x Q queries), times its keys (contiguous [S, H]: no copy, no expansion of the
    kv heads); scores scaled and masked in fp32, softmax in fp32, then the probabilities (in q's
    dtype) times the values. In bf16 the scores are rounded to bf16 once, by the matmul, where
    SDPA's CPU kernel keeps them in fp32 (test_engine_bf16 bounds what that costs).
    """
    num_rows, num_queries, num_heads, head_dim = q_GQNH.shape
    num_kv_heads, num_positions = k_KGSH.shape[0], k_KGSH.shape[2]
    group = num_heads // num_kv_heads
    batch = num_kv_heads * num_rows
    q_XYH = q_GQNH.view(num_rows, num_queries, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4).reshape(
        batch, num_queries * group, head_dim)  # X = (kv head, request), Y = (query, head in the group)
    scores_KGQRS = torch.bmm(q_XYH, k_KGSH.reshape(batch, num_positions, head_dim).transpose(1, 2)).float().view(
        num_kv_heads, num_rows, num_queries, group, num_positions)
    scores_KGQRS.mul_(head_dim ** -0.5).add_(mask_GQS[None, :, :, None, :])
    probs_XYS = torch.softmax(scores_KGQRS, dim=-1).to(q_GQNH.dtype).view(batch, num_queries * group, num_positions)
    out_XYH = torch.bmm(probs_XYS, v_KGSH.reshape(batch, num_positions, head_dim))
    return out_XYH.view(num_kv_heads, num_rows, num_queries, group, head_dim).permute(1, 2, 0, 3, 4).reshape(
        num_rows, num_queries, num_heads, head_dim)


class GatherWorkspace:
    """Two reused buffers (keys, values) for the padded per-group gather, on the KV blocks' device.

    Gathering into fresh tensors costs several times more than into a reused buffer here (page
    faults on every large allocation), so the engine keeps these, grown to the largest group seen.
    Bounded by the KV cache itself: a group never gathers more blocks than the cache holds.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, which: int, blocks: torch.Tensor, index_F: torch.Tensor) -> torch.Tensor:
        """Blocks `index_F` of every kv head: [K, F, block_size, H] (blocks: [K, num_blocks, block_size, H])."""
        numel = blocks.shape[0] * index_F.numel() * blocks.shape[2] * blocks.shape[3]
        buffer = self._buffers[which]
        if buffer is None or buffer.numel() < numel or buffer.dtype != blocks.dtype or buffer.device != blocks.device:
            buffer = torch.empty(numel, dtype=blocks.dtype, device=blocks.device)
            self._buffers[which] = buffer
        out = buffer[:numel].view(blocks.shape[0], index_F.numel(), *blocks.shape[2:])
        return torch.index_select(blocks, 1, index_F, out=out)
