"""`Trainer`: one rank's model, optimizer and train step; the actor `TrainerRank` wraps it.

A train step takes this rank's share of a batch, planned on the caller's side from the samples'
metadata (`packing.plan_step`: the share, one advantage per sample, the number of micro-batches
every rank runs and the whole batch's aggregation denominator), and accumulates gradients over
its micro-batches. The loss (`loss.micro_batch_loss`: PPO/TIS/KL/entropy of `miles_async.rl`, or
SFT) is a sum over trained tokens divided by the aggregation denominator of the whole batch,
times the world size to undo FSDP's averaging of gradients over ranks (gloo has no PREMUL_SUM, so
the divide factor cannot simply be set to 1), so the update is the same whatever the world size
and the micro-batch budget, up to float summation order. Each micro-batch adds its metric sums
to one float64 vector, all-reduced once per step with the share's counts (samples, tokens,
reward), so every rank reports the whole batch's metrics.

Try it: see tests/unit/test_trainer_step.py (one rank over gloo, in-process).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from miles_async.models import load_pretrained
from miles_async.models.draft import PREFIX as DRAFT_PREFIX
from miles_async.models.lora import add_lora, lora_delta
from miles_async.rl import RLMetrics
from miles_async.trainer import checkpoint
from miles_async.trainer.config import OBJECTIVES, TrainerConfig
from miles_async.trainer.fsdp import full_tensor, shard_model
from miles_async.trainer.loss import StepSums, attach_logprobs, micro_batch_loss
from miles_async.trainer.offload import StreamingAdamW
from miles_async.trainer.packing import micro_batches, pack, trained_tokens
from miles_async.trajectory import TokenData, Trajectory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What one train step reports (the same on every rank: reduced over the world)."""

    step: int
    weight_version: int
    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    num_trained_tokens: int
    num_micro_batches: int
    tokens_per_s: float  # the samples' tokens per second (shared prefixes count once per sample)
    logprob_abs_diff: float  # mean |trainer log-prob - rollout log-prob| over trained tokens
    mean_reward: float
    elapsed_s: float
    skipped: bool = False  # True when the gradient was not finite and no update was made
    # Means over trained tokens (miles_async.rl.RLMetrics), at the weights before this step's update:
    rollout_kl_k3: float = 0.0  # k3 KL between the rollout's and the trainer's log-probs
    clip_fraction: float = 0.0  # PPO clip set the token's term
    dual_clip_fraction: float = 0.0
    tis_truncated_fraction: float = 0.0  # the TIS weight hit the cap
    mis_masked_fraction: float = 0.0  # MIS dropped the token (its ratio outside policy_loss.mis_band)
    entropy: float = 0.0  # per-token entropy of the trainer's distribution
    teacher_kl: float = 0.0  # trainer log-prob - teacher log-prob: the reverse KL to a distillation teacher
    # The loss's parts, aggregated like the loss (loss = pg_loss + kl_coef * kl - entropy_coef * entropy):
    pg_loss: float = 0.0
    kl: float = 0.0  # to the reference log-probs (0 unless kl_coef > 0)
    num_forward_tokens: int = 0  # tokens the model ran: num_tokens less the shared prefixes' repeats
    # The draft head's (trainer.draft), when this step trained it: its term of the loss (not in
    # `loss`), and its mean cross-entropy to the sampled tokens it would have drafted
    draft_loss: float = 0.0
    draft_ce: float = 0.0


class WeightBucket(msgspec.Struct, frozen=True, kw_only=True):
    """One file of full tensors written by `Trainer.export_weights`: its path and what it holds."""

    path: str
    names: list[str]
    num_bytes: int


def make_optimizer(params: list[torch.nn.Parameter] | list[dict[str, Any]],
                   config: TrainerConfig) -> torch.optim.Optimizer:
    """The trainer's AdamW over `params` (tensors, or param groups): in memory, or with its state streamed from disk
    (`config.optimizer_offload`, trainer/offload.py). float32 weights get the same update bit for
    bit either way; bf16 weights an fp32 master and moments on disk, bf16 moments in memory."""
    if config.optimizer_offload == "disk":
        return StreamingAdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                              weight_decay=config.weight_decay, folder=config.optimizer_dir or None,
                              bucket_mib=config.optimizer_bucket_mib)
    # fused: one kernel over all the parameters (SmolLM2-135M on one CPU thread: 0.12 s a step
    # against 0.57 for the default per-parameter loop)
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, fused=True)


