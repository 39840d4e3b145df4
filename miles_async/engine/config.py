"""The embedded engine's configuration (`EngineConfig`) and the device it names (`resolve_device`).

Its own module, below core.py, runner.py and the scheduler, so that each of them reads the
config without importing the engine.
"""

from __future__ import annotations

import os
import re
from typing import Literal

import msgspec
import torch

from miles_async.models.lora import LoraConfig

_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sizes and limits of the embedded engine."""

    block_size: int = 16  # tokens per KV-cache block: the unit the cache is allocated and prefixes shared in
    kv_cache_mib: float = 512.0  # KV memory for all layers; sets the number of blocks
    max_running_requests: int = 256  # requests running (prefill or decode) at once at most; the others wait
    max_waiting_requests: int = 4096  # requests waiting at most; one more is refused (EngineOverloadedError)
    max_prefill_tokens: int = 1024  # prompt tokens computed per step; longer prompts are chunked
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # of the generator shared by requests without a sampling_seed
    # The weights' and activations' dtype: of an `EngineActor`'s model (a run's engines) and of
    # `Engine.from_pretrained`'s; `Engine(model)` serves the model it is given as it is. "auto":
    # bfloat16 where the engine's device computes it natively (a GPU from Ampere on, a CPU with
    # AVX512-BF16 or AMX), else float32 (miles_async/kernels/precision.py).
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # True on-policy mode: the paged attention and the model (the engine switches the model it is
    # given) run batch-invariant kernels, so a token's log-prob equals the trainer's, in the same
    # mode, bit for bit. Costs throughput: ~2.5x fewer tokens/s on the tiny model on CPU.
    batch_invariant: bool = False
    # Weight updates (weights.py): a second copy of the weights that updates are written into
    # while generation goes on, swapped in when complete, so an interrupted update leaves the
    # previous version serving. Costs the weights' bytes again; without it an interrupted update
    # leaves the engine refusing requests until a complete version arrives.
    double_buffer: bool = False
    # Keep the weights in shared memory, so a pusher in another process on the node writes
    # straight into them (the shm transport). CPU memory: device "cpu" only.
    shared_weights: bool = False
    # On a CPU, run the linear layers from copies of their weights prepacked for oneDNN
    # (miles_async/kernels/onednn.py: ~2x faster decode matmuls at small batches), made again after every
    # weight update; costs the weights' bytes once more. Off in batch-invariant mode, and where
    # this torch build or dtype cannot (then the plain path runs).
    prepack_weights: bool = True
    # On a CPU, run RMSNorm, rotary embedding, attention (straight over the paged KV
    # blocks, no gather) and greedy sampling through fused kernels (miles_async/kernels/cpu_kernels.py,
    # compiled once per machine with the system's C++ compiler; without one, the plain torch ops
    # run). Off in batch-invariant mode.
    fused_cpu_kernels: bool = True
    # Where the weights, the KV cache and the step's tensors live: "cpu", "cuda" (the process's
    # current GPU), "cuda:N", or "auto" ("cuda" when the engine's process sees a GPU, else "cpu";
    # resolved there, by `resolve_device`).
    device: str = "cpu"
    # LoRA (models/lora.py; a run sets it from trainer.lora): the model gets the trainer's
    # adapters, which are then the only weights an update writes; the engine keeps a copy of the
    # base and serves base + adapter merged into each layer's weight (made again before the first
    # step after every update), so decoding runs one matmul per layer as without adapters.
    lora: LoraConfig = LoraConfig()
    # Hold and serve the attention and MLP projections in a quantized format (miles_async/kernels/quant.py:
    # "fp8_block", "mxfp8", "nvfp4", "int4"): the engine keeps only the format's tensors
    # (CausalLM.hold_quantized), which are what weight updates carry (a pusher quantizes once, on
    # the trainer's side; a full-precision weight that arrives is quantized on arrival). The
    # matmuls are emulated, in the engine's dtype, from the dequantized values: W8A8 for fp8_block
    # and mxfp8 (the activations quantized per token too, as FP8 GEMMs take them; no prepacked
    # weights then), weight-only (W4A16) for nvfp4 and int4. "none": full precision, as pushed.
    weight_format: Literal["none", "fp8_block", "mxfp8", "nvfp4", "int4"] = "none"
    # With a weight_format, where the full-precision values come from: "per_update" dequantizes
    # every layer once after each update and keeps that copy (the fast path; the dense weights'
    # memory on top of the format's), "blocks" keeps the format's tensors alone and dequantizes a
    # block of rows at a time inside every forward (the format's memory; slower on CPU).
    dequantize: Literal["per_update", "blocks"] = "per_update"
    # Speculative decoding (engine/speculative.py): the model's draft head (models/draft.py: its
    # `mtp.*` weights, from the checkpoint, the updates, or seeded when neither has them) proposes
    # this many tokens per decoding request per step and the policy verifies them in one forward;
    # outputs keep exactly the policy's distribution, log-probs are the policy's. 0: off.
    speculative_tokens: int = 0
    # Adapt each request's drafting to how its drafts fare (engine/speculative.py): no drafts while
    # their moving acceptance is under 0.3 (then one every 8th step, to see whether they pass
    # now), all it may otherwise. False: always as many as speculative_tokens (and the remaining
    # tokens and free KV blocks) allow.
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_running_requests", "max_waiting_requests", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_mib <= 0:
            raise ValueError(f"EngineConfig.kv_cache_mib must be > 0, got {self.kv_cache_mib}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"EngineConfig.device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        if self.shared_weights and self.device not in ("cpu", "auto"):
            raise ValueError(shared_on_device(self.device))
        if self.dequantize not in ("per_update", "blocks"):
            raise ValueError(f"EngineConfig.dequantize must be 'per_update' or 'blocks', got {self.dequantize!r}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"EngineConfig.speculative_tokens must be in [0, 16] (0: no speculative decoding), got "
                             f"{self.speculative_tokens}")
        if self.speculative_tokens and (self.lora.enabled or self.weight_format != "none"):
            raise ValueError("EngineConfig.speculative_tokens with LoRA or a weight_format is not supported (the "
                             "draft head's weights would be left out of the updates, or quantized untested): "
                             "set speculative_tokens = 0 or drop the other")
        if self.weight_format != "none" and self.lora.enabled:
            raise ValueError(f"EngineConfig.weight_format = {self.weight_format!r} with LoRA is not supported: the "
                             "engine merges the adapters into a full-precision base; set one or the other")


def shared_on_device(device: str) -> str:
    return (f"EngineConfig.shared_weights keeps the weights in CPU shared memory (the shm transport), but "
            f"the engine's device is {device!r}: use device 'cpu' with it, or another weight transport for "
            "an engine on a GPU (weights.transport = \"broadcast\" or \"stream\")")


def resolve_device(name: str) -> torch.device:
    """The device `EngineConfig.device` names, in this process: "auto" is the current GPU when
    one is visible, else the CPU; "cuda" the current GPU. A ValueError that says why when CUDA is
    asked for and this process has none."""
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"EngineConfig.device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None else
               f"no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        raise ValueError(f"EngineConfig.device = {name!r}, but this process cannot use CUDA: {why}. Use "
                         "device 'cpu', or 'auto' to take a GPU only where one is visible")
    index = torch.cuda.current_device() if name == "cuda" else int(name.partition(":")[2])
    if index >= torch.cuda.device_count():
        raise ValueError(f"EngineConfig.device = {name!r}, but this process sees {torch.cuda.device_count()} "
                         f"GPU(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)
