"""The train step's per-token log-probs and loss: `miles_async.kernels` + `miles_async.rl` on a packed row.

- `attach_logprobs(model)` gives the (FSDP2-sharded) model a second forward method,
  `model.token_logprobs(ids, positions, targets, routed_experts, branches, rows)`, that runs the
  backbone (over shared-prefix documents when `branches` is given, packing.py) and then the
  chunked log-prob kernel on the final hidden states of `rows` and the lm_head weight, so the
  step never holds a full float32 [tokens, vocab] logits tensor, and projects only the rows whose
  targets are trained. It is registered with FSDP2
  (`register_fsdp_forward_method`): the root's parameters (embedding, final norm, lm_head) are
  all-gathered around it and their gradients reduce-scattered after the backward, exactly as for
  `forward`. With `TrainerConfig.compute_dtype = "bfloat16"` the backbone runs under
  torch.autocast (bf16 matmuls over the fp32 weights) and the log-probs are taken in fp32, from
  vocabulary matmuls that on a CPU may take bf16 inputs (`bf16_matmuls`, miles_async/kernels/logprobs.py:
  the hidden states are bf16 values already) but keep fp32 logits.
- `micro_batch_loss` is the loss of one packed micro-batch (`TrainerConfig.objective`): the RL
  policy loss (PPO clip + dual clip, TIS against the rollout log-probs, KL to the reference
  log-probs when the batch carries them, the teacher's reverse KL folded into the advantages
  with `policy_loss.distill_coef`, entropy bonus) or SFT cross-entropy, divided by the
  whole step's denominator, plus the step metrics' sums of this micro-batch (one float64 vector
  in the order of `StepSums`'s fields, so the step makes a single all-reduce).

Tensor names (STYLE rule 10): T packed tokens (per-sample slots), R rows run through the model,
S the scored slots, D hidden, V vocab, K summed metrics.

Try it: see tests/unit/test_trainer_step.py.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles_async.kernels import batch_invariant
from miles_async.kernels.logprobs import token_logprobs_from_hidden
from miles_async.models import CausalLM, DenseCausalAttention
from miles_async.models.draft import draft_loss
from miles_async.rl import MetricSums, metric_parts, policy_loss, sft_loss
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.packing import PackedBatch


class StepSums(MetricSums, frozen=True, kw_only=True):
    """A train step's sums, one float64 vector (summed over micro-batches, all-reduced once; the
    order is the fields', `SumVector`): the rl metric sums, then the step's aggregated loss and
    its parts (each already divided by the step's denominator, so the sums are the step's values),
    then the share's counts, which the step adds once (`Trainer.train_step`)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    # the draft head's (trainer.draft): its loss (weighted, like the loss), its cross-entropy summed
    # over drafted positions, their count
    draft_loss: float = 0.0
    draft_ce_sum: float = 0.0
    draft_positions: float = 0.0
    num_samples: float = 0.0
    num_tokens: float = 0.0
    num_sample_trained_tokens: float = 0.0  # from the samples' metadata (`packing.trained_tokens`)
    reward_sum: float = 0.0
    num_forward_tokens: float = 0.0

