"""`miles-async bench engine --speculative`: the embedded engine with and without speculative decoding.

The model is `bench engine`'s (the peer note's random-init Qwen2: hidden 256, 4 layers, vocab 1024,
or init_model's qwen2 "small" without transformers). Its draft head is first distilled offline
(`models.draft.distill_head`, 100 steps) on 96 of the model's own outputs (64 tokens after 16-token prompts,
half greedy, half at temperature 1), then every figure is measured on other prompts (held out).
For each batch size (1, 8, 64 by default: that many requests submitted at once, 16-token prompts,
`--spec-tokens` (128) output tokens each, EOS ignored), greedy and at temperature 1, it runs the
same requests through an engine without speculation and with k drafts a step (`k3`: adapted per
request, the default; `k3_fixed`: always k), and reports tokens/s, the ratio to the engine without
speculation, the fraction of drafts accepted and the tokens per decoding step.
The ratio is the figure (both in this run, on this machine). Progress on stderr, JSON on stdout.

    miles-async bench engine --speculative --json
    miles-async bench engine --speculative --json --spec-k 2,4 --spec-batches 1,16
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

import torch

from miles_async.engine import Engine, EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.models import load_pretrained
from miles_async.models.draft import distill_head
from miles_async.models.loading import save_pretrained

PROMPT_TOKENS = 16


def _prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, PROMPT_TOKENS), generator=gen).tolist()


async def _run(model_dir: str, prompts: list[list[int]], params: SamplingParams,
               config: EngineConfig) -> dict[str, Any]:
    engine = Engine.from_pretrained(model_dir, config=config)
    async with engine:
        warm = SamplingParams(temperature=params.temperature, max_new_tokens=8, ignore_eos=True)
        await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=warm)) for p in prompts))
        await engine.flush_cache()
        before = engine.stats()
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=params))
                                      for p in prompts))
        wall_s = time.perf_counter() - t0
        after = engine.stats()
    tokens = sum(len(o.output_ids) for o in outs)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    verifies = after.num_spec_verifies - before.num_spec_verifies
    return {"tokens_per_s": round(tokens / wall_s, 1), "wall_s": round(wall_s, 3), "num_steps": after.num_steps -
            before.num_steps, "accept_rate": round((after.num_accepted_drafts - before.num_accepted_drafts)
                                                   / drafted, 4) if drafted else None,
            "accept_length": round(sum(o.completion_tokens for o in outs) / verifies, 3) if verifies else None}


def draft_model(model_dir: str, out_dir: str, *, seed: int = 0, steps: int = 100) -> dict[str, Any]:
    """Write `model_dir`'s model with a draft head distilled on its own outputs to `out_dir`."""
    model = load_pretrained(model_dir)
    prompts = _prompts(96, model.config.vocab_size, seed + 1000)
    kinds = [SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True),
             SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)]

    async def outputs() -> list[list[int]]:
        engine = Engine.from_pretrained(model_dir, config=EngineConfig(kv_cache_mib=256))
        async with engine:
            outs = await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=kinds[i % 2]))
                                          for i, p in enumerate(prompts)))
        return [o.output_ids for o in outs]

    t0 = time.perf_counter()
    sequences = torch.tensor([p + o for p, o in zip(prompts, asyncio.run(outputs()))])
    curve = distill_head(model, sequences, PROMPT_TOKENS, steps=steps)
    save_pretrained(model, out_dir)
    return {"distill_steps": steps, "draft_ce_first": round(curve[0], 3), "draft_ce_last": round(curve[-1], 3),
            "distill_s": round(time.perf_counter() - t0, 1),
            "draft_parameters": sum(p.numel() for p in model.mtp.parameters())}  # type: ignore[union-attr]


def measure(model_dir: str, *, ks: list[int], batches: list[int], output_tokens: int, seed: int = 0,
            progress: Any = print, distill_steps: int = 100) -> dict[str, Any]:
    """The JSON of `bench engine --speculative` (module docstring), for the model in `model_dir`."""
    with tempfile.TemporaryDirectory() as tmp:
        drafted = os.path.join(tmp, "drafted")
        progress("distilling the draft head on the model's own outputs")
        head = draft_model(model_dir, drafted, seed=seed, steps=distill_steps)
        vocab = load_pretrained(drafted).config.vocab_size
        results: dict[str, Any] = {}
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_new_tokens=output_tokens, ignore_eos=True)
            for batch in batches:
                prompts = _prompts(batch, vocab, seed + batch)
                kv = max(64.0, batch * 0.5)
                plain = asyncio.run(_run(drafted, prompts, params, EngineConfig(kv_cache_mib=kv)))
                row: dict[str, Any] = {"plain_tokens_per_s": plain["tokens_per_s"]}
                for k in ks:
                    for adaptive, name in ((True, f"k{k}"), (False, f"k{k}_fixed")):
                        spec = asyncio.run(_run(drafted, prompts, params, EngineConfig(
                            kv_cache_mib=kv, speculative_tokens=k, speculative_adaptive=adaptive)))
                        row[name] = {**spec, "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3)}
                key = f"{'greedy' if temperature == 0 else 'temperature_1'}/batch_{batch}"
                results[key] = row
                progress(f"{key}: {row}")
    return {"workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": output_tokens, "batches": batches,
                         "k": ks, "held_out": "draft distilled on other prompts' outputs"},
            "draft": head, "threads": torch.get_num_threads(), "results": results}
