"""`miles-async bench engine`: the embedded engine beside transformers' `generate`, same model, same run.

Workload (seeded): `--num-requests` requests (256) with prompts of 16 to 128 tokens and
long-tailed output lengths (log-normal, median 48, clipped to 16..512), greedy, EOS ignored so
every request produces exactly its length. Our side submits them all at once to one in-process
`Engine` (continuous batching); the peer (bench/engine_peers.py) runs them through HF `generate`
in static batches of 8. Both are credited with the same useful tokens; the figure is the ratio
of tokens/s. The second peer, when `.venv-vllm` exists (`python3 dev.py vllm`), is vLLM's CPU
build (0.32) serving the same model over HTTP, given the same number of worker threads as our
engine's torch threads and no reserved core (vLLM reserves one by default); its figure is
compared with our engine over HTTP (`http_throughput_vs_vllm`), null without it. Then a multi-turn workload where every turn's prompt is the previous turn's prompt
and output plus a new user message, sessions running concurrently: the prefix-cache hit rate
(cached prompt tokens / prompt tokens, over the turns that have a previous turn).

The model is the peer note's (/work/shared/peers/hf_generate.py: a random-init Qwen2, hidden 256,
4 layers, vocab 1024), written by transformers to a temporary folder that both sides load; HF
generate is also timed in the note's own setting, to compare with the figure the note quotes.
Our engine is measured in process and through its HTTP API with `EngineClient`. Progress goes to
stderr, the JSON to stdout.

    miles-async bench engine --json
    miles-async bench engine --json --num-requests 64 --max-output 128    # a quick look
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
from typing import Any

import torch

from miles_async.bench.engine_peers import (
    PEER_NOTE_MODEL,
    hf_reference_point,
    hf_static_batches,
    vllm_available,
    vllm_server_throughput,
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
            with_vllm: bool = True) -> dict[str, Any]:
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
            peer = compute.run_sync(hf_static_batches, model_dir, workload, PEER_BATCH_SIZE, _progress)
            peer["reference_point"] = {"batch_size": 8, "prompt_tokens": 16, "new_tokens": 64,
                                       "tokens_per_s": compute.run_sync(hf_reference_point, model_dir),
                                       "peer_note_tokens_per_s": 3912}
            _progress(f"HF generate, static batches of {PEER_BATCH_SIZE}: {peer['tokens_per_s']:,.0f} tokens/s "
                      f"in {peer['wall_s']} s (peer note's setting: {peer['reference_point']['tokens_per_s']:,.0f})")
        vllm: dict[str, Any] | None = None
        vllm_missing = vllm_available() if with_peer and with_vllm else "--no-peer" if not with_peer else "--no-vllm"
        if vllm_missing is None:
            vllm = asyncio.run(vllm_server_throughput(model_dir, workload, torch.get_num_threads(),
                                                      int(config.kv_cache_mib * 2**20), _progress))
            _progress(f"vLLM (CPU build, over HTTP): {vllm['tokens_per_s']:,.0f} tokens/s in {vllm['wall_s']} s")
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
                   # worker beside its API server and engine core
                   "http_throughput_vs_vllm": round(http["tokens_per_s"] / vllm["tokens_per_s"], 2) if vllm else None,
                   "targets": TARGETS,
                   "meets_targets": ratio is not None and ratio >= TARGETS["throughput_vs_hf"]
                   and multiturn["prefix_cache_hit_rate"] >= TARGETS["prefix_cache_hit_rate"]},
    }


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
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.max_output < 16 or args.num_sessions < 1 or args.num_turns < 2:
        parser.error("need --num-requests >= 1, --max-output >= 16, --num-sessions >= 1, --num-turns >= 2")
    config = EngineConfig(max_running_requests=args.max_running_requests)
    result = measure(args.num_requests, args.max_output, not args.no_peer, seed=args.seed, config=config,
                     num_sessions=args.num_sessions, num_turns=args.num_turns, with_vllm=not args.no_vllm)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