def mixed_precision(device: torch.device, compute_dtype: str) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast to bf16 on `device` for compute_dtype "bfloat16"; nothing for "float32"."""
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def attach_logprobs(model: CausalLM, config: TrainerConfig) -> None:
    """Give `model` (a CausalLM, sharded or not) the `token_logprobs` forward method (module docstring)."""
    temperature, chunk_tokens = config.temperature, config.logprob_chunk_tokens

    exact = config.batch_invariant
    compute_dtype = config.compute_dtype
    feature_coef = config.draft_feature_coef

    def token_logprobs(self: CausalLM, input_ids_1R: torch.Tensor, positions_1R: torch.Tensor,
                       targets_S: torch.Tensor, routed_experts: torch.Tensor | None,
                       branches_1R: torch.Tensor | None = None, rows_S: torch.Tensor | None = None,
                       draft: DraftPositions | None = None) -> tuple[torch.Tensor, ...]:
        attn = DenseCausalAttention(batch_invariant=exact, branches_BT=branches_1R)
        with mixed_precision(input_ids_1R.device, compute_dtype):
            h_1RD, _ = self.model(input_ids_1R, positions_1R, attn, routed_experts)
        extra: tuple[torch.Tensor, ...] = ()
        if draft is not None:  # the draft head's loss, from the same forward (models/draft.py)
            h_RD = h_1RD[0]
            extra = draft_loss(self, h_RD.index_select(0, draft.rows_P), draft.tokens_P,
                               h_RD.index_select(0, draft.next_rows_P), draft.targets_P,
                               feature_coef=feature_coef, chunk_tokens=chunk_tokens)
        # The vocabulary projection and its log-softmax in fp32 (a no-op in fp32), for the rows asked for.
        h_SD = (h_1RD[0] if rows_S is None else h_1RD[0].index_select(0, rows_S)).float()
        if exact:  # the engine's own arithmetic: full logits, log_softmax, gather
            logp_SV = batch_invariant.log_softmax(self.lm_head(h_SD), temperature)
            logp_S = logp_SV.gather(-1, targets_S[:, None]).squeeze(-1)
            entropy_S = -(logp_SV.exp() * logp_SV).sum(-1)
        else:
            logp_S, entropy_S = token_logprobs_from_hidden(h_SD, self.lm_head.weight, targets_S,
                                                           temperature=temperature, chunk_tokens=chunk_tokens,
                                                           bf16_matmuls=compute_dtype == "bfloat16")
        # The kernel returns views (a reshape); FSDP2 hooks its pre-backward on the outputs and
        # warns about views, so hand it fresh tensors ([T] floats: nothing to speak of).
        return (logp_S.clone(), entropy_S.clone(), *extra)

    # An instance method (models/ has no such method); FSDP2 then wraps it with its forward hooks.
    # The type: ignores here and in micro_batch_loss: torch's stubs type the attributes a Module
    # does not declare (its __getattr__/__setattr__) as tensors or modules, never as methods.
    model.token_logprobs = types.MethodType(token_logprobs, model)  # type: ignore[assignment]
    if "torch.distributed.fsdp" in sys.modules:  # else the model is no FSDPModule (fsdp.py imports it to shard)
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "token_logprobs")


@dataclass(frozen=True)
class DraftPositions:
    """Where the draft head is trained in a packed micro-batch (P positions t, each inside one
    sample, whose tokens t+1 and t+2 were both sampled: where an engine drafts): the rows of h_t and
    h_{t+1}, token t+1 and token t+2."""

    rows_P: torch.Tensor
    next_rows_P: torch.Tensor
    tokens_P: torch.Tensor
    targets_P: torch.Tensor

    @classmethod
    def of(cls, batch: PackedBatch, device: torch.device) -> DraftPositions:
        """From the slots: slot s - 1 and slot s both trained, in one sample (a slot's target is the
        token after it, so slot s - 1 reads h_t with target t+1 and slot s reads h_{t+1})."""
        mask_T, sample_T = batch.loss_mask_T > 0, batch.sample_T
        slots_P = torch.nonzero(mask_T[1:] & mask_T[:-1] & (sample_T[1:] == sample_T[:-1])).reshape(-1) + 1
        rows_T = torch.arange(len(mask_T)) if batch.hidden_rows_T is None else batch.hidden_rows_T
        return cls(rows_P=rows_T[slots_P - 1].to(device), next_rows_P=rows_T[slots_P].to(device),
                   tokens_P=batch.targets_T[slots_P - 1].to(device), targets_P=batch.targets_T[slots_P].to(device))


@dataclass(frozen=True)
class MicroBatchLoss:
    loss: torch.Tensor  # with gradient, already divided by the step's denominator (with the draft head's term)
    sums_K: torch.Tensor  # float64, in the order of StepSums (its counts left 0)


def trains_draft(config: TrainerConfig) -> bool:
    """Whether this step trains the draft head: always when "online", during SFT when "frozen"."""
    return config.draft == "online" or (config.draft == "frozen" and config.objective == "sft")


def micro_batch_loss(model: nn.Module, batch: PackedBatch, config: TrainerConfig, denominator: float,
                     device: torch.device) -> MicroBatchLoss:
    """Forward one packed micro-batch and return its loss (for backward) and its metric sums."""
    loss_config = config.policy_loss
    experts = None if batch.routed_experts_L1Tk is None else batch.routed_experts_L1Tk.to(device)
    mask_T = batch.loss_mask_T.to(device)
    rollout_T = batch.rollout_logprobs_T.to(device)
    # Only the trained slots are scored (a prompt's positions need no vocabulary projection); the
    # others hold the rollout's log-prob, a finite constant every masked term ignores.
    slots_S = torch.nonzero(batch.loss_mask_T).reshape(-1)
    if slots_S.numel() == 0:
        slots_S = slots_S.new_zeros(1)  # a padding micro-batch still runs the model's collectives
    rows_S = slots_S if batch.hidden_rows_T is None else batch.hidden_rows_T[slots_S]
    slots_S = slots_S.to(device)
    draft = DraftPositions.of(batch, device) if trains_draft(config) else None
    logp_S, entropy_S, *draft_out = model.token_logprobs(  # type: ignore[operator]  # the method attach_logprobs set
        batch.input_ids_1R.to(device), batch.positions_1R.to(device), batch.targets_T.to(device)[slots_S],
        experts, None if batch.branches_1R is None else batch.branches_1R.to(device), rows_S.to(device), draft)
    logp_T = rollout_T.index_put((slots_S,), logp_S)
    entropy_T = rollout_T.new_zeros(rollout_T.shape).index_put((slots_S,), entropy_S)
    seq_ids_T = batch.sample_T.to(device)
    teacher_T = None if batch.teacher_logprobs_T is None else batch.teacher_logprobs_T.to(device)
    zero = logp_T.new_zeros(())
    if config.objective == "sft":
        loss = sft_loss(logp_T, mask_T, seq_ids_T, loss_config.aggregation, denominator=denominator)
        out = None
        loss_parts = (loss.detach(), zero)
    else:
        ref_T = None
        if loss_config.kl_coef > 0:
            # A padding micro-batch (no samples) trains nothing: any reference will do.
            ref_T = logp_T.detach() if batch.ref_logprobs_T is None else batch.ref_logprobs_T.to(device)
        old_T = rollout_T if config.old_logprobs == "rollout" else None
        # (a padding micro-batch, no samples, carries no teacher: it trains nothing, fold no distance)
        fold_T = logp_T.detach() if teacher_T is None and loss_config.distill_coef > 0 else teacher_T
        out = policy_loss(logp_T, batch.advantages_T.to(device), mask_T, seq_ids_T, loss_config,
                          old_logp_T=old_T, rollout_logp_T=rollout_T, ref_logp_T=ref_T,
                          entropy_T=entropy_T if loss_config.entropy_coef > 0 else entropy_T.detach(),
                          teacher_logp_T=fold_T, denominator=denominator)
        loss = out.loss
        loss_parts = (out.pg_loss, out.kl)
    parts = metric_parts(trainer_logp_T=logp_T.detach(), rollout_logp_T=rollout_T, loss_mask_T=mask_T, loss=out,
                         entropy_T=entropy_T.detach(), teacher_logp_T=teacher_T)
    total = loss
    if draft is not None:  # a term of its own: the policy's parameters get no gradient from it
        draft_sum, ce_sum = draft_out
        draft_term = draft_sum * (config.draft_coef / denominator)
        total = loss + draft_term
        parts |= {"draft_loss": draft_term.detach(), "draft_ce_sum": ce_sum,
                  "draft_positions": zero + draft.targets_P.numel()}
    sums_K = StepSums.stack(**parts, loss=loss.detach(), pg_loss=loss_parts[0], kl=loss_parts[1])
    return MicroBatchLoss(loss=total, sums_K=sums_K)
