"""The embedded engine: continuous batching over a paged KV cache with a radix prefix cache.

    engine = Engine.from_pretrained("models/tiny")            # or Engine(model, tokenizer=...)
    async with engine:
        out = await engine.generate(GenerateRequest(input_ids=[1, 2, 3],
                                                    sampling_params=SamplingParams(temperature=0)))

How a step runs. The engine loop is one asyncio task. Each step, holding the engine lock, it
  1. schedules: every running request gets its next token (a decoding request) or its next
     prompt chunk (a prefilling one, within `max_prefill_tokens` per step), then waiting requests
     are admitted in arrival order while KV blocks and `max_running_requests` allow. A request's
     prompt is first matched against the prefix cache; the matched blocks are shared, not
     recomputed. When a decoding request needs a block and none is free even after evicting
     unused cached blocks, the most recently admitted request is retracted: its KV goes to the
     prefix cache, its blocks are released, and it waits at the head of the queue, keeping its
     outputs and its random generator, to be re-prefilled (mostly from the cache) later.
  2. runs the model on one packed row of all scheduled tokens, then samples, on the compute
     thread (compute.py: one thread for all torch work), so the event loop (and an HTTP server
     on it) stays responsive; the vocabulary projection covers the sampled rows, plus the prompt
     positions a request asked log-probs of (`logprob_start_len`: those positions are never
     taken from the prefix cache, whose KV holds no logits);
  3. applies the results: appends tokens, checks stop conditions, finishes requests (their full
     KV blocks go into the prefix cache), and wakes whoever waits on them. A request with
     `max_new_tokens = 0` that asked prompt log-probs is prefill only: it finishes when its prompt
     is computed, having sampled nothing (SGLang's scoring request, a distillation teacher's).
Control calls (abort, pause, flush, weight updates) take the same lock, so they act between
steps; `submit` does not need it.

Device (`EngineConfig.device`: "cpu", "cuda", "cuda:N", or "auto", which is "cuda" where this
process sees a GPU): the weights, the KV blocks, each step's index tensors and masks, the
sampler's generators and the routed-expert slots live there; what callers get back (token ids,
log-probs, routed experts) is Python values and CPU tensors. A step reads back from the device
only its results (`.tolist()` of the sampled ids and log-probs, of scored prompt log-probs and of
the top-k lists asked for). Shared-memory weights (`shared_weights`, the shm transport) are CPU
memory, so they go with device "cpu" only.

Bounds: at most `max_running_requests` run and `max_waiting_requests` wait (`submit` raises
`EngineOverloadedError` beyond); KV memory is `kv_cache_mib`; every admitted request fits alone
(`submit` rejects prompt + max_new_tokens beyond the context length).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from miles_async.engine import compute, speculative
from miles_async.engine.attention import GatherWorkspace, PagedAttention, ScheduledChunk, StepPlan, build_plan
from miles_async.engine.kv_cache import KVCache, OutOfBlocksError
from miles_async.engine.request import (
    GenerateOutput,
    GenerateRequest,
    Phase,
    Request,
    Tokenizer,
    TopLogprobs,
    output_text,
    stop_reason,
)
from miles_async.engine.sampling import filtered_log_probs, make_generator, sample
from miles_async.engine.weights import WeightStore, parse_version
from miles_async.kernels import cpu_kernels, onednn, quant
from miles_async.kernels.precision import auto_dtype
from miles_async.models.draft import PREFIX as DRAFT_PREFIX
from miles_async.models.draft import has_draft
from miles_async.models.lora import LoraConfig, add_lora, lora_state, merge_lora
from miles_async.trajectory import spans_of

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

# SGLang's pause modes, plus "wait" (ours): finish what is in flight, admit nothing new.
PAUSE_MODES = ("abort", "in_place", "retract", "wait")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`); retry later (HTTP 503)."""


class WeightsUnavailableError(RuntimeError):
    """The weights are torn (an update did not complete); nothing is served until one does (HTTP 503)."""


_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")
MEMORY_TAGS = ("weights", "kv_cache")


def _memory_tags(tags: Sequence[str] | None) -> set[str]:
    wanted = set(MEMORY_TAGS if tags is None else tags)
    if not wanted <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags must be among {', '.join(MEMORY_TAGS)}, got {sorted(wanted)}")
    return wanted


def _trim_heap() -> None:
    """Have glibc give freed heap memory back to the system (a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    # AVX512-BF16 or AMX), else float32 (kernels/precision.py).
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
    # (kernels/onednn.py: ~2x faster decode matmuls at small batches), made again after every
    # weight update; costs the weights' bytes once more. Off in batch-invariant mode, and where
    # this torch build or dtype cannot (then the plain path runs).
    prepack_weights: bool = True
    # On a CPU, run RMSNorm, rotary embedding, attention (straight over the paged KV
    # blocks, no gather) and greedy sampling through fused kernels (kernels/cpu_kernels.py,
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
    # Hold and serve the attention and MLP projections in a quantized format (kernels/quant.py:
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
            raise ValueError(_shared_on_device(self.device))
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


def _shared_on_device(device: str) -> str:
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


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int
    num_waiting: int
    num_steps: int
    num_generated_tokens: int
    num_prompt_tokens: int  # prompt tokens of admitted requests (first admission)
    num_cached_prompt_tokens: int  # of which the prefix cache held
    prefix_cache_hit_rate: float
    num_retractions: int
    num_free_blocks: int
    num_cached_blocks: int
    num_blocks: int
    weight_version: str
    paused: str | None
    weights_error: str | None = None  # why nothing is served (torn weights), if so
    num_used_tokens: int = 0  # tokens with KV of the running requests
    # Speculative decoding: verify forwards of decoding requests, drafts proposed, drafts accepted
    num_spec_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    num_finished_requests: int = 0  # since start, aborted ones included
    num_aborted_requests: int = 0
    num_used_blocks: int = 0  # KV blocks requests hold (not free, not evictable prefix cache)


@dataclass(frozen=True, slots=True)
class _Step:
    requests: list[Request]
    chunks: list[ScheduledChunk]
    sampled: list[bool]  # which chunks end at the request's last token (sample after them)
    input_ids: list[int]  # the chunks' tokens, packed
    # Prompt positions scored this step: (index into requests, packed row, the prompt token it scores).
    scored: list[tuple[int, int, int]]
    drafts: list[int]  # per chunk: draft tokens it verifies (its last ones; speculative decoding), else 0


@dataclass(frozen=True, slots=True)
class _StepResult:
    # Per sampled chunk: the tokens it emits (one; with drafts, the accepted ones and one more), the
    # log-prob of each and, when its request asked, the k most likely tokens at each.
    tokens: list[list[int]]
    logprobs: list[list[float]]
    top: list[list[TopLogprobs | None]]
    scored_logprobs: list[float]  # one per _Step.scored row
    scored_top: list[TopLogprobs | None]
    hidden: list[torch.Tensor | None]  # per sampled chunk: the policy's hidden state at its last kept position


def _top(logp_RV: torch.Tensor, ks: list[int]) -> list[TopLogprobs | None]:
    """The k most likely (log-prob, token id) of each row, k per row (0: None)."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [None] * len(ks)
    values_RK, ids_RK = logp_RV.topk(min(k_max, logp_RV.shape[-1]), dim=-1)
    values, ids = values_RK.tolist(), ids_RK.tolist()  # one read each, not one per row
    return [list(zip(v[:k], i[:k])) if k else None for v, i, k in zip(values, ids, ks)]


