"""Planning a train step over ranks, packing samples into rows without padding, and advantages.

A sample is a `miles_async.trajectory.Trajectory` whose `data` holds its token arrays: the whole
token sequence (prompt and response as the engine saw them) with a loss mask over it. Token i is
trained when its mask is 1, scored by the logits at i - 1 (so the first token of a sample is
never trained). Packing concatenates the samples of one micro-batch into a single row whose
positions restart at 0 for each sample, which is what the models' attention reads as a sample
boundary (models/attention.py), and shifts the targets within each sample: the row's position j
holds the target, mask, rollout log-prob and advantage of the token at j + 1 of the same sample.

Shared prefixes (`pack(..., groups=...)`): the samples of one group (a GRPO prompt's n samples)
begin with the same prompt, so their common prefix is run through the model once. The row then
holds one document per group, the common prefix (trunk) and each sample's remaining tokens
(branches, positions continuing the trunk's), which models/attention.py attends exactly as the
samples alone. The per-token arrays (targets, mask, log-probs, advantages) keep the plain
per-sample layout ("slots"); `hidden_rows_T` says which row's hidden state scores each slot's
target (a trunk row scores that position for every sample of the group). A group of 8 samples
with a 40-token prompt and 20-token answers runs 200 rows instead of 480.

Planning (`plan_step`, on the caller's side, from the samples' metadata only) gives each rank its
share of a batch (balanced by tokens), the number of micro-batches every rank runs (the most any
has: FSDP's collectives must pair up), the aggregation denominator of the whole batch, and each
sample's advantage (group-relative over the samples of one prompt), so that a rank receives only
its share and never the whole batch.

Tensor names (STYLE rule 10): T packed tokens of one row (slots, the per-sample layout), R the rows
run through the model (T without shared prefixes).

Try it:
    data = TokenData.build(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -2])
    packed = pack([data], [1.0])                # packed.input_ids_1R == [[1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from miles_async.rl import AdvantageConfig, compute_advantages
from miles_async.trajectory import TokenData, Trajectory


def trained_tokens(sample: Trajectory) -> int:
    """Tokens of `sample` that carry loss (the first token never does: nothing predicts it)."""
    first_generated = sample.num_prompt_tokens == 0 and sample.num_generated_tokens > 0
    return sample.num_generated_tokens - int(first_generated)


def step_denominator(aggregation: str, samples: Sequence[Trajectory]) -> int:
    """The whole step's aggregation denominator (all micro-batches, all ranks), at least 1:
    trained tokens for "token" aggregation, sequences with a trained token otherwise (what
    `rl.aggregation_denominator` gives, summed)."""
    trained = [trained_tokens(s) for s in samples]
    if aggregation == "token":
        return max(sum(trained), 1)
    return max(sum(1 for n in trained if n > 0), 1)


def assign_to_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balancing tokens: longest first, each to the least-loaded rank.

    Deterministic (ties go to the lower index and the lower rank), so every rank computes the
    same assignment from the same batch; each rank's indices are returned in batch order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for idx in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        per_rank[rank].append(idx)
        loads[rank] += lengths[idx]
    return [sorted(indices) for indices in per_rank]


def split_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of indices whose lengths sum to at most `max_tokens`.

    A sample longer than `max_tokens` gets a micro-batch of its own (it cannot be split without
    cutting its attention). No samples give no micro-batches.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for idx, length in enumerate(lengths):
        if current and used + length > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(idx)
        used += length
    if current:
        groups.append(current)
    return groups


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How one batch is trained: sample indices per rank, micro-batches per rank, the batch's
    aggregation denominator and one advantage per sample."""

    per_rank: list[list[int]]
    num_micro_batches: int
    denominator: float
    advantages: list[float]


