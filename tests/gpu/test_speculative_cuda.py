"""Speculative decoding in the embedded engine on CUDA: greedy outputs and log-probs equal the
non-speculative CUDA engine's (batch-invariant mode: bit for bit), drafts are accepted, and a
sampled workload (seeded, top-k) runs with the drafts drawn and judged on the GPU.

GPU only: skipped, with the reason, where no CUDA GPU is available. The CPU side:
tests/unit/test_speculative.py (and its chi-square test of the distribution)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from _support_gpu import cuda_nccl_skip_reason

from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.models import init_model, load_pretrained
from miles_async.models.draft import distill_head
from miles_async.models.loading import save_pretrained

pytestmark = [pytest.mark.skipif(cuda_nccl_skip_reason() is not None, reason=str(cuda_nccl_skip_reason())),
              pytest.mark.timeout(300)]


def prompts(count: int, seed: int) -> list[list[int]]:
    return torch.randint(3, 500, (count, 4), generator=torch.Generator().manual_seed(seed)).tolist()


async def generate(folder: Path, requests: list[GenerateRequest], **config: object) -> tuple[list, object]:
    engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=64, device="cuda", **config))
    async with engine:
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        return outs, engine.stats()


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spec_cuda")
    folder = init_model("qwen3", "tiny", root / "policy")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    outs, _ = asyncio.run(generate(folder, [GenerateRequest(input_ids=p, sampling_params=greedy)
                                            for p in prompts(96, 1)]))
    model = load_pretrained(folder)
    distill_head(model, torch.tensor([p + o.output_ids for p, o in zip(prompts(96, 1), outs)]), 4, steps=150)
    return save_pretrained(model, root / "drafted")


def test_greedy_outputs_and_logprobs_equal_without_speculation_on_cuda(drafted: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling_params=greedy, return_logprob=True) for p in prompts(32, 2)]
    plain, _ = asyncio.run(generate(drafted, requests, batch_invariant=True))
    spec, stats = asyncio.run(generate(drafted, requests, batch_invariant=True, speculative_tokens=3))
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
    assert [o.output_token_logprobs for o in spec] == [o.output_token_logprobs for o in plain]
    assert stats.num_accepted_drafts > 0


def test_sampled_drafts_are_drawn_and_judged_on_cuda(drafted: Path) -> None:
    kinds = [SamplingParams(temperature=1.0, top_k=8, max_new_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, ignore_eos=True, sampling_seed=5)]
    requests = [GenerateRequest(input_ids=p, sampling_params=kinds[i % 2], return_logprob=True)
                for i, p in enumerate(prompts(32, 3))]
    outs, stats = asyncio.run(generate(drafted, requests, speculative_tokens=3))
    assert all(len(o.output_ids) == 24 and len(o.output_token_logprobs) == 24 for o in outs)
    assert stats.num_accepted_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_drafts
