"""`TrainerConfig`: what one trainer rank needs to know, with defaults that run the tiny model on CPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import msgspec

from miles_async.models.lora import LoraConfig
from miles_async.rl import AdvantageConfig, PolicyLossConfig

if TYPE_CHECKING:
    import torch

OBJECTIVES: tuple[str, ...] = ("rl", "sft")
OLD_LOGPROBS: tuple[str, ...] = ("trainer", "rollout")


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of the trainer ranks (one value for every rank of a run).

    `micro_batch_tokens` bounds the packed tokens of one forward/backward; a sample longer than it
    gets a micro-batch of its own. `backend` "auto" picks NCCL when CUDA is there, else gloo.

    The loss (`miles_async.trainer.loss`): `objective` "rl" is `miles_async.rl.policy_loss` with
    `policy_loss` (PPO clip, dual clip, TIS cap, KL and entropy coefficients, aggregation);
    "sft" is cross-entropy on the masked tokens (warm start), aggregated the same way.
    `advantage` is how a batch's rewards become advantages (per group of samples of one prompt),
    applied where the step is planned (`packing.plan_step`). `old_logprobs` is the PPO
    anchor: "trainer" (this step's log-probs before the update, so the ratio is 1 and TIS
    corrects trainer vs engine) or "rollout" (the engine's, so the clip acts on that ratio and
    TIS is 1). `temperature` is the rollouts' sampling temperature: log-probs and entropy are of
    softmax(logits / temperature), the distribution the engine sampled from.
    """

    model_dir: str = ""  # set by the run (a recipe's model.path or the model it makes)
    world_size: int = 1  # trainer ranks, one process each (TrainerGroup.spawn)
    lr: float = 1e-5  # AdamW's learning rate, the same every step
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's decay rates of the gradients' two moments
    eps: float = 1e-8  # AdamW's epsilon, added to the second moment's root
    weight_decay: float = 0.0  # AdamW's decoupled weight decay; 0: none
    grad_clip: float = 1.0  # the gradients' total L2 norm is clipped to this each step (clip_grad_norm_)
    micro_batch_tokens: int = 4096  # packed tokens of one forward/backward at most
    dtype: str = "float32"  # of the weights and the optimizer state (the master copy)
    # The matmuls' dtype: "bfloat16" runs the model's forward and backward under torch.autocast
    # (mixed precision: fp32 master weights, AdamW state and gradients; bf16 matmuls, 4x the fp32
    # rate on a CPU with AVX512-BF16), while the log-probs over the vocabulary stay in fp32. "auto":
    # "bfloat16" where the rank's device computes bf16 natively (miles_async/kernels/precision.py), the weights
    # are float32 and batch_invariant is off; else "float32" (emulated bf16 is slower than fp32).
    compute_dtype: str = "float32"
    backend: str = "auto"  # torch.distributed's: "gloo", "nccl" or "auto" (NCCL with CUDA, else gloo)
    num_threads: int = 0  # torch intra-op threads per rank; 0 leaves torch's default
    seed: int = 0
    checkpoint_dir: str = ""  # "" means no checkpoints; otherwise the folder of step_<N> checkpoints
    # where full-weight buckets are written for the pusher ("" = a temporary folder of the run;
    # a folder on /dev/shm makes the hand-off a shared-memory one on one node)
    weights_dir: str = ""
    # A file the controller wrote in the run folder and what it holds: a rank that reads otherwise is
    # on a node that does not share the run folder (checkpoints and weight exports need it shared).
    shared_file: str = ""
    shared_token: str = ""
    weight_bucket_bytes: int = 64 << 20  # bytes of one safetensors bucket of exported weights (about)
    # seconds to join the process group and for each collective before a rank fails
    process_group_timeout_s: float = 120.0
    objective: Literal["rl", "sft"] = "rl"
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    old_logprobs: Literal["trainer", "rollout"] = "trainer"  # the PPO anchor: the trainer's or the engine's
    temperature: float = 1.0
    logprob_chunk_tokens: int = 512  # rows of [tokens, vocab] logits alive at once (kernels.logprobs)
    # True on-policy mode: batch-invariant kernels, so the trainer's log-probs equal those of an
    # engine run with EngineConfig(batch_invariant=True) bit for bit. Log-probs then come from the
    # full logits of each micro-batch, as the engine computes them (the chunked kernel rounds
    # differently), so size micro_batch_tokens for [tokens, vocab] float32 logits.
    batch_invariant: bool = False
    # Run the common prefix of a group's samples (their prompt) through the model once per
    # micro-batch (trainer/packing.py); the loss is the same, up to float summation order. Off in
    # batch-invariant mode and with routed-expert replay, which need each sample laid out alone.
    share_prefixes: bool = True
    # Low-rank adapters (models/lora.py): rank > 0 freezes the base and trains adapters on the
    # attention and MLP projections only (optimizer state for them alone); the weight pushes then
    # move the adapters alone, the engines merging them into a copy of the base.
    lora: LoraConfig = LoraConfig()
    # Quantization-aware training (miles_async/kernels/quant.py): the attention and MLP projections run as an
    # engine serving that rollout.engine.weight_format runs them (the weights as the format holds
    # them; fp8_block and mxfp8 also their activations), so that the rollout's quantized model is
    # the one trained (with batch-invariant kernels on both sides the mismatch is then 0);
    # straight-through gradients. "fp8_block" also runs the backward's matmuls on FP8 blockwise
    # values (FP8 training, emulated).
    fake_quant: Literal["none", "fp8_block", "mxfp8", "nvfp4", "int4"] = "none"
    # Where AdamW's state lives (trainer/offload.py): "none" in memory (torch's fused AdamW, its
    # state in `dtype`); "disk" in a file per rank, streamed through memory a bucket at a time during
    # the step, so that the state takes two buckets of memory whatever the model's size. With dtype
    # "bfloat16" the file also holds fp32 master weights (mixed precision with no fp32 weights in
    # memory: 12 bytes a parameter on disk, not 4 of bf16 moments in memory); the step then costs the
    # disk's time to read and write that state once (miles_async/bench/optimizer.py measures it).
    optimizer_offload: Literal["none", "disk"] = "none"
    # The folder of that file ("" = the system's temporary folder); each rank makes its own nameless
    # file there, gone when the rank exits. Give a real disk: on tmpfs the "disk" is memory.
    optimizer_dir: str = ""
    # State bytes of one bucket (8 an element, 12 with the master): 2 x this is the optimizer's memory
    # during a step; larger buckets mean fewer, larger I/O calls (at 64 MiB a 1B-parameter bf16
    # model's step ran at 1.25x the disk's bound, miles_async/bench/optimizer.py).
    optimizer_bucket_mib: float = 64.0
    # The draft head of speculative decoding (models/draft.py; rollout.engine.speculative_tokens):
    # "none": the model has none; "online": it is trained in every step on the step's own samples
    # (trainer/loss.py: cross-entropy to the sampled next token, plus draft_feature_coef times a
    # smooth-L1 pull toward the policy's next hidden state), its gradient kept from the policy, and
    # pushed with the policy's weights; "frozen": trained during an SFT warm start only, then pushed
    # unchanged (a fixed draft, to compare with). The loss is weighted by draft_coef.
    draft: Literal["none", "frozen", "online"] = "none"
    draft_coef: float = 1.0  # weight of the draft head's loss in the step's loss
    draft_feature_coef: float = 0.1  # weight of the smooth-L1 hidden-state term within the draft head's loss
    draft_lr: float = 0.0  # the draft head's learning rate (SFT and RL); 0: the step's own (lr, or sft.lr)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.compute_dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or 'auto', got {self.compute_dtype!r}")
        if self.compute_dtype == "bfloat16" and (self.dtype != "float32" or self.batch_invariant):
            raise ValueError("compute_dtype = 'bfloat16' is mixed precision over float32 weights: it needs "
                             f"dtype = 'float32' (got {self.dtype!r}) and batch_invariant = false")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"lr and grad_clip must be positive, got lr={self.lr}, grad_clip={self.grad_clip}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the rollouts' sampling temperature), got {self.temperature}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if self.weight_bucket_bytes < 1:
            raise ValueError(f"weight_bucket_bytes must be >= 1, got {self.weight_bucket_bytes}")
        if self.optimizer_offload not in ("none", "disk"):
            raise ValueError(f"optimizer_offload must be 'none' or 'disk', got {self.optimizer_offload!r}")
        if self.draft not in ("none", "frozen", "online"):
            raise ValueError(f"draft must be 'none', 'frozen' or 'online', got {self.draft!r}")
        if self.draft_lr < 0:
            raise ValueError(f"draft_lr must be >= 0 (0: the step's learning rate), got {self.draft_lr}")
        if self.draft != "none" and (self.draft_coef <= 0 or self.draft_feature_coef < 0):
            raise ValueError(f"draft_coef must be > 0 and draft_feature_coef >= 0, got {self.draft_coef} and "
                             f"{self.draft_feature_coef}")
        if self.draft != "none" and self.lora.enabled:
            raise ValueError("trainer.draft with LoRA is not supported (the engines' updates carry the adapters "
                             "alone); set trainer.draft = 'none' or drop LoRA")
        if not (math.isfinite(self.optimizer_bucket_mib) and self.optimizer_bucket_mib > 0):
            raise ValueError(f"optimizer_bucket_mib must be a positive number of MiB, got {self.optimizer_bucket_mib}")

    def on_device(self, device: torch.device) -> TrainerConfig:
        """This config with compute_dtype "auto" made "bfloat16" or "float32" for a rank on `device`."""
        from miles_async.kernels.precision import auto_dtype

        if self.compute_dtype != "auto":
            return self
        native = self.dtype == "float32" and not self.batch_invariant
        return msgspec.structs.replace(self, compute_dtype=auto_dtype("auto", device) if native else "float32")
