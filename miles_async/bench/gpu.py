"""`miles-async bench gpu`: trainer, engine, weight sync and pause/resume on one GPU, beside its limits.

The model has Qwen3-0.6B's published shape (hidden 1024, 28 layers, 16 query and 8 kv heads of
128, MLP 3072, vocabulary 151,936, tied embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, q/k-norm)
and random weights (`models.random_init.init_weights`, seed 0, written in bf16): nothing is
downloaded. One run, on `--device` ("cuda": the process's current GPU), measures:

- machine: the bf16 (the trainer's and engine's compute dtype) matmul rate, `torch.mm` of
  8192-cubes, and the memory bandwidth, `copy_` of 1 GiB, both here and now
  (miles_async/bench/limits.py), and NVIDIA's published dense bf16 peak where the device is one
  of PUBLISHED_BF16_PEAKS;
- trainer: the trainer's own step (`trainer.step.Trainer`, one rank over NCCL, or gloo on a CPU;
  fp32 master weights and AdamW, compute_dtype "auto": bf16 autocast on a GPU; RL objective) at
  each `--tokens-per-step`, over samples of `--sample-tokens` (the first eighth of each a prompt,
  the rest trained) in micro-batches of `--micro-batch-tokens`. Each row has the shape of
  prime-rl's baseline files (benchmarks/baselines/*.json: `config`, and `metrics` with `mfu`,
  `throughput`, `step_time` as mean/std/min/max over the timed steps and `peak_memory` as
  gib/pct), so the figures compare. MFU counts the FLOPs the step does: 6 x the matmul weights
  outside the vocabulary projection x every token, 6 x the vocabulary projection x the trained
  tokens (the only ones scored), 3 x causal attention; over the step time and the published peak
  where known, else the measured one (`mfu_peak` says which; `mfu_of_measured_peak` beside it).
  Peak memory: `torch.cuda.max_memory_allocated` over the row's steps, of the device's total
  (null on a CPU: not measured there);
- engine: the embedded engine (`EngineConfig(device=..., dtype="auto", double_buffer=True)`),
  its decode step at each of `--batches` (the requests prefilled in one step, then the seconds
  of the decode steps that follow, over their number: `decode_step_s`) as tokens/s, beside the
  weight-streaming bound (the weights a step reads over the measured memory traffic) and the
  compute bound;
- weight_sync: the trainer's weights after its steps, pushed into the engine by each transport
  this machine has (colocated, shm on a CPU, CUDA IPC, broadcast over gloo and NCCL with two
  GPUs), each beside one copy of the bytes (miles_async/bench/gpu_parts.py);
- pause_resume: the pusher's cycle around an update with requests decoding (`pause("in_place")`,
  the update, `resume()`; `pause_resume_s` is its pause to resume) and the colocated loop's
  (`loop.offload_engines`: pause "abort" + release the weights and KV cache, resume them, push,
  resume), each beside one copy of the weights at the measured copy rate.

Every figure is measured in this run; the JSON records every setting. Progress goes to stderr,
the JSON to stdout. With `--device cuda` where no CUDA GPU is visible it prints one line to
stderr and a JSON object with `skipped` (and the machine), and exits 0. `--tiny` runs the same
code on the tiny model of the same family (init-model's qwen3 "tiny" preset) and small sizes:
about 15 s on two CPU cores, what tests/unit/test_bench_gpu.py runs; tests/gpu/run.sh runs the full one.

    miles-async bench gpu --json                          # sized for tests/gpu/run.sh's 150 s on one GPU
    miles-async bench gpu --json --device cpu --tiny      # the same code, ~15 s on two CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from miles_async.bench import limits
from miles_async.bench.gpu_parts import Named, sync, weight_sync
from miles_async.models import ModelConfig

QWEN3_0_6B = ModelConfig(family="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40_960,
                         tie_word_embeddings=True, qk_norm=True)
TINY_VOCAB = 512
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, FLOP/s; the first name found
# in the device's name wins (so "H100 PCIe" before "H100", the SXM part).
PUBLISHED_BF16_PEAKS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                        ("A100", 312e12), ("B200", 2250e12))
TIMEOUT_S = 120.0
SEED = 0


def _progress(line: str) -> None:
    print(f"[bench gpu] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """What one run measures, and how (all of it goes into the JSON)."""

    device: str
    tiny: bool
    tokens_per_step: tuple[int, ...]
    batches: tuple[int, ...]
    sample_tokens: int
    micro_batch_tokens: int
    steps: int  # timed trainer steps per row, after `warmup_steps`
    prompt_tokens: int  # of each decode request
    decode_steps: int
    sync_reps: int  # timed pushes per transport, after one warm-up
    matmul_n: int
    copy_mib: int
    warmup_steps: int = 1


# (full size on a GPU, full size on a CPU, --tiny) where a flag is not given
DEFAULTS: dict[str, tuple[Any, Any, Any]] = {
    "tokens_per_step": ((4096, 16384), (4096, 16384), (256, 1024)), "sample_tokens": (2048, 2048, 128),
    "micro_batch_tokens": (4096, 4096, 512), "steps": (3, 3, 2), "prompt_tokens": (64, 64, 16),
    "decode_steps": (32, 32, 8), "sync_reps": (3, 3, 2), "matmul_n": (8192, 2048, 256), "copy_mib": (1024, 512, 32)}


def _stats(values: list[float]) -> dict[str, float]:
    """prime-rl's shape: mean, std (sample), min, max."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def published_peak(device_name: str) -> tuple[float | None, str | None]:
    for key, flops in PUBLISHED_BF16_PEAKS:
        if key in device_name:
            return flops, f"NVIDIA {key} dense bf16, datasheet"
    return None, None


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpus": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "nccl_available": torch.distributed.is_nccl_available(),
                            "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, total_memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def measure_limits(device: torch.device, dtype: torch.dtype, settings: Settings) -> dict[str, Any]:
    copy = limits.copy_bandwidth(settings.copy_mib, device=str(device))
    rate = limits.matmul_rate(dtype, settings.matmul_n, repeats=10 if device.type == "cuda" else 3, device=str(device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak, source = published_peak(name) if dtype == torch.bfloat16 else (None, None)
    _progress(f"limits: {rate / 1e12:.1f} TFLOP/s {dtype} (torch.mm, n={settings.matmul_n}), memory traffic "
              f"{copy['traffic_bytes_per_s'] / 1e9:.0f} GB/s; published peak {peak and peak / 1e12} TFLOP/s")
    return {"matmul_dtype": str(dtype).removeprefix("torch."), "matmul_n": settings.matmul_n,
            "matmul_flops_per_s": rate, "copy": copy, "published_peak_flops_per_s": peak,
            "published_peak_source": source}


def write_model(cfg: ModelConfig, folder: Path, device: torch.device) -> Path:
    """The random-init model as a checkpoint folder (bf16), built on `device` (no CPU init of 0.6B)."""
    from miles_async.models import CausalLM, save_pretrained
    from miles_async.models.random_init import init_weights

    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes a new tensor per module: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    init_weights(model, SEED)
    save_pretrained(model.to(torch.bfloat16), folder)
    return folder


def rl_samples(num_samples: int, sample_tokens: int, vocab_size: int) -> list[Any]:
    from miles_async.trajectory import TokenData, Trajectory

    generator = torch.Generator().manual_seed(SEED)
    prompt = max(1, sample_tokens // 8)
    uniform = -math.log(vocab_size)  # a random model's log-prob of any token, about
    return [Trajectory(prompt_id=i, num_tokens=sample_tokens, num_prompt_tokens=prompt, reward=float(i % 2),
                       num_generated_tokens=sample_tokens - prompt, data=TokenData.build(
                           tokens=torch.randint(3, vocab_size, (sample_tokens,), generator=generator).tolist(),
                           loss_mask=[0] * prompt + [1] * (sample_tokens - prompt),
                           logprobs=[uniform] * sample_tokens)) for i in range(num_samples)]


def step_flops(cfg: ModelConfig, tokens: int, sample_tokens: int, trained_tokens: int) -> int:
    """FLOPs of one training step (forward and backward, module docstring)."""
    vocab_projection = cfg.vocab_size * cfg.hidden_size
    body = limits.matmul_params(cfg) - vocab_projection
    attention = limits.attention_flops(cfg, tokens, 1) * (sample_tokens + 1) // 2  # causal: (L + 1) / 2 keys each
    return 6 * body * tokens + 6 * vocab_projection * trained_tokens + 3 * attention


def train_row(trainer: Any, cfg: ModelConfig, tokens: int, settings: Settings, peaks: dict[str, Any],
              device_info: dict[str, Any]) -> dict[str, Any]:
    from miles_async.trainer.packing import plan_step

    device = trainer.device
    sample_tokens = min(settings.sample_tokens, tokens)
    samples = rl_samples(tokens // sample_tokens, sample_tokens, cfg.vocab_size)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    trained = sum(s.num_generated_tokens for s in samples)
    plan = plan_step(samples, 1, settings.micro_batch_tokens, trainer.config.policy_loss.aggregation, None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, num_micro = [], [], 0
    for i in range(settings.warmup_steps + settings.steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = trainer.train_step(samples, advantages, num_micro_batches=plan.num_micro_batches,
                                     denominator=plan.denominator)
        sync(device)
        if i >= settings.warmup_steps:
            times.append(time.perf_counter() - t0)
            losses.append(metrics.loss)
        num_micro = metrics.num_micro_batches
    flops = step_flops(cfg, tokens, sample_tokens, trained)
    measured = peaks["matmul_flops_per_s"]
    peak = peaks["published_peak_flops_per_s"] or measured
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    total = device_info.get("total_memory_bytes")
    row = {
        "config": {"type": "rl", "num_gpus": 1 if device.type == "cuda" else 0,
                   "model_name": "Qwen3-0.6B-shaped, random init" if not settings.tiny else "qwen3 tiny, random init",
                   "seq_len": tokens, "micro_batches": num_micro, "ac": "none", "attention": "sdpa",
                   "device_name": device_info["device_name"], "tokens_per_step": tokens, "sample_tokens": sample_tokens,
                   "num_samples": len(samples), "trained_tokens": trained,
                   "micro_batch_tokens": settings.micro_batch_tokens, "warmup_steps": settings.warmup_steps,
                   "steps": settings.steps, "master_dtype": trainer.config.dtype,
                   "compute_dtype": trainer.config.compute_dtype, "optimizer": "torch.optim.AdamW(fused=True)"},
        "metrics": {"mfu": _stats([100 * flops / t / peak for t in times]),
                    "throughput": _stats([tokens / t for t in times]), "step_time": _stats(times),
                    "peak_memory": {"gib": None if peak_bytes is None else peak_bytes / 2**30,
                                    "pct": None if peak_bytes is None or not total else 100 * peak_bytes / total}},
        "mfu_peak": peaks["published_peak_source"] or f"measured torch.mm {peaks['matmul_dtype']} rate",
        "mfu_of_measured_peak": _stats([100 * flops / t / measured for t in times]),
        "flops_per_step": flops, "step_s": times, "loss": losses[-1],
        "peak_memory_source": "torch.cuda.max_memory_allocated" if peak_bytes is not None else "not measured on a CPU"}
    _progress(f"trainer, {tokens} tokens a step: {row['metrics']['throughput']['mean']:,.0f} tokens/s, MFU "
              f"{row['metrics']['mfu']['mean']:.1f}%, {statistics.fmean(times):.3f} s a step")
    return row


def measure_trainer(model_dir: str, cfg: ModelConfig, settings: Settings, peaks: dict[str, Any],
                    device_info: dict[str, Any], engine_dtype: torch.dtype) -> tuple[list[dict[str, Any]], Named]:
    """The rows, and the trained weights in the engine's dtype on the trainer's device (to push)."""
    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.fsdp import single_process_group
    from miles_async.trainer.step import Trainer

    backend = "nccl" if settings.device == "cuda" else "gloo"
    with single_process_group(backend, timeout_s=TIMEOUT_S) as device:
        trainer = Trainer(TrainerConfig(model_dir=model_dir, micro_batch_tokens=settings.micro_batch_tokens,
                                        compute_dtype="auto", backend=backend), device)
        rows = [train_row(trainer, cfg, tokens, settings, peaks, device_info) for tokens in settings.tokens_per_step]
        trained = {name: p.detach().to(engine_dtype, copy=True).contiguous()
                   for name, p in trainer.model.named_parameters()}
        del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's memory back before the engine starts
    return rows, trained


def pause_workload(settings: Settings) -> tuple[int, int]:
    """Requests decoding while `pause_resume` pauses, and the tokens each generates."""
    return (4, 16) if settings.tiny else (8, 64)


def engine_config(cfg: ModelConfig, settings: Settings, dtype: torch.dtype) -> Any:
    from miles_async.engine import EngineConfig

    longest = settings.prompt_tokens + max(settings.decode_steps + 1, pause_workload(settings)[1])
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    # every decode request's blocks at once, rounded up per request, and half again
    kv_bytes = max(settings.batches) * (longest + EngineConfig().block_size) * kv_bytes_per_token * 1.5
    return EngineConfig(device=settings.device, dtype="auto", double_buffer=True, max_seq_len=2 * longest,
                        kv_cache_mib=max(16.0, math.ceil(kv_bytes / 2**20)),
                        max_running_requests=max(256, max(settings.batches)),
                        max_prefill_tokens=max(EngineConfig().max_prefill_tokens,
                                               max(settings.batches) * settings.prompt_tokens))


def _request(prompt: list[int], num_tokens: int) -> Any:
    from miles_async.engine import GenerateRequest, SamplingParams

    return GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_new_tokens=num_tokens, ignore_eos=True))


def _prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


async def decode_step_s(engine: Any, batch: int, prompt_tokens: int, decode_steps: int) -> float:
    """One decode step's seconds with `batch` requests decoding: all submitted at once (one prefill
    step: max_prefill_tokens holds every prompt), then, once they have their first token, the time
    from a pause between two steps (`pause("in_place")`, at once resumed) to the last request's
    end, over the steps run meanwhile, which are all decode steps of the whole batch. Best of two
    after a warm-up."""
    best = float("inf")
    for attempt in range(3):
        await engine.flush_cache()
        states = [engine.submit(_request(p, 1 + decode_steps))
                  for p in _prompts(batch, prompt_tokens, engine.vocab_size, seed=batch + attempt)]
        async for out in engine.stream(states[-1]):  # the prefill step is done
            if out.completion_tokens >= 1:
                break
        await engine.pause("in_place")  # between two steps
        t0, steps0 = time.perf_counter(), engine.stats().num_steps
        await engine.resume()
        await asyncio.wait_for(asyncio.gather(*(state.done.wait() for state in states)), TIMEOUT_S)
        seconds, num_steps = time.perf_counter() - t0, engine.stats().num_steps - steps0
        assert num_steps >= 1 and all(len(s.output_ids) == 1 + decode_steps for s in states), \
            "every request generates exactly its length, in decode steps after the pause"
        if attempt:  # the first is the warm-up
            best = min(best, seconds / num_steps)
    return best


async def engine_rows(engine: Any, cfg: ModelConfig, settings: Settings, peaks: dict[str, Any],
                      bandwidth: dict[str, float]) -> list[dict[str, Any]]:
    dtype = next(engine.model.parameters()).dtype
    rows = []
    for batch in settings.batches:
        step_s = await decode_step_s(engine, batch, settings.prompt_tokens, settings.decode_steps)
        bounds = limits.decode_step_bounds(cfg, batch, settings.prompt_tokens + settings.decode_steps // 2, dtype,
                                           bandwidth, peaks["matmul_flops_per_s"])
        bound_s = bounds["weight_streaming_bound_s"]
        rows.append({"batch": batch, "step_s": step_s, "tokens_per_s": batch / step_s,
                     "weight_streaming_bound_s": bound_s, "bound_tokens_per_s": batch / bound_s,
                     "over_bound": step_s / bound_s, "compute_bound_s": bounds["compute_bound_s"],
                     "weight_bytes": bounds["weight_bytes"]})
        _progress(f"engine, batch {batch}: {batch / step_s:,.0f} tokens/s ({step_s * 1e3:.2f} ms a step; weight "
                  f"streaming bound {bound_s * 1e3:.2f} ms, {step_s / bound_s:.1f}x it)")
    return rows


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.memory_allocated(device)


async def pause_resume(engine: Any, trained: Named, settings: Settings, copy_bytes_per_s: float) -> dict[str, Any]:
    """The pusher's cycle with requests decoding, then the colocated loop's offload cycle."""
    num_requests, num_tokens = pause_workload(settings)
    states = [engine.submit(_request(p, num_tokens))
              for p in _prompts(num_requests, settings.prompt_tokens, engine.vocab_size, seed=7)]
    async for out in engine.stream(states[-1]):  # every request admitted and decoding
        if out.completion_tokens >= 2:
            break
    t0 = time.perf_counter()
    await engine.pause("in_place")
    t1 = time.perf_counter()
    await engine.weights.update_from_tensors(trained, engine.weights.version + 1)
    sync(engine.device)
    t2 = time.perf_counter()
    await engine.resume()
    t3 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(state.done.wait() for state in states)), TIMEOUT_S)
    outs = [engine.snapshot(state) for state in states]
    nbytes = sum(t.numel() * t.element_size() for t in trained.values())
    in_place = {"mode": "in_place", "num_requests": num_requests, "pause_s": t1 - t0, "update_s": t2 - t1,
                "resume_s": t3 - t2, "pause_to_resume_s": t3 - t0,
                "all_finished": all(o.finish_reason and o.finish_reason["type"] == "length" for o in outs),
                "versions_per_request": max(len(o.weight_versions) for o in outs)}
    before = _allocated(engine.device)
    t0 = time.perf_counter()
    await engine.pause("abort")
    await engine.release_memory_occupation(None)
    t1 = time.perf_counter()
    released = _allocated(engine.device)
    await engine.resume_memory_occupation(None)
    t2 = time.perf_counter()
    await engine.weights.update_from_tensors(trained, engine.weights.version + 1)
    sync(engine.device)
    t3 = time.perf_counter()
    await engine.resume()
    t4 = time.perf_counter()
    offload = {"mode": "release weights and kv_cache (loop.offload_engines)", "release_s": t1 - t0,
               "resume_memory_s": t2 - t1, "update_s": t3 - t2, "resume_s": t4 - t3, "pause_to_resume_s": t4 - t0,
               "freed_bytes": None if before is None or released is None else before - released,
               "serves_after": (await engine.generate(_request([5, 9, 13], 2))).completion_tokens == 2}
    copy_s = nbytes / copy_bytes_per_s
    for cycle in (in_place, offload):
        cycle["weights_copy_bound_s"] = copy_s
        cycle["over_copy_bound"] = cycle["pause_to_resume_s"] / copy_s
    _progress(f"pause to resume: {in_place['pause_to_resume_s'] * 1e3:.1f} ms around an update in place, "
              f"{offload['pause_to_resume_s'] * 1e3:.1f} ms with the memory released")
    return {"pause_resume_s": in_place["pause_to_resume_s"], "pause_resume": {"in_place": in_place, "offload": offload}}


async def measure_engine(model_dir: str, cfg: ModelConfig, settings: Settings, peaks: dict[str, Any],
                         trained: Named) -> dict[str, Any]:
    from miles_async.engine import Engine

    config = engine_config(cfg, settings, next(iter(trained.values())).dtype)
    engine = Engine.from_pretrained(model_dir, config=config)
    copy_rate = peaks["copy"]["copied_bytes_per_s"]
    async with engine:
        rows = await engine_rows(engine, cfg, settings, peaks, peaks["copy"])
        cycles = await pause_resume(engine, trained, settings, copy_rate)
        sync_rows = await weight_sync(engine, model_dir, config, trained, settings.sync_reps, copy_rate, _progress)
    return {"engine": {"config": msgspec.to_builtins(config), "dtype": str(next(engine.model.parameters()).dtype),
                       "prompt_tokens": settings.prompt_tokens, "decode_steps": settings.decode_steps,
                       "batches": rows},
            "weight_sync": sync_rows, **cycles}


def measure(settings: Settings) -> dict[str, Any]:
    from miles_async.engine import compute
    from miles_async.kernels.precision import auto_dtype
    from miles_async.trainer.config import TrainerConfig

    device = torch.device("cpu") if settings.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    cfg = _tiny_config() if settings.tiny else QWEN3_0_6B
    trainer_dtype = getattr(torch, TrainerConfig(compute_dtype="auto").on_device(device).compute_dtype)
    engine_dtype = getattr(torch, auto_dtype("auto", device))
    info = machine(device)
    # all torch work on the engine's compute thread, the trainer's too (one OpenMP team on a CPU:
    # miles_async/engine/compute.py)
    peaks = compute.run_sync(measure_limits, device, trainer_dtype, settings)
    info["limits"] = peaks
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        t0 = time.perf_counter()
        model_dir = str(compute.run_sync(write_model, cfg, Path(tmp) / "model", device))
        _progress(f"model written in {time.perf_counter() - t0:.1f} s")
        rows, trained = compute.run_sync(measure_trainer, model_dir, cfg, settings, peaks, info, engine_dtype)
        rest = asyncio.run(measure_engine(model_dir, cfg, settings, peaks, trained))
    num_params = _num_params(cfg)
    return {"bench": "gpu", "machine": info,
            "model": {"name": "Qwen3-0.6B-shaped" if not settings.tiny else "qwen3 tiny", "weights": "random",
                      "seed": SEED, "config": msgspec.to_builtins(cfg), "num_params": num_params,
                      "matmul_params": limits.matmul_params(cfg),
                      "weight_bytes": num_params * engine_dtype.itemsize, "engine_dtype": str(engine_dtype)},
            "settings": dataclasses.asdict(settings), "trainer": rows, **rest}


def _num_params(cfg: ModelConfig) -> int:
    """Distinct parameters (a tied embedding once), counted on the meta device."""
    from miles_async.models import CausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(cfg).parameters())


def _tiny_config() -> ModelConfig:
    from miles_async.models.random_init import preset_config

    return preset_config("qwen3", "tiny", TINY_VOCAB)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def settings_of(args: argparse.Namespace) -> Settings:
    column = 2 if args.tiny else 0 if args.device == "cuda" else 1
    picked = {name: getattr(args, name) if getattr(args, name) is not None else values[column]
              for name, values in DEFAULTS.items()}
    return Settings(device=args.device, tiny=args.tiny, batches=args.batches, **picked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON on one line")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the current GPU (default; without one it skips); cpu: the same code on the CPU")
    parser.add_argument("--tiny", action="store_true", help="the tiny qwen3 model and small sizes (~15 s on two CPU cores)")
    parser.add_argument("--tokens-per-step", type=_ints, help="trainer rows (default 4096,16384; --tiny 256,1024)")
    parser.add_argument("--batches", type=_ints, default=(1, 64), help="engine decode batches (default 1,64)")
    parser.add_argument("--sample-tokens", type=int, help="tokens of each training sample (default 2048; --tiny 128)")
    parser.add_argument("--micro-batch-tokens", type=int,
                        help="the trainer's micro_batch_tokens (default 4096, the trainer's own)")
    parser.add_argument("--steps", type=int, help="timed trainer steps per row, after one warm-up (default 3)")
    parser.add_argument("--prompt-tokens", type=int, help="each decode request's prompt (default 64; --tiny 16)")
    parser.add_argument("--decode-steps", type=int, help="decode steps timed per batch (default 32; --tiny 8)")
    parser.add_argument("--sync-reps", type=int, help="timed pushes per weight transport (default 3)")
    parser.add_argument("--matmul-n", type=int, help="the matmul peak's cube side (default 8192 on a GPU)")
    parser.add_argument("--copy-mib", type=int, help="the bandwidth's buffer, MiB (default 1024 on a GPU)")
    args = parser.parse_args(argv)
    settings = settings_of(args)
    sizes = {name: value for name, value in dataclasses.asdict(settings).items() if type(value) is int}
    if bad := [name for name, value in sizes.items() if value < 1 and name != "warmup_steps"]:
        parser.error(f"--{bad[0].replace('_', '-')} must be >= 1, got {sizes[bad[0]]}")
    if odd := [t for t in settings.tokens_per_step if t % min(settings.sample_tokens, t)]:
        parser.error(f"--tokens-per-step {odd[0]} is not a multiple of --sample-tokens {settings.sample_tokens}")
    if settings.micro_batch_tokens < min(settings.sample_tokens, max(settings.tokens_per_step)):
        parser.error(f"--micro-batch-tokens {settings.micro_batch_tokens} is below a sample's "
                     f"{settings.sample_tokens} tokens: a sample must fit one micro-batch")
    if settings.device == "cuda" and not torch.cuda.is_available():
        reason = ("needs a CUDA GPU and none is visible (torch "
                  f"{torch.__version__}, CUDA {torch.version.cuda}, "
                  f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        print(f"miles-async bench gpu: {reason}; skipping (--device cpu --tiny runs it on the CPU)", file=sys.stderr)
        print(json.dumps({"bench": "gpu", "skipped": reason, "machine": machine(torch.device("cpu"))},
                         indent=None if args.json else 1))
        return 0
    result = measure(settings)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
