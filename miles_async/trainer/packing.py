"""Packing samples into rows without padding, and splitting a batch by ranks and by a token budget.

A sample is its whole token sequence (prompt and response as the engine saw them) with a loss
mask over it: token i is trained when `loss_mask[i]` is 1, scored by the logits at i - 1 (so the
first token of a sample is never trained). Packing concatenates the samples of one micro-batch
into a single row whose positions restart at 0 for each sample, which is what the models'
attention reads as a sample boundary (models/attention.py), and shifts the targets within each
sample: the row's position j holds the target, mask, rollout log-prob and advantage of the
token at j + 1 of the same sample.

Tensor names (STYLE rule 10): T packed tokens of one row.

Try it:
    samples = [TrainSample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0, -1, -2])]
    packed = pack(samples)                     # packed.input_ids_1T == [[1, 2, 3]]
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from miles_async.rl import AdvantageConfig, compute_advantages


class TrainSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One trajectory as the trainer consumes it (plain lists: it rides in messages).

    `rollout_logprobs[i]` is the engine's log-prob of `tokens[i]` (read where the mask is 1).
    `advantage` applies to every trained token of the sample; `reward` is only reported.
    `routed_experts` (MoE, R3) is what the engine recorded: int32 little-endian bytes of shape
    [tokens, MoE layers, top_k] (SGLang's layout), for all tokens or all but the last (which the
    engine never forwarded); empty means the trainer's router chooses.
    `ref_logprobs` (optional) is a reference policy's log-prob of each token, for the KL term;
    empty means none (all samples of a batch carry them or none do).
    `group` numbers the prompt a sample answers: with `TrainerConfig.advantage` set, advantages
    come from the rewards of each group (`with_group_advantages`).
    """

    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantage: float = 0.0
    reward: float = 0.0
    weight_version: int = 0
    routed_experts: bytes = b""
    ref_logprobs: list[float] = []
    group: int = -1  # samples of one prompt share it (group-relative advantages); -1: none

    def check(self) -> None:
        """Raise ValueError naming the field whose length does not match `tokens`."""
        if not self.tokens:
            raise ValueError("a TrainSample needs at least one token, got an empty `tokens`")
        for field in ("loss_mask", "rollout_logprobs"):
            if len(getattr(self, field)) != len(self.tokens):
                raise ValueError(
                    f"TrainSample.{field} has {len(getattr(self, field))} entries for {len(self.tokens)} "
                    "tokens; give one per token (0 where the token is not trained)")
        if self.ref_logprobs and len(self.ref_logprobs) != len(self.tokens):
            raise ValueError(f"TrainSample.ref_logprobs has {len(self.ref_logprobs)} entries for {len(self.tokens)} "
                             "tokens; give one per token, or none")