def _config_int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)


class Engine:
    """Continuous-batching generation over one model; all methods run on one event loop.

    The model is moved to `config.device` if it is elsewhere; `config.device` is then the
    resolved device ("auto" and "cuda" become e.g. "cuda:0"), and `device` the same as a torch.device.
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, model_path: str | None = None,
                 weight_version: str = "0") -> None:
        config = config or EngineConfig()
        self.device = resolve_device(config.device)
        if config.shared_weights and self.device.type != "cpu":
            raise ValueError(_shared_on_device(f"{config.device} (here {self.device})"))
        if config.device != str(self.device):
            config = msgspec.structs.replace(config, device=str(self.device))
        if any(p.device != self.device for p in model.parameters()):
            compute.run_sync(model.to, self.device)
        if self.device.type == "cuda":  # the compute thread's current GPU: NCCL groups use it
            compute.run_sync(torch.cuda.set_device, self.device)
        if config.batch_invariant:
            if not hasattr(model, "set_batch_invariant"):
                raise ValueError(f"EngineConfig.batch_invariant needs a model with set_batch_invariant "
                                 f"(miles_async.models.CausalLM), got {type(model).__name__}")
            model.set_batch_invariant(True)
        self._speculative = config.speculative_tokens
        if self._speculative:  # the draft head's weights are then part of every update
            if not (hasattr(model, "add_draft_head") and hasattr(model, "model") and hasattr(model, "lm_head")):
                raise ValueError(f"EngineConfig.speculative_tokens needs a model with a draft head "
                                 f"(miles_async.models.CausalLM), got {type(model).__name__}")
            compute.run_sync(model.add_draft_head)
        elif getattr(model, "mtp", None) is not None:  # a checkpoint's draft head, unused: not held, not updated
            model.mtp = None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.model_path = model_path
        self._lora = config.lora.enabled
        if self._lora:  # the adapters (B = 0: the base as it is) are what updates write
            compute.run_sync(add_lora, model, config.lora)
        self._weight_format = "" if config.weight_format == "none" else config.weight_format
        if self._weight_format:  # the projections held as the format's tensors: what updates write
            if not hasattr(model, "hold_quantized"):
                raise ValueError(f"EngineConfig.weight_format = {config.weight_format!r} needs a model with "
                                 f"hold_quantized (miles_async.models.CausalLM), got {type(model).__name__}")
            compute.run_sync(model.hold_quantized, self._weight_format)
        self.weights = WeightStore(model, double_buffer=config.double_buffer, shared=config.shared_weights,
                                   version=parse_version(weight_version, -1)[0], label=weight_version,
                                   names=list(lora_state(model)) if self._lora else None,
                                   weight_format=self._weight_format)
        mc = model.config
        self.vocab_size = _config_int(mc, "vocab_size")
        num_heads = _config_int(mc, "num_attention_heads")
        head_dim = _config_int(mc, "head_dim") or _config_int(mc, "hidden_size") // num_heads
        model_max = _config_int(mc, "max_position_embeddings", 2048)
        self.max_seq_len = min(config.max_seq_len or model_max, model_max)
        self.is_moe = bool(getattr(mc, "is_moe", _config_int(mc, "num_experts") > 0))
        # The KV blocks hold keys and values in the model's dtype (those of a bf16 model are bf16
        # already: storing them wider would only double the memory and the bytes each step reads).
        kv_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        layer_shape = {"num_layers": _config_int(mc, "num_hidden_layers"), "block_size": config.block_size,
                       "num_kv_heads": _config_int(mc, "num_key_value_heads") or num_heads, "head_dim": head_dim,
                       "dtype": kv_dtype}
        num_blocks = int(config.kv_cache_mib * 2**20) // KVCache.bytes_per_block(**layer_shape)
        needed = -(-self.max_seq_len // config.block_size)
        if num_blocks < needed:
            raise ValueError(f"kv_cache_mib={config.kv_cache_mib} holds {num_blocks} blocks but one request of "
                             f"max_seq_len={self.max_seq_len} tokens needs {needed}; raise kv_cache_mib or lower "
                             "max_seq_len")
        self.cache = compute.run_sync(KVCache, num_blocks=num_blocks, device=self.device, **layer_shape)
        self._workspace = GatherWorkspace()
        self._shared_generator = make_generator(config.seed, self.device)
        # Every id that ends generation unless ignore_eos: the tokenizer's and the generation config's.
        eos_ids = getattr(tokenizer, "eos_token_ids", None) or [getattr(tokenizer, "eos_token_id", None)]
        self._eos_ids = frozenset(i for i in eos_ids if i is not None)
        self._requests: dict[str, Request] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._seq = itertools.count()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()  # set after every step and every finish (pause "wait" watches it)
        self._task: asyncio.Task | None = None
        self._paused: str | None = None
        self._pause_seq = 0  # "wait": only requests that arrived before this run
        self._cache_epoch = 0
        self._counters = collections.Counter()
        # Prepacked weights (EngineConfig.prepack_weights): made on the compute thread before the
        # first step after any change of the weights (`_weights_epoch` counts the changes).
        # (not from a weight_format's blocks: no dense weight exists to prepack; nor for a W8A8
        # format: the layers quantize their inputs first)
        self._prepack = (config.prepack_weights and not config.batch_invariant and hasattr(model, "prepack_weights")
                         and not (self._weight_format and (config.dequantize == "blocks"
                                                           or self._weight_format in quant.ACTIVATION_FORMATS))
                         and compute.run_sync(onednn.supported, kv_dtype, self.device))
        self._weights_epoch = 0
        self._prepacked_epoch = -1
        self._merged_epoch = -1  # LoRA: the weights epoch whose adapters are merged in
        # weight_format "per_update": the weights epoch whose dequantized copy the layers hold
        self._dequantize_per_update = bool(self._weight_format) and config.dequantize == "per_update"
        self._served_epoch = -1
        self._fused = (config.fused_cpu_kernels and not config.batch_invariant and hasattr(model, "use_cpu_kernels")
                       and compute.run_sync(cpu_kernels.supports, kv_dtype, self.device))
        if self._fused:
            model.use_cpu_kernels(True)

    # ----- construction and lifecycle -----

    @classmethod
    def from_pretrained(cls, path: str, *, config: EngineConfig | None = None,
                        dtype: torch.dtype | None = None) -> Engine:
        """Load a Hugging Face checkpoint folder (and its tokenizer, if it has one) onto `config.device`,
        in `dtype` (default: `config.dtype`, "auto" resolved for that device)."""
        from miles_async.models import load_pretrained
        from miles_async.models.tokenizer import load_tokenizer

        config = config or EngineConfig()
        device = resolve_device(config.device)  # before loading: a clear error for CUDA
        dtype = dtype or getattr(torch, auto_dtype(config.dtype, device))
        model = compute.run_sync(load_pretrained, path, dtype=dtype, device=device)
        # Without tokenizer.json the engine takes token ids only; text requests get a 400.
        tokenizer = load_tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        return cls(model, tokenizer=tokenizer, config=config, model_path=str(path))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        """Abort every request and stop the loop."""
        if self._task is None:
            return
        async with self._lock:
            for request in list(self._requests.values()):
                self._finish(request, {"type": "abort", "message": "the engine is shutting down"})
        self._task.cancel()
        # asyncio.wait, not `await self._task`: it raises CancelledError only when stop() itself is
        # cancelled, never for the loop's own cancellation, so there is nothing to tell apart
        # (Task.cancelling(), which could, is Python 3.11+).
        await asyncio.wait([self._task])
        if not self._task.cancelled():
            self._task.result()  # a loop that ended with an error raises it here
        self._task = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ----- requests -----

    def submit(self, request: GenerateRequest) -> Request:
        """Queue a request and return its state (await `.done`, or pass it to `stream`/`snapshot`).

        Raises ValueError if the request is malformed, EngineOverloadedError if the queue is full.
        """
        if self._task is None:
            raise RuntimeError("the engine is not started: use `async with engine:` or `await engine.start()`")
        # A paused engine queues the request even without weights or KV cache (a colocated run's
        # release: the push that brings them back resumes it); otherwise it refuses at once.
        if self._paused is None and (problem := self.weights.serving_error()) is not None:
            raise WeightsUnavailableError(problem)
        if self._paused is None and self.cache.released:
            raise WeightsUnavailableError("the KV cache was released (release_memory_occupation): "
                                          "resume_memory_occupation first")
        ids = request.input_ids
        params = request.sampling_params
        self._check_request(request)
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self._waiting)} requests are waiting (max_waiting_requests); "
                                        "retry later")
        rid = request.rid or uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"rid {rid!r} is already in flight; give each request its own rid")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_ids)
        state = Request(
            rid=rid, seq=next(self._seq), prompt_ids=list(ids), params=params,
            return_logprob=request.return_logprob, return_routed_experts=request.return_routed_experts,
            generator=None if params.sampling_seed is None else make_generator(params.sampling_seed, self.device),
            stop_token_ids=frozenset(stop_ids),
            # SGLang ignores both without return_logprob
            logprob_start_len=request.logprob_start_len if request.return_logprob else -1,
            top_logprobs_num=request.top_logprobs_num if request.return_logprob else 0)
        self._requests[rid] = state
        if params.max_new_tokens == 0 and state.next_scored_position() is None:  # nothing to compute
            self._finish(state, {"type": "length", "length": 0})
            return state
        self._waiting.append(state)
        self._wake.set()
        return state

    def _check_request(self, request: GenerateRequest) -> None:
        ids, params = request.input_ids, request.sampling_params
        if not ids:
            raise ValueError("the prompt is empty: give at least one input id (or non-empty text)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})")
        params.check(self.vocab_size)
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the context length of {self.max_seq_len} tokens; shorten the prompt or lower "
                             "max_new_tokens")
        if request.return_routed_experts and not self.is_moe:
            raise ValueError("return_routed_experts needs a mixture-of-experts model; this one is dense")
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer; this engine has none (use stop_token_ids)")
        if request.return_logprob and not -1 <= request.logprob_start_len <= len(ids):
            raise ValueError(f"logprob_start_len={request.logprob_start_len} is outside [-1, {len(ids)}] (-1: no "
                             f"prompt log-probs; at most the prompt's {len(ids)} tokens)")
        if request.return_logprob and not 0 <= request.top_logprobs_num <= self.vocab_size:
            raise ValueError(f"top_logprobs_num={request.top_logprobs_num} is outside [0, {self.vocab_size}] "
                             "(the vocabulary size)")

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Submit and wait for the final output; cancelling the wait aborts the request."""
        state = self.submit(request)
        try:
            await state.done.wait()
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(state.rid))
            raise
        return self.snapshot(state)

    async def stream(self, state: Request) -> AsyncIterator[GenerateOutput]:
        """Yield a snapshot after every step that changed the request, the last one final."""
        while True:
            await state.updated.wait()
            state.updated.clear()
            yield self.snapshot(state)
            if state.phase is Phase.FINISHED:
                return

    def snapshot(self, state: Request) -> GenerateOutput:
        finished = state.phase is Phase.FINISHED
        text = state.final_text if finished else output_text(state, self.tokenizer)
        return GenerateOutput(
            rid=state.rid, output_ids=list(state.output_ids), text=text, finish_reason=state.finish_reason,
            prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.output_ids),
            cached_tokens=state.cached_tokens, weight_version=self.weight_version,
            weight_versions=list(spans_of(state.weight_versions, state.version_counts, 0)),
            weight_version_labels=[label for label, n in zip(state.version_labels, state.version_counts) if n > 0],
            output_token_logprobs=list(state.output_logprobs) if state.return_logprob else None,
            routed_experts_TLk=state.routed_experts_TLk if finished else None,
            e2e_latency_s=(state.finished_s if finished else time.perf_counter()) - state.created_s,
            spec_verify_ct=state.spec_verify_ct, spec_draft_tokens=state.spec_draft_tokens,
            spec_accepted_drafts=state.spec_accepted_drafts, **self._logprob_fields(state))

    @staticmethod
    def _logprob_fields(state: Request) -> dict[str, Any]:
        """SGLang's prompt log-probs (the first scored position has no log-prob) and top-k lists."""
        if not state.return_logprob:
            return {}
        start = state.logprob_start_len
        scored = state.prompt_ids[start:] if start >= 0 else []
        first: list[float | None] = [None] if scored else []
        fields: dict[str, Any] = {"input_token_logprobs": list(zip(first + list(state.input_logprobs), scored))}
        if state.top_logprobs_num:
            top_first: list[TopLogprobs | None] = [None] if scored else []
            fields["input_top_logprobs"] = top_first + list(state.input_top)
            fields["output_top_logprobs"] = list(state.output_top)
        return fields

    # ----- control -----

    async def abort(self, rid: str | None = None, *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort one request (or all); return how many were aborted (0: unknown or finished).

        `prefix`: every request whose rid starts with `rid`, as SGLang's scheduler matches an
        abort (so "r1" aborts "r1", "r1_0" and "r10" alike; an empty prefix is refused).
        """
        if prefix and not rid and not abort_all:
            raise ValueError("an empty rid prefix would abort every request; give abort_all=True for that")
        async with self._lock:
            if abort_all:
                targets = list(self._requests.values())
            elif prefix:
                targets = [r for r in self._requests.values() if r.rid.startswith(rid or "")]
            else:
                targets = [self._requests[rid]] if rid in self._requests else []
            for request in targets:
                self._finish(request, {"type": "abort", "message": f"request {request.rid} was aborted"})
            return len(targets)

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation (SGLang's modes, plus "wait"); requests submitted meanwhile queue.

        abort: abort everything in flight. in_place: keep running requests and their KV as they
        are. retract: move running requests back to the queue, their KV to the prefix cache (it
        can be flushed; they are recomputed on continue). wait: finish what was submitted
        before this call (returns when it has), admit nothing newer.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        async with self._lock:
            self._paused = mode
            if mode == "abort":
                for request in list(self._requests.values()):
                    self._finish(request, {"type": "abort", "message": "generation was paused (mode abort)"})
            elif mode == "retract":
                for request in reversed(list(self._running)):
                    self._retract(request)
            elif mode == "wait":
                self._pause_seq = next(self._seq)
        while mode == "wait" and self._paused == "wait" and any(
                r.seq < self._pause_seq for r in self._requests.values()):
            self._progress.clear()
            await self._progress.wait()

    async def resume(self) -> None:
        """SGLang's continue_generation."""
        async with self._lock:
            self._paused = None
            self._wake.set()

    async def flush_cache(self) -> int:
        """Drop every cached prefix; return the blocks freed (blocks in use stay with their requests)."""
        async with self._lock:
            return self.cache.tree.flush()

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give back the memory of the weights and/or the KV cache (`tags`: "weights", "kv_cache";
        None: both), as SGLang's /release_memory_occupation does for a colocated trainer. The engine
        must be idle (pause it with mode "abort" first); it refuses requests until resumed, and
        released weights come back empty: push a complete version after `resume_memory_occupation`.
        A LoRA engine's weights cannot be released (its base is never pushed again), nor shared-memory
        ones (the shm transport)."""
        wanted = _memory_tags(tags)
        async with self._lock:
            if self._requests:
                raise ValueError(f"{len(self._requests)} requests are in flight: release needs an idle engine "
                                 "(pause with mode \"abort\", or let them finish)")
            if "weights" in wanted:
                if self._lora:
                    raise ValueError("a LoRA engine's base weights are never pushed again: release its kv_cache only")
                await compute.run(self.weights.release)
                if self._prepack:
                    await compute.run(self.model.prepack_weights, False)
                if self._dequantize_per_update:
                    await compute.run(self.model.dequantize_served, False)
                self._prepacked_epoch = self._served_epoch = -1
            if "kv_cache" in wanted:
                self._cache_epoch += 1
                await compute.run(self.cache.release_memory)
            await compute.run(_trim_heap)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Allocate again what `release_memory_occupation` gave back (the KV cache empty, the weights
        zeros: the engine serves once a complete weight version is pushed)."""
        wanted = _memory_tags(tags)
        async with self._lock:
            if "kv_cache" in wanted:
                await compute.run(self.cache.reclaim_memory)
            if "weights" in wanted:
                await compute.run(self.weights.reclaim)
            self._wake.set()

    @property
    def weight_version(self) -> str:
        """The label of the weights being served (SGLang's `weight_version`)."""
        return self.weights.label

    async def update_weight_version(self, label: str) -> str:
        """Relabel the live weights (SGLang's /update_weight_version): an integer label is the new
        version (not older than the engine's), a name keeps the version. Tokens sampled from now
        on report it. The weights and the prefix cache are unchanged."""
        async with self._lock:
            self.weights.relabel(label)
            return self.weights.label

    async def update_weights_from_tensors(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[
            tuple[str, torch.Tensor]], weight_version: str | int | None = None) -> str:
        """Copy a complete set of weights in (between steps, casting to the engine's dtype); return the label.

        `weight_version`: an integer (or its text) newer than the engine's, or a name (the next
        integer); an older one raises StaleVersionError (a ValueError) before anything is
        written, as does a wrong name or shape. The prefix cache is flushed (its KV came from
        the old weights); running requests continue on their existing KV. A speculating engine
        keeps its draft head's weights when the update has none (a checkpoint without a draft head);
        another ignores a draft head's weights.
        """
        version, label = parse_version(weight_version, self.weights.version)
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not self._speculative:  # a draft head's weights (models/draft.py): for speculating engines only
            items = [(name, tensor) for name, tensor in items if not name.startswith(DRAFT_PREFIX)]
        elif not has_draft(name for name, _ in items):
            items += [(f"{DRAFT_PREFIX}{name}", tensor.detach().clone())
                      for name, tensor in self.model.mtp.state_dict().items()]
        async with self._lock:
            self.weights.check_newer(version)
            self.weights.check(items)  # every name and shape checked before begin() tears anything
            self.weights.begin(version, label)
            try:
                await compute.run(self.weights.write, items)
            except BaseException as e:
                self.weights.abort(f"{type(e).__name__}: {e}")
                raise
            return self._after_update(self.weights.commit())

    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None) -> str:
        """Load a checkpoint folder (off the loop, while generation goes on), then copy it in."""
        from miles_async.models import load_pretrained

        self.weights.check_newer(parse_version(weight_version, self.weights.version)[0])  # before loading
        dtype = next(self.model.parameters()).dtype
        new_model = await compute.run(load_pretrained, model_path, dtype=dtype)
        version = await self.update_weights_from_tensors(new_model.state_dict(), weight_version)
        self.model_path = str(model_path)
        return version

    # The update protocol for transports (weights.py): begin, write the target, commit or abort.

    async def begin_weight_update(self, version: int, label: str | None = None) -> dict[str, torch.Tensor]:
        """Start an update to `version` between steps; return the tensors to write (see WeightStore.begin)."""
        async with self._lock:
            return self.weights.begin(version, label)

    async def commit_weight_update(self, expected_checksums: Mapping[str, str] | None = None) -> str:
        """Verify (if checksums are given, on the compute thread) and make the update live; return the label."""
        async with self._lock:
            version = await compute.run(self.weights.commit, expected_checksums)
            return self._after_update(version)

    async def abort_weight_update(self, reason: str) -> None:
        async with self._lock:
            self.weights.abort(reason)

    async def adopt_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                            version: int, expected_checksums: Mapping[str, str] | None = None) -> int:
        """The colocated handoff: take the tensors as the weights, without a copy where the dtype allows.

        Returns how many tensors were taken as they are. Needs a double-buffered engine for the
        no-copy path (otherwise every tensor is copied in place, paused).
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        async with self._lock:
            self.weights.begin(version, adopting=True)
            try:
                taken = await compute.run(self.weights.adopt, items)
                self._after_update(await compute.run(self.weights.commit, expected_checksums))
            except BaseException as e:
                self.weights.abort(f"{type(e).__name__}: {e}")
                raise
            return taken

    async def apply_weight_delta(self, folder: str) -> str:
        """Apply a disk delta (transport.disk_delta) written against this engine's version; return the label.

        The delta is decoded and checked in full before any weight is written, so it is applied
        to the live weights directly, between steps.
        """
        from miles_async.transport.disk_delta import apply_delta

        async with self._lock:
            if (problem := self.weights.serving_error()) is not None:
                raise WeightsUnavailableError(f"a delta needs a complete base version: {problem}")
            version = await compute.run(apply_delta, folder, self.weights.live, self.weights.version)
            self.weights.record_in_place(version)
            return self._after_update(version)

    async def weight_checksums(self) -> dict[str, str]:
        async with self._lock:
            return await compute.run(self.weights.checksums)

    async def random_fill_weights(self, seed: int) -> None:
        """Overwrite the live weights with seeded noise: the start of the random-fill verification check."""
        async with self._lock:
            await compute.run(self.weights.random_fill, seed)
            self.cache.tree.flush()
            self._cache_epoch += 1
            self._weights_epoch += 1

    def _after_update(self, version: int) -> str:
        self.cache.tree.flush()
        self._cache_epoch += 1
        self._weights_epoch += 1
        self._wake.set()  # a torn engine waits for this
        log.debug("weights now at version %s (%s)", version, self.weights.label)
        return self.weights.label

    def stats(self) -> EngineStats:
        prompt, cached = self._counters["prompt_tokens"], self._counters["cached_tokens"]
        return EngineStats(
            num_running=len(self._running), num_waiting=len(self._waiting), num_steps=self._counters["steps"],
            num_generated_tokens=self._counters["generated_tokens"], num_prompt_tokens=prompt,
            num_cached_prompt_tokens=cached, prefix_cache_hit_rate=cached / prompt if prompt else 0.0,
            num_retractions=self._counters["retractions"], num_free_blocks=self.cache.num_free,
            num_cached_blocks=len(self.cache.tree), num_blocks=self.cache.num_blocks,
            weight_version=self.weight_version, paused=self._paused, weights_error=self.weights.serving_error(),
            num_used_tokens=sum(r.num_computed for r in self._running),
            num_spec_verifies=self._counters["spec_verifies"], num_draft_tokens=self._counters["draft_tokens"],
            num_accepted_drafts=self._counters["accepted_drafts"],
            num_finished_requests=self._counters["finished_requests"],
            num_aborted_requests=self._counters["aborted_requests"],
            num_used_blocks=self.cache.num_blocks - self.cache.num_free - self.cache.tree.num_evictable())

    # ----- the loop -----

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            async with self._lock:
                step = None
                try:
                    step = self._schedule()
                    if step is None:
                        self._wake.clear()
                        continue
                    result = await compute.run(self._execute, step)
                    self._apply(step, result)
                except Exception as e:  # the loop's boundary: fail the step's requests, keep serving
                    log.exception("engine step failed")
                    for request in step.requests if step is not None else list(self._running):
                        self._finish(request, {"type": "abort", "message": f"engine step failed: {e!r}"})
            await asyncio.sleep(0)  # let HTTP handlers and control calls in between steps

    def _schedulable(self, request: Request) -> bool:
        if self._paused is None:
            return True
        return self._paused == "wait" and request.seq < self._pause_seq

    def _schedule(self) -> _Step | None:
        if self._paused not in (None, "wait") or self.weights.serving_error() is not None or self.cache.released:
            return None
        budget = self.config.max_prefill_tokens
        chosen: list[tuple[Request, int, int]] = []  # (request, tokens it computes, drafts among them)
        for request in list(self._running):
            if request.phase is not Phase.RUNNING or not self._schedulable(request):
                continue  # retracted earlier in this loop
            pending = request.num_tokens - request.num_computed
            count = 1 if pending == 1 else min(pending, budget)
            if count == 0:
                continue
            if self._grow(request, request.num_computed + count):
                drafts = self._num_drafts(request) if pending == 1 and self._speculative else 0
                chosen.append((request, count + drafts, drafts))
                budget -= count if pending > 1 else 0
        while self._waiting and budget > 0 and len(self._running) < self.config.max_running_requests:
            request = self._waiting[0]
            if not self._schedulable(request) or not self._admit(request):
                break
            self._waiting.popleft()
            count = min(request.num_tokens - request.num_computed, budget)
            budget -= count
            chosen.append((request, count, 0))
        if not chosen:
            return None
        chunks = [ScheduledChunk(r.blocks, r.num_computed, n) for r, n, _ in chosen]
        ids: list[int] = []
        scored: list[tuple[int, int, int]] = []
        for i, (request, count, drafts) in enumerate(chosen):
            start = request.num_computed
            position = request.next_scored_position()
            if position is not None:  # prompt positions to score: [position, len(prompt) - 1) within the chunk
                assert start <= position, "admission never takes a position to score from the prefix cache"
                end = min(start + count, len(request.prompt_ids) - 1)
                scored.extend((i, len(ids) + p - start, request.prompt_ids[p + 1]) for p in range(position, end))
            ids.extend(request.all_ids[start:start + count - drafts])
            ids.extend([0] * drafts)  # the drafts' places: _execute drafts them first
        return _Step(requests=[r for r, _, _ in chosen], chunks=chunks,
                     sampled=[r.num_computed + n - d == r.num_tokens for r, n, d in chosen], input_ids=ids,
                     scored=scored, drafts=[d for _, _, d in chosen])

    def _num_drafts(self, request: Request) -> int:
        """How many tokens to draft for a decoding request this step: `speculative_tokens`, less
        what its max_new_tokens and the context length leave (the verify emits drafts + 1 tokens,
        at positions up to num_computed + drafts), less what its KV blocks and the free blocks hold
        (drafting never evicts the prefix cache nor retracts anyone); none while its drafts fail too
        often (`speculative_adaptive`), or before its first sampled step has left it a hidden state."""
        if request.draft_hidden is None:
            return 0
        budget = self._speculative
        if (self.config.speculative_adaptive
                and speculative.acceptance(request.draft_record) < speculative.MIN_ACCEPTANCE):
            if self._counters["steps"] % speculative.PROBE_EVERY:  # its drafts fail too often to pay
                return 0
            budget = 1  # a probe: one draft, on the same step as every other such request's
        drafts = min(budget, request.params.max_new_tokens - len(request.output_ids) - 1,
                     self.max_seq_len - 1 - request.num_computed)
        if drafts <= 0:
            return 0
        extra = self.cache.blocks_for(request.num_computed + 1 + drafts) - len(request.blocks)
        if extra > 0:
            if extra <= self.cache.num_free:
                request.blocks.extend(self.cache.allocate(extra))
            else:
                drafts = len(request.blocks) * self.cache.block_size - request.num_computed - 1
        return max(drafts, 0)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give a running request blocks for num_tokens, retracting newer requests if memory is short.

        Returns False when the request itself had to be retracted (it was the newest).
        """
        need = self.cache.blocks_for(num_tokens) - len(request.blocks)
        while need > 0:
            try:
                request.blocks.extend(self.cache.allocate(need))
                return True
            except OutOfBlocksError:
                victim = self._running[-1]
                self._retract(victim)
                if victim is request:
                    return False
        return True

    def _admit(self, request: Request) -> bool:
        """Match the prefix cache and allocate the rest of the request's known tokens; False if no room."""
        tokens = request.all_ids
        limit = len(tokens) - 1  # the last known token is always computed: it is sampled after
        position = request.next_scored_position()
        if position is not None:  # cached KV has no logits: compute the positions still to score
            limit = min(limit, position)
        cached = self.cache.tree.match(tokens, max_tokens=limit)
        self.cache.retain(cached)
        need = self.cache.blocks_for(len(tokens)) - len(cached)
        # Keep a little headroom while others run, so that admitting does not force a retraction next step.
        headroom = max(1, self.cache.num_blocks // 100) if self._running else 0
        if not self.cache.can_allocate(need + headroom):
            self.cache.release(cached)
            return False
        try:
            fresh = self.cache.allocate(need)
        except OutOfBlocksError:
            self.cache.release(cached)
            return False
        request.blocks = cached + fresh
        request.num_computed = len(cached) * self.cache.block_size
        request.cache_epoch = self._cache_epoch
        request.phase = Phase.RUNNING
        request.prefilling = True
        if not request.admitted_once:
            request.admitted_once = True
            request.cached_tokens = request.num_computed
            self._counters["prompt_tokens"] += len(request.prompt_ids)
            self._counters["cached_tokens"] += request.num_computed
        self._running.append(request)
        return True

    def _retract(self, request: Request) -> None:
        """Back to the head of the queue; its KV goes to the prefix cache, its blocks are released."""
        self._release_kv(request)
        self._running.remove(request)
        request.phase = Phase.WAITING
        request.num_retractions += 1
        self._counters["retractions"] += 1
        self._waiting.appendleft(request)
        self._wake.set()

    def _release_kv(self, request: Request) -> None:
        if request.cache_epoch == self._cache_epoch and request.num_computed:
            self.cache.tree.insert(request.all_ids, request.blocks, request.num_computed)
        self.cache.release(request.blocks)
        request.blocks = []
        request.num_computed = 0

    def _execute(self, step: _Step) -> _StepResult:
        """On the compute thread: index tensors, the forward over the packed row, then sampling.

        The prompt positions being scored get their logits from the same projection as the
        sampled rows, and their log-probs as the sampler takes a greedy token's (float32
        log_softmax of the logits): row for row what a trainer's forward gives, bit for bit in
        batch-invariant mode.
        """
        device = self.device
        if self._lora and self._merged_epoch != self._weights_epoch:  # new adapters: into the weights
            merge_lora(self.model)
            self._merged_epoch = self._weights_epoch
        if self._dequantize_per_update and self._served_epoch != self._weights_epoch:  # new weights: dequantized once
            self.model.dequantize_served()
            self._served_epoch = self._weights_epoch
        if self._prepack and self._prepacked_epoch != self._weights_epoch:
            self.model.prepack_weights()
            self._prepacked_epoch = self._weights_epoch
        with torch.inference_mode():
            plan = build_plan(step.chunks, self.cache.block_size, device, per_token=self._fused)
            rows = [i for i, s in enumerate(step.sampled) if s]
            # The packed rows whose logits are needed: each sampled chunk's last one (a speculating
            # chunk's last drafts + 1: x_n and its drafts), then the scored prompt positions.
            sampled_rows = [list(range(plan.last_rows[i] - step.drafts[i], plan.last_rows[i] + 1)) for i in rows]
            rows_X = torch.tensor([row for chunk in sampled_rows for row in chunk] + [row for _, row, _ in step.scored],
                                  dtype=torch.long, device=device)
            ids_1T = torch.tensor([step.input_ids], dtype=torch.long, device=device)
            speculating = [r for r, i in enumerate(rows) if step.drafts[i]]  # indices into rows
            drafted = self._draft(step, [rows[r] for r in speculating], plan, ids_1T) if speculating else None
            logits_XV, experts_L1Tk, hidden_XD = self._forward(ids_1T, plan, rows_X)
            if experts_L1Tk is not None:
                self.cache.enable_expert_capture(experts_L1Tk.shape[0], experts_L1Tk.shape[-1])
                self.cache.expert_slots_TLk[plan.write_slots_T] = experts_L1Tk[:, 0].transpose(0, 1).to(torch.int32)
            num_sampled = sum(len(chunk) for chunk in sampled_rows)
            logits_RV, logits_SV = logits_XV[:num_sampled], logits_XV[num_sampled:]
            scored_logprobs: list[float] = []
            scored_top: list[TopLogprobs | None] = []
            if step.scored:
                logp_SV = torch.log_softmax(logits_SV.float(), dim=-1)
                targets_S = torch.tensor([target for _, _, target in step.scored], dtype=torch.long, device=device)
                scored_logprobs = logp_SV.gather(1, targets_S[:, None]).squeeze(1).tolist()
                scored_top = _top(logp_SV, [step.requests[i].top_logprobs_num for i, _, _ in step.scored])
            if not rows:
                return _StepResult([], [], [], scored_logprobs, scored_top, [])
            picked = [step.requests[i] for i in rows]
            starts = list(itertools.accumulate((len(chunk) for chunk in sampled_rows), initial=0))
            tokens: list[list[int]] = [[] for _ in rows]
            logprobs: list[list[float]] = [[] for _ in rows]
            kept = starts[:-1]  # per sampled chunk: its row (in logits_RV) of the last kept position
            plain = [r for r in range(len(rows)) if not step.drafts[rows[r]]]
            if plain:
                if len(plain) == len(rows) and drafted is None:  # one row each, in order: no copy of the logits
                    logits_PV = logits_RV
                else:
                    logits_PV = logits_RV[torch.tensor([starts[r] for r in plain], dtype=torch.long, device=device)]
                tokens_P, logprobs_P = sample(logits_PV, [picked[r].params for r in plain],
                                              [picked[r].generator for r in plain], self._shared_generator,
                                              fused=self._fused)
                for r, token, logprob in zip(plain, tokens_P.tolist(), logprobs_P.tolist()):
                    tokens[r], logprobs[r] = [token], [logprob]
            if drafted is not None:
                verdict = self._verify(logits_RV, [sampled_rows[r] for r in speculating],
                                       [starts[r] for r in speculating], [picked[r] for r in speculating], drafted)
                for r, emitted, emitted_logprobs in zip(speculating, verdict.tokens, verdict.logprobs):
                    tokens[r], logprobs[r] = emitted, emitted_logprobs
                    kept[r] = starts[r] + len(emitted) - 1
            top = self._output_top(logits_RV, picked, [[start + j for j in range(len(t))]
                                                       for start, t in zip(starts, tokens)])
            hidden: list[torch.Tensor | None] = [None] * len(rows)
            if self._speculative and hidden_XD is not None:  # what the next step drafts from
                kept_D = hidden_XD[torch.tensor(kept, dtype=torch.long, device=device)]
                hidden = list(kept_D.unbind(0))
            return _StepResult(tokens, logprobs, top, scored_logprobs, scored_top, hidden)

    def _draft(self, step: _Step, chunks: list[int], plan: StepPlan, ids_1T: torch.Tensor) -> speculative.Drafts:
        """Draft the speculating chunks' tokens with the draft head, from each request's kept
        hidden state and its last token, and write them into their places in `ids_1T`."""
        requests = [step.requests[i] for i in chunks]
        num_drafts = max(step.drafts[i] for i in chunks)
        hidden_SD = torch.stack([r.draft_hidden for r in requests])  # type: ignore[misc]
        last_S = torch.tensor([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in requests],
                              dtype=torch.long, device=self.device)
        drafts = speculative.draft(self.model, hidden_SD, last_S, num_drafts, [r.params for r in requests],
                                   [r.generator for r in requests], self._shared_generator)
        for s, i in enumerate(chunks):
            d = step.drafts[i]
            ids_1T[0, plan.last_rows[i] - d + 1:plan.last_rows[i] + 1] = drafts.tokens_SK[s, :d]
        return drafts

    def _verify(self, logits_RV: torch.Tensor, chunk_rows: list[list[int]], starts: list[int],
                requests: list[Request], drafts: speculative.Drafts) -> speculative.Verdict:
        """The speculating chunks' verdicts (engine/speculative.py) from their rows of the verify's logits."""
        width = drafts.tokens_SK.shape[1] + 1
        index = [[start + min(j, len(rows) - 1) for j in range(width)] for start, rows in zip(starts, chunk_rows)]
        logits_SKV = logits_RV[torch.tensor(index, dtype=torch.long, device=self.device)]
        return speculative.verify(logits_SKV, drafts, [len(rows) - 1 for rows in chunk_rows],
                                  [r.params for r in requests], [r.generator for r in requests],
                                  self._shared_generator, fused=self._fused)

    @staticmethod
    def _output_top(logits_RV: torch.Tensor, picked: list[Request],
                    emitted_rows: list[list[int]]) -> list[list[TopLogprobs | None]]:
        """Per request, per token it emits (at the rows `emitted_rows` of `logits_RV`), the k most
        likely next tokens if it asked, under the distribution the sampler took the chosen token's
        log-prob from (greedy: the model's; else temperature and top-k/top-p applied), so a chosen
        token in the top k shows the same log-prob in both."""
        top: list[list[TopLogprobs | None]] = [[None] * len(rows) for rows in emitted_rows]
        for i, request in enumerate(picked):
            if not request.top_logprobs_num:
                continue
            params = request.params
            for j, row in enumerate(emitted_rows[i]):
                row_1V = logits_RV[row:row + 1].float()
                logp_1V = torch.log_softmax(row_1V, dim=-1) if params.greedy else filtered_log_probs(row_1V, [params])
                top[i][j] = _top(logp_1V, [request.top_logprobs_num])[0]
        return top

    def _forward(self, input_ids_1T: torch.Tensor, plan: StepPlan,
                 rows_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logits of the packed rows `rows_R` only, the routed experts of every token (MoE), and the
        final hidden states of the rows (what the draft head reads; None for a model without a backbone).

        CausalLM exposes its backbone (`model.model`, final hidden states) for exactly this: a
        prefill chunk needs the vocabulary projection of its last token only, not of all of them.
        Any other model with the spec'd forward gets the full logits, then the rows.
        """
        attn = PagedAttention(self.cache, plan, self._workspace, batch_invariant=self.config.batch_invariant)
        positions_1T = plan.positions_T[None]
        backbone, lm_head = getattr(self.model, "model", None), getattr(self.model, "lm_head", None)
        if backbone is not None and lm_head is not None:
            h_1TD, used = backbone(input_ids_1T, positions_1T, attn, None)
            h_RD = h_1TD[0, rows_R]
            return lm_head(h_RD), (torch.stack(used) if used else None), h_RD
        out = self.model(input_ids_1T, positions_1T, attn=attn, return_routed_experts=self.is_moe)
        logits_1TV, experts_L1Tk = out if isinstance(out, tuple) else (out, None)
        return logits_1TV[0, rows_R], experts_L1Tk, None

    def _apply(self, step: _Step, result: _StepResult) -> None:
        self._counters["steps"] += 1
        for (i, _, _), logprob, top in zip(step.scored, result.scored_logprobs, result.scored_top):
            request = step.requests[i]
            request.input_logprobs.append(logprob)
            if top is not None:
                request.input_top.append(top)
        picked = iter(zip(result.tokens, result.logprobs, result.top, result.hidden))
        for request, chunk, sampled, drafts in zip(step.requests, step.chunks, step.sampled, step.drafts):
            assert request.phase is Phase.RUNNING, "requests change phase only under the engine lock"
            request.num_computed += chunk.num_tokens - drafts  # the drafts kept are counted as they are emitted
            if not sampled:
                continue
            tokens, logprobs, tops, hidden = next(picked)
            request.draft_hidden = hidden
            if self._speculative and not request.prefilling:
                request.draft_record = speculative.judged(request.draft_record, drafts, len(tokens) - 1)
                request.spec_verify_ct += 1
                request.spec_draft_tokens += drafts
                request.spec_accepted_drafts += len(tokens) - 1
                self._counters["spec_verifies"] += 1
                self._counters["draft_tokens"] += drafts
                self._counters["accepted_drafts"] += len(tokens) - 1
            if request.prefilling:
                # The prompt (or a re-prefill after retraction) is complete: share its full blocks now.
                request.prefilling = False
                if request.cache_epoch == self._cache_epoch:
                    self.cache.tree.insert(request.all_ids, request.blocks, request.num_computed)
            if request.params.max_new_tokens == 0:  # prefill only, for the prompt's log-probs (SGLang's scoring)
                self._finish(request, {"type": "length", "length": 0})
                continue
            for j, (token, logprob, top) in enumerate(zip(tokens, logprobs, tops)):
                if j:  # an accepted draft before this token: its KV (written by the verify) is kept
                    request.num_computed += 1
                reason = self._emit(request, token, logprob, top)
                if reason is not None:  # the rest of what the verify accepted is dropped
                    self._finish(request, reason)
                    break
            else:
                request.updated.set()
        self._progress.set()

    def _emit(self, request: Request, token: int, logprob: float, top: TopLogprobs | None) -> dict[str, Any] | None:
        """Append one output token to a request; the finish reason it causes, if any."""
        if top is not None:
            request.output_top.append(top)
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        if (request.weight_versions and request.weight_versions[-1] == self.weights.version
                and request.version_labels[-1] == self.weights.label):
            request.version_counts[-1] += 1
        else:  # the first token, or the first after a weight update (a partial rollout spans it)
            request.weight_versions.append(self.weights.version)
            request.version_labels.append(self.weights.label)
            request.version_counts.append(1)
        self._counters["generated_tokens"] += 1
        return stop_reason(request, token, self.tokenizer)

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        if request.phase is Phase.FINISHED:
            return
        if request.phase is Phase.RUNNING:
            if request.return_routed_experts:
                request.routed_experts_TLk = self._routed_experts(request)
            self._release_kv(request)
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        request.final_text = output_text(request, self.tokenizer)
        request.finished_s = time.perf_counter()
        self._counters["finished_requests"] += 1
        self._counters["aborted_requests"] += int(reason.get("type") == "abort")
        del self._requests[request.rid]
        request.updated.set()
        request.done.set()
        self._progress.set()

    def _routed_experts(self, request: Request) -> torch.Tensor | None:
        """Experts of every token with KV (prompt + output - 1 rows), read from the slots they were written to."""
        slots_cache = self.cache.expert_slots_TLk
        if slots_cache is None or request.num_computed == 0:
            return None
        size = self.cache.block_size
        slots = [request.blocks[p // size] * size + p % size for p in range(request.num_computed)]
        return compute.serial_index_select(slots_cache, torch.tensor(slots, dtype=torch.long))  # a host tensor