def plan_step(samples: Sequence[Trajectory], world_size: int, max_tokens: int, aggregation: str,
              advantage: AdvantageConfig | None) -> StepPlan:
    """Plan a step from the samples' metadata (module docstring); `advantage` None gives zeros
    (SFT, or advantages the caller sets itself)."""
    if not samples:
        raise ValueError("a train step needs at least one sample")
    lengths = [s.num_tokens for s in samples]
    per_rank = assign_to_ranks(lengths, world_size)
    num_micro = max(1, max(len(split_micro_batches([lengths[i] for i in idx], max_tokens)) for idx in per_rank))
    advantages = group_advantages(samples, advantage) if advantage is not None else [0.0] * len(samples)
    return StepPlan(per_rank=per_rank, num_micro_batches=num_micro,
                    denominator=float(step_denominator(aggregation, samples)), advantages=advantages)


def micro_batches(samples: Sequence[Trajectory], max_tokens: int, count: int) -> list[list[int]]:
    """This rank's micro-batches (indices into `samples`), padded with empty ones to `count`."""
    groups = split_micro_batches([s.num_tokens for s in samples], max_tokens)
    if len(groups) > count:
        raise ValueError(f"this rank's share needs {len(groups)} micro-batches but the plan says {count}: "
                         "plan the step with the same micro_batch_tokens as the trainer's")
    return groups + [[] for _ in range(count - len(groups))]