class Trainer:
    """Model (FSDP2-sharded), AdamW and the train step of one rank; the process group must exist."""

    def __init__(self, config: TrainerConfig, device: torch.device) -> None:
        config = config.on_device(device)  # compute_dtype "auto" made concrete
        self.config = config
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.seed)
        if not config.model_dir:
            raise ValueError("TrainerConfig.model_dir is empty: give the folder of the model to train")
        model = load_pretrained(config.model_dir, dtype=DTYPES[config.dtype], device=device)
        if config.draft != "none":  # the draft head (its weights from the checkpoint if it has them, else seeded)
            model.add_draft_head()
        else:  # a checkpoint's draft head, unused: not trained, not pushed
            model.mtp = None
        # LoRA: adapters (seeded) on the projections, the base frozen (models/lora.py)
        self.lora_modules = frozenset(add_lora(model, config.lora, generator=torch.Generator().manual_seed(
            config.seed)) if config.lora.enabled else ())
        if config.batch_invariant:
            model.set_batch_invariant(True)  # before sharding: the flags live on the modules
        if config.fake_quant != "none":
            model.set_fake_quant(config.fake_quant)
        model.train()
        self.model = shard_model(model, device)
        attach_logprobs(self.model, config)
        # (with LoRA, the adapters only: the frozen base has no optimizer state)
        # the draft head's parameters apart: their own param group (trainer.draft_lr) and gradient clipping
        self.draft_params = [p for name, p in self.model.named_parameters() if name.startswith(DRAFT_PREFIX)]
        self.policy_params = [p for name, p in self.model.named_parameters() if not name.startswith(DRAFT_PREFIX)]
        policy = [p for p in self.policy_params if p.requires_grad]
        draft = [p for p in self.draft_params if p.requires_grad]
        self.optimizer = make_optimizer([{"params": policy}, {"params": draft}] if draft else policy, config)
        model_config = model.config
        self.moe_shape = model_config.moe_shape
        self.step = 0
        self.weight_version = 0
        self.data_cursor = 0

    def train_step(self, samples: list[Trajectory], advantages: list[float], *, num_micro_batches: int,
                   denominator: float, data_cursor: int | None = None, objective: str | None = None,
                   lr: float | None = None) -> StepMetrics:
        """One optimizer step; `samples` (with their `data` inline) and `advantages` are this rank's
        share of a batch planned by `packing.plan_step`, and every rank calls it together.

        `objective` and `lr` override the config's for this step (an SFT warm start before RL
        runs "sft" at its own learning rate); the optimizer's state is shared by both.
        """
        config = self.config
        for i, group in enumerate(self.optimizer.param_groups):  # group 1: the draft head's, if any
            group["lr"] = config.draft_lr if i == 1 and config.draft_lr > 0 else config.lr if lr is None else lr
        if objective is not None and objective != config.objective:
            if objective not in OBJECTIVES:
                raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
            config = msgspec.structs.replace(config, objective=objective)
        data = self._check_share(samples, advantages, config)
        start = time.perf_counter()
        plan = micro_batches(samples, config.micro_batch_tokens, num_micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        sums_K = torch.zeros(len(StepSums.names()), dtype=torch.float64)
        share = config.share_prefixes and not config.batch_invariant
        forward_tokens = 0
        for indices in plan:
            groups = [(samples[i].prompt_id, samples[i].attempt) for i in indices] if share else None
            packed = pack([data[i] for i in indices], [advantages[i] for i in indices], self.moe_shape, groups)
            forward_tokens += packed.num_tokens if packed.num_samples else 0
            out = micro_batch_loss(self.model, packed, config, denominator, self.device)
            # FSDP averages gradients over ranks; the loss is already a mean over the whole
            # batch, so undo the average (x world size; a power of two is exact in floats).
            (out.loss * self.world_size).backward()
            sums_K += out.sums_K.cpu()
        sums_K += StepSums.stack(  # the share's counts, all-reduced with the sums
            num_samples=len(samples), num_tokens=sum(d.num_tokens for d in data),
            num_sample_trained_tokens=sum(trained_tokens(s) for s in samples), reward_sum=sum(s.reward for s in samples),
            num_forward_tokens=forward_tokens)
        # The draft head's gradient is clipped on its own: the policy's update is the same with or without it.
        norm = torch.nn.utils.clip_grad_norm_(self.policy_params, self.config.grad_clip)
        if self.draft_params:
            torch.nn.utils.clip_grad_norm_(self.draft_params, self.config.grad_clip)
        grad_norm = float(full_tensor(norm))
        # A non-finite gradient (same on every rank: the norm is reduced) skips the update.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.weight_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if data_cursor is not None:
            self.data_cursor = data_cursor
        if self.world_size > 1:
            reduced = sums_K.to(self.device)  # NCCL reduces device tensors only; one collective per step
            dist.all_reduce(reduced)
            sums_K = reduced.cpu()
        elapsed_s = time.perf_counter() - start
        sums = StepSums.of(sums_K)
        rl = RLMetrics.of(sums)
        num_samples, num_tokens = int(sums.num_samples), int(sums.num_tokens)
        return StepMetrics(
            step=self.step, weight_version=self.weight_version, loss=sums.loss, grad_norm=grad_norm,
            num_samples=num_samples, num_tokens=num_tokens, num_trained_tokens=int(sums.num_sample_trained_tokens),
            num_micro_batches=len(plan), tokens_per_s=num_tokens / max(elapsed_s, 1e-9),
            logprob_abs_diff=rl.logprob_abs_diff, mean_reward=sums.reward_sum / max(num_samples, 1),
            elapsed_s=elapsed_s, skipped=skipped, rollout_kl_k3=rl.rollout_kl_k3, clip_fraction=rl.clip_fraction,
            dual_clip_fraction=rl.dual_clip_fraction, tis_truncated_fraction=rl.tis_truncated_fraction,
            entropy=rl.entropy, pg_loss=sums.pg_loss, kl=sums.kl, num_forward_tokens=int(sums.num_forward_tokens),
            teacher_kl=rl.teacher_kl, mis_masked_fraction=rl.mis_masked_fraction, draft_loss=sums.draft_loss,
            draft_ce=sums.draft_ce_sum / sums.draft_positions if sums.draft_positions else 0.0)

    def eval_loss(self, samples: list[Trajectory], *, num_micro_batches: int, denominator: float) -> float:
        """The SFT loss of this rank's share at the current weights, summed over ranks (a collective
        when world_size > 1); no gradient, no update. The same number a train step on the same
        share would report as its loss before updating."""
        config = msgspec.structs.replace(self.config, objective="sft", draft="none")
        data = self._check_share(samples, [0.0] * len(samples), config)
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for indices in micro_batches(samples, config.micro_batch_tokens, num_micro_batches):
                packed = pack([data[i] for i in indices], [0.0] * len(indices), self.moe_shape)
                total += micro_batch_loss(self.model, packed, config, denominator, self.device).loss.double().cpu()
        if self.world_size > 1:
            reduced = total.to(self.device)
            dist.all_reduce(reduced)
            total = reduced.cpu()
        return float(total)

    def _check_share(self, samples: list[Trajectory], advantages: list[float],
                     config: TrainerConfig) -> list[TokenData]:
        """The share's token arrays; ValueError naming what is wrong with it."""
        if len(advantages) != len(samples):
            raise ValueError(f"train_step got {len(advantages)} advantages for {len(samples)} samples")
        data = []
        for i, sample in enumerate(samples):
            if not isinstance(sample.data, TokenData):
                raise TypeError(f"sample {i} (prompt {sample.prompt_id}) has no token data inline "
                                 f"({type(sample.data).__name__}): read it from the data plane first")
            sample.data.check()
            data.append(sample.data)
        needs_ref = config.objective == "rl" and config.policy_loss.kl_coef > 0
        if needs_ref and not all(d.ref_logprobs for d in data):
            raise ValueError("policy_loss.kl_coef > 0 but some samples carry no ref_logprobs; compute the reference "
                             "log-probs for every sample or set kl_coef=0")
        needs_teacher = config.objective == "rl" and config.policy_loss.distill_coef > 0
        if needs_teacher and not all(d.teacher_logprobs for d in data):
            raise ValueError("policy_loss.distill_coef > 0 but some samples carry no teacher_logprobs; have the "
                             "teacher score every sample or set distill_coef=0")
        return data

    def export_weights(self, out_dir: str | Path, bucket_bytes: int, *, merged: bool = False) -> list[WeightBucket]:
        """Write the full weights as safetensors buckets of about `bucket_bytes` (a collective).

        Every rank gathers each parameter (FSDP all-gather, one at a time, so no rank holds more
        than one bucket of full tensors); rank 0 writes bucket i to `out_dir/bucket_<i>.safetensors`
        as soon as it is full, into a temporary folder renamed to `out_dir` at the end, so a
        reader never sees half a version. Every rank returns the same list of buckets.

        With LoRA the export is the adapters alone (what the engines need: they hold the base), or
        with `merged` the base weights with the adapters merged in and no adapter tensor (a plain
        Hugging Face model, for a model folder).
        """
        out_dir = Path(out_dir)
        tmp_dir = out_dir.with_name(f".tmp-{out_dir.name}")
        if self.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir(parents=True)
        buckets: list[WeightBucket] = []
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0

        def flush() -> None:
            nonlocal pending, pending_bytes
            path = out_dir / f"bucket_{len(buckets):05d}.safetensors"
            if self.rank == 0:
                save_file(pending, str(tmp_dir / path.name))
            buckets.append(WeightBucket(path=str(path), names=list(pending), num_bytes=pending_bytes))
            pending, pending_bytes = {}, 0

        params = dict(self.model.named_parameters())
        for name, param in params.items():
            adapter = name.endswith((".lora_A", ".lora_B"))
            if self.lora_modules and adapter == merged:  # the adapters alone, or all but them
                continue
            tensor = full_tensor(param.detach())
            module = name.removesuffix(".weight")
            if merged and module in self.lora_modules:
                lora = self.config.lora
                tensor = tensor + lora_delta(full_tensor(params[f"{module}.lora_A"].detach()),
                                             full_tensor(params[f"{module}.lora_B"].detach()), lora.scale)
            tensor = tensor.cpu().contiguous()
            size = tensor.numel() * tensor.element_size()
            if pending and pending_bytes + size > bucket_bytes:
                flush()
            pending[name] = tensor
            pending_bytes += size
        if pending:
            flush()
        if self.rank == 0:
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp_dir, out_dir)
        dist.barrier()
        return buckets

    def save_checkpoint(self, root: str | Path, after_write: Callable[[Path], None] | None = None) -> Path:
        """Save model, optimizer, RNG, step, version and data cursor under `root` (a collective)."""
        staged, meta = self.stage_checkpoint()
        return checkpoint.write(root, staged, meta, after_write=after_write)

    def stage_checkpoint(self) -> tuple[checkpoint.Staged, dict[str, Any]]:
        """A copy of what a checkpoint holds, to write with `checkpoint.write` while training goes on."""
        meta = {"step": self.step, "weight_version": self.weight_version, "data_cursor": self.data_cursor}
        return checkpoint.stage(self.model, self.optimizer), meta

    def load_checkpoint(self, folder: str | Path) -> dict[str, Any]:
        """Load a checkpoint folder (a collective); returns its meta (step, weight_version, data_cursor)."""
        meta = checkpoint.load(folder, self.model, self.optimizer)
        self.step, self.weight_version = int(meta["step"]), int(meta["weight_version"])
        self.data_cursor = int(meta["data_cursor"])
        return meta

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, by Hugging Face name (a collective: call on every rank).

        Tied weights appear once, under the first name (`model.embed_tokens.weight`), as a
        Hugging Face checkpoint with `tie_word_embeddings` stores them.
        """
        # a copy: on one rank on the CPU the full tensor is the parameter itself, which the next step changes
        return {name: full_tensor(param.detach()).to("cpu", copy=True) for name, param in self.model.named_parameters()}