def num_trained_tokens(sample: TrainSample) -> int:
    """Tokens of `sample` that carry loss (the first token never does: nothing predicts it)."""
    return sum(1 for m in sample.loss_mask[1:] if m)


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


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as a single packed row, targets already shifted within each sample."""

    input_ids_1T: torch.Tensor  # int64
    positions_1T: torch.Tensor  # int64, restarting at 0 per sample
    targets_T: torch.Tensor  # int64, the next token of the same sample (0 at each sample's end)
    loss_mask_T: torch.Tensor  # float32, 1.0 where the target is trained
    rollout_logprobs_T: torch.Tensor  # float32, the engine's log-prob of each target
    advantages_T: torch.Tensor  # float32, the target's sample's advantage
    num_samples: int
    routed_experts_L1Tk: torch.Tensor | None = None  # int64, experts to replay (R3), or None
    ref_logprobs_T: torch.Tensor | None = None  # float32, a reference policy's log-prob of each target

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1T.shape[1])


def pack(samples: list[TrainSample], moe_shape: tuple[int, int] | None = None) -> PackedBatch:
    """Pack `samples` into one row (see the module docstring).

    `moe_shape` is (MoE layers, top_k) of the model; with it, samples that carry
    `routed_experts` are packed into `routed_experts_L1Tk` (all samples or none must carry them).
    No samples give a one-token row with nothing trained: a rank with fewer micro-batches than
    the others runs it so that every rank makes the same FSDP collectives.
    """
    if not samples:
        zeros = torch.zeros(1)
        return PackedBatch(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                           torch.zeros(1, dtype=torch.int64), zeros, zeros.clone(), zeros.clone(), 0)
    ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    mask: list[float] = []
    rollout: list[float] = []
    advantages: list[float] = []
    for sample in samples:
        sample.check()
        length = len(sample.tokens)
        ids.extend(sample.tokens)
        positions.extend(range(length))
        targets.extend(sample.tokens[1:])
        targets.append(0)
        mask.extend(float(m != 0) for m in sample.loss_mask[1:])
        mask.append(0.0)
        rollout.extend(float(x) for x in sample.rollout_logprobs[1:])
        rollout.append(0.0)
        advantages.extend([float(sample.advantage)] * length)
    return PackedBatch(
        input_ids_1T=torch.tensor([ids], dtype=torch.int64),
        positions_1T=torch.tensor([positions], dtype=torch.int64),
        targets_T=torch.tensor(targets, dtype=torch.int64),
        loss_mask_T=torch.tensor(mask, dtype=torch.float32),
        rollout_logprobs_T=torch.tensor(rollout, dtype=torch.float32),
        advantages_T=torch.tensor(advantages, dtype=torch.float32),
        num_samples=len(samples),
        routed_experts_L1Tk=_pack_experts(samples, moe_shape),
        ref_logprobs_T=_pack_ref(samples),
    )


def _pack_ref(samples: list[TrainSample]) -> torch.Tensor | None:
    carrying = sum(1 for s in samples if s.ref_logprobs)
    if carrying == 0:
        return None
    if carrying != len(samples):
        raise ValueError(f"{carrying} of {len(samples)} samples carry ref_logprobs; the KL term needs all or none")
    values: list[float] = []
    for sample in samples:
        values.extend(float(x) for x in sample.ref_logprobs[1:])
        values.append(0.0)
    return torch.tensor(values, dtype=torch.float32)


def _pack_experts(samples: list[TrainSample], moe_shape: tuple[int, int] | None) -> torch.Tensor | None:
    carrying = sum(1 for s in samples if s.routed_experts)
    if carrying == 0 or moe_shape is None:
        return None
    if carrying != len(samples):
        raise ValueError(f"{carrying} of {len(samples)} samples carry routed_experts; replay (R3) needs all or none")
    num_layers, top_k = moe_shape
    parts = []
    for sample in samples:
        flat = torch.frombuffer(bytearray(sample.routed_experts), dtype=torch.int32)
        per_token = num_layers * top_k
        num_rows = flat.numel() // per_token
        length = len(sample.tokens)
        if flat.numel() % per_token or num_rows not in (length, length - 1):
            raise ValueError(
                f"routed_experts holds {flat.numel()} int32 values; expected [tokens ({length}) or tokens - 1, "
                f"MoE layers ({num_layers}), top_k ({top_k})]")
        experts_TLk = flat.view(num_rows, num_layers, top_k).to(torch.int64)
        if num_rows < length:
            # The last token was never forwarded by the engine; its experts change only its own
            # logits, which train nothing, so any valid ids do (repeat the previous token's).
            experts_TLk = torch.cat([experts_TLk, experts_TLk[-1:] if num_rows else
                                     torch.arange(top_k).expand(1, num_layers, top_k)])
        parts.append(experts_TLk)
    return torch.cat(parts).permute(1, 0, 2).unsqueeze(1).contiguous()


def experts_bytes(experts_TLk: torch.Tensor) -> bytes:
    """`TrainSample.routed_experts` from a [tokens, MoE layers, top_k] tensor (the engine's layout)."""
    return experts_TLk.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()


def plan_micro_batches(samples: list[TrainSample], rank: int, world_size: int,
                       max_tokens: int) -> list[list[TrainSample]]:
    """This rank's micro-batches of a global batch, padded with empty ones to the most any rank has.

    Every rank gets the whole batch and computes every rank's plan, so all ranks agree on the
    number of forward/backward passes (FSDP's all-gathers and reduce-scatters must pair up).
    """
    lengths = [len(s.tokens) for s in samples]
    per_rank = assign_to_ranks(lengths, world_size)
    plans = [split_micro_batches([lengths[i] for i in indices], max_tokens) for indices in per_rank]
    num_micro = max(1, max(len(plan) for plan in plans))
    mine = [[samples[per_rank[rank][j]] for j in group] for group in plans[rank]]
    return mine + [[] for _ in range(num_micro - len(mine))]


def with_group_advantages(samples: list[TrainSample], config: AdvantageConfig) -> list[TrainSample]:
    """The samples with `advantage` computed from the rewards of their group (`TrainSample.group`).

    Every sample needs a group and every group the same number of samples (GRPO's n per prompt).
    """
    groups: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        if sample.group < 0:
            raise ValueError(f"sample {i} has no group (TrainSample.group = {sample.group}); group-relative "
                             "advantages need every sample's group, or leave TrainerConfig.advantage unset")
        groups.setdefault(sample.group, []).append(i)
    sizes = sorted({len(members) for members in groups.values()})
    if len(sizes) != 1:
        raise ValueError(f"every group needs the same number of samples for advantages, got sizes {sizes}")
    members_GS = list(groups.values())
    rewards_GS = torch.tensor([[samples[i].reward for i in m] for m in members_GS], dtype=torch.float64)
    advantages_GS = compute_advantages(rewards_GS, config)
    out = list(samples)
    for g, members in enumerate(members_GS):
        for s, i in enumerate(members):
            out[i] = msgspec.structs.replace(samples[i], advantage=float(advantages_GS[g, s]))
    return out