def group_advantages(samples: Sequence[Trajectory], config: AdvantageConfig) -> list[float]:
    """One advantage per sample, from the rewards of its group (the samples of one prompt attempt).

    Every group needs the same number of samples (GRPO's n per prompt). Scaled by
    `config.reward_coef` (0: all zero). An unscored sample (`scored` False: its environment gave
    no reward) gets 0 and is left out of its group's baseline, which its scored samples make
    alone (a group with fewer than two scored samples has none: all 0).
    """
    if config.reward_coef == 0:
        return [0.0] * len(samples)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault((sample.prompt_id, sample.attempt), []).append(i)
    sizes = sorted({len(members) for members in groups.values()})
    if len(sizes) != 1:
        raise ValueError(f"every group needs the same number of samples for advantages, got sizes {sizes}")
    out = [0.0] * len(samples)
    if all(s.scored for s in samples):  # the usual case: every group at once
        members_GS = list(groups.values())
        rewards_GS = torch.tensor([[samples[i].reward for i in m] for m in members_GS], dtype=torch.float64)
        advantages_GS = compute_advantages(rewards_GS, config)
        for g, members in enumerate(members_GS):
            for s, i in enumerate(members):
                out[i] = float(advantages_GS[g, s]) * config.reward_coef
        return out
    for members in groups.values():
        scored = [i for i in members if samples[i].scored]
        if len(scored) < 2:
            continue
        advantages_1S = compute_advantages(torch.tensor([[samples[i].reward for i in scored]], dtype=torch.float64),
                                           config)
        for s, i in enumerate(scored):
            out[i] = float(advantages_1S[0, s]) * config.reward_coef
    return out


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as a single packed row, targets already shifted within each sample.

    The model runs `input_ids_1R` at `positions_1R` (the samples one after another, or with shared
    prefixes the documents that `branches_1R` describes); the [T] arrays are per sample (slots).
    """

    input_ids_1R: torch.Tensor  # int64
    positions_1R: torch.Tensor  # int64, restarting at 0 per sample (per document when shared)
    targets_T: torch.Tensor  # int64, the next token of the same sample (0 at each sample's end)
    loss_mask_T: torch.Tensor  # float32, 1.0 where the target is trained
    rollout_logprobs_T: torch.Tensor  # float32, the engine's log-prob of each target
    advantages_T: torch.Tensor  # float32, the target's sample's advantage
    sample_T: torch.Tensor  # int64, which sample of the micro-batch the slot belongs to
    num_samples: int
    routed_experts_L1Tk: torch.Tensor | None = None  # int64, experts to replay (R3), or None
    ref_logprobs_T: torch.Tensor | None = None  # float32, a reference policy's log-prob of each target
    teacher_logprobs_T: torch.Tensor | None = None  # float32, a distillation teacher's log-prob of each target
    branches_1R: torch.Tensor | None = None  # int64, 0 trunk, b >= 1 branch b (None: no shared prefix)
    hidden_rows_T: torch.Tensor | None = None  # int64, the row scoring each slot (None: row = slot)

    @property
    def num_tokens(self) -> int:
        """Rows the model runs (fewer than the samples' tokens when prefixes are shared)."""
        return int(self.input_ids_1R.shape[1])


def _shifted(values_T: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per sample, values[1:] then a 0 (what position j reads about token j + 1), on the packed
    row at once: shift the whole row by one, then zero each sample's last position (`ends`: one
    past each sample's last index)."""
    out_T = np.empty_like(values_T)
    out_T[:-1] = values_T[1:]
    out_T[ends - 1] = 0
    return out_T


def pack(samples: Sequence[TokenData], advantages: Sequence[float],
         moe_shape: tuple[int, int] | None = None, groups: Sequence[Hashable] | None = None) -> PackedBatch:
    """Pack `samples` (with one advantage each) into one row (see the module docstring).

    `moe_shape` is (MoE layers, top_k) of the model; with it, samples that carry routed experts
    are packed into `routed_experts_L1Tk` (all samples or none must carry them).
    `groups` (one key per sample, e.g. (prompt_id, attempt)) shares the common prefix of the
    samples with the same key; not with routed experts, whose replay is per sample.
    No samples give a one-token row with nothing trained: a rank with fewer micro-batches than
    the others runs it so that every rank makes the same FSDP collectives.
    """
    if len(advantages) != len(samples):
        raise ValueError(f"pack got {len(advantages)} advantages for {len(samples)} samples")
    if groups is not None and len(groups) != len(samples):
        raise ValueError(f"pack got {len(groups)} group keys for {len(samples)} samples")
    if not samples:
        zeros, zero_ids = torch.zeros(1), torch.zeros(1, dtype=torch.int64)
        return PackedBatch(zero_ids[None], zero_ids[None].clone(), zero_ids.clone(), zeros, zeros.clone(),
                           zeros.clone(), zero_ids.clone(), 0)
    for sample in samples:
        sample.check()
    lengths = np.fromiter((s.num_tokens for s in samples), dtype=np.int64, count=len(samples))
    ends = np.cumsum(lengths)
    ids_T = np.frombuffer(b"".join(s.tokens for s in samples), dtype="<i4")
    positions_T = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)
    targets_T = _shifted(ids_T, ends)
    mask_T = _shifted(np.frombuffer(b"".join(s.loss_mask for s in samples), dtype=np.uint8), ends).astype(np.float32)
    rollout_T = _shifted(np.frombuffer(b"".join(s.logprobs for s in samples), dtype="<f4"), ends)
    advantages_T = np.repeat(np.asarray(advantages, dtype=np.float32), lengths)
    experts = _pack_experts(samples, moe_shape)
    shared = _share_prefixes(samples, groups) if groups is not None and experts is None else None
    if shared is None:
        rows_R, row_positions_R, branches, hidden_rows = ids_T, positions_T, None, None
    else:
        rows_R, row_positions_R, branches_R, hidden_rows_T = shared
        branches, hidden_rows = torch.from_numpy(branches_R)[None], torch.from_numpy(hidden_rows_T)
    return PackedBatch(
        input_ids_1R=torch.from_numpy(rows_R.astype(np.int64)).unsqueeze(0),
        positions_1R=torch.from_numpy(row_positions_R.astype(np.int64)).unsqueeze(0),
        targets_T=torch.from_numpy(targets_T.astype(np.int64)),
        loss_mask_T=torch.from_numpy(mask_T),
        rollout_logprobs_T=torch.from_numpy(rollout_T.astype(np.float32)),
        advantages_T=torch.from_numpy(advantages_T),
        sample_T=torch.from_numpy(np.repeat(np.arange(len(samples), dtype=np.int64), lengths)),
        num_samples=len(samples),
        routed_experts_L1Tk=experts,
        ref_logprobs_T=_pack_per_token(samples, "ref_logprobs", "the KL term"),
        teacher_logprobs_T=_pack_per_token(samples, "teacher_logprobs", "distillation"),
        branches_1R=branches,
        hidden_rows_T=hidden_rows,
    )


def common_prefix_length(arrays: Sequence[np.ndarray]) -> int:
    """Length of the longest prefix every array starts with."""
    common = len(arrays[0])
    for other in arrays[1:]:
        n = min(common, len(other))
        differs = np.flatnonzero(arrays[0][:n] != other[:n])
        common = int(differs[0]) if len(differs) else n
    return common


def _share_prefixes(samples: Sequence[TokenData], groups: Sequence[Hashable],
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(row ids, row positions, branches, hidden row per slot) with each group's common prefix
    once, or None when no group shares a token (the plain layout is the same thing)."""
    tokens = [np.frombuffer(s.tokens, dtype="<i4") for s in samples]
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    docs: list[tuple[list[int], int]] = []  # (members, trunk length); a lone sample is all trunk
    for m in members.values():
        trunk = common_prefix_length([tokens[i] for i in m])
        docs += [([i], len(tokens[i])) for i in m] if trunk == 0 else [(m, trunk)]
    if len(docs) == len(samples):  # nothing shared: the plain layout is the same thing
        return None
    ids, positions, branches = [], [], []
    hidden_rows = [np.empty(0, dtype=np.int64)] * len(samples)
    row = 0
    for m, trunk in docs:
        ids.append(tokens[m[0]][:trunk])
        positions.append(np.arange(trunk))
        branches.append(np.zeros(trunk, dtype=np.int64))
        trunk_row, row = row, row + trunk
        for b, i in enumerate(m, start=1):
            n = len(tokens[i])
            ids.append(tokens[i][trunk:])
            positions.append(np.arange(trunk, n))
            branches.append(np.full(n - trunk, b, dtype=np.int64))
            offsets = np.arange(n)
            hidden_rows[i] = np.where(offsets < trunk, trunk_row + offsets, row - trunk + offsets)
            row += n - trunk
    return (np.concatenate(ids), np.concatenate(positions), np.concatenate(branches),
            np.concatenate(hidden_rows).astype(np.int64))


def _pack_per_token(samples: Sequence[TokenData], field: str, needed_by: str) -> torch.Tensor | None:
    """An optional float32 per-token field (`ref_logprobs`, `teacher_logprobs`) shifted like the
    rollout's log-probs; None when no sample carries it."""
    arrays = [np.frombuffer(getattr(s, field), dtype="<f4") if getattr(s, field) else None for s in samples]
    carrying = sum(1 for a in arrays if a is not None)
    if carrying == 0:
        return None
    if carrying != len(samples):
        raise ValueError(f"{carrying} of {len(samples)} samples carry {field}; {needed_by} needs all or none")
    ends = np.cumsum([s.num_tokens for s in samples])
    return torch.from_numpy(_shifted(np.concatenate([a for a in arrays if a is not None]), ends).astype(np.float32))


def _pack_experts(samples: Sequence[TokenData], moe_shape: tuple[int, int] | None) -> torch.Tensor | None:
    carrying = sum(1 for s in samples if s.routed_experts)
    if carrying == 0 or moe_shape is None:
        return None
    if carrying != len(samples):
        raise ValueError(f"{carrying} of {len(samples)} samples carry routed_experts; replay (R3) needs all or none")
    num_layers, top_k = moe_shape
    parts = []
    for sample in samples:
        experts_RLk = sample.experts()
        assert experts_RLk is not None
        length = sample.num_tokens
        if tuple(experts_RLk.shape[1:]) != (num_layers, top_k):
            raise ValueError(f"routed_experts are [{experts_RLk.shape[0]}, {experts_RLk.shape[1]}, {experts_RLk.shape[2]}]; "
                             f"the model has {num_layers} MoE layers and top_k {top_k}")
        experts_TLk = torch.from_numpy(experts_RLk.astype(np.int64))
        if experts_TLk.shape[0] < length:
            # The last token was never forwarded by the engine; its experts change only its own
            # logits, which train nothing, so any valid ids do (repeat the previous token's).
            experts_TLk = torch.cat([experts_TLk, experts_TLk[-1:] if len(experts_TLk) else
                                     torch.arange(top_k).expand(1, num_layers, top_k)])
        parts.append(experts_TLk)
    return torch.cat(parts).permute(1, 0, 2).unsqueeze(1).contiguous()
