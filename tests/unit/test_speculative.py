"""Speculative decoding in the embedded engine (engine/speculative.py, models/draft.py): greedy outputs
equal the non-speculative engine's, sampled tokens keep the policy's distribution (chi-square),
log-probs are the policy's; with the prefix cache, top-k lists, retraction and weight updates.

The draft head is first distilled (models.draft.draft_loss) on the tiny policy's own samples, so
that drafts are accepted often: every test checks that some were, or it would test nothing."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest
import torch

from miles_async.engine import speculative
from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams, filtered_log_probs
from miles_async.models import init_model, load_pretrained
from miles_async.models.draft import distill_head
from miles_async.models.loading import save_pretrained
from tests.unit._support_engine import mixed_workload, run_workload

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # ~45 s in all (CI runs them)
PROMPT_LEN = 4


async def _generate(folder: Path, requests: list[GenerateRequest], **config: object) -> tuple[list, object]:
    engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=32, **config))
    async with engine:
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        return outs, engine.stats()


def _prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, PROMPT_LEN), generator=gen).tolist()


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a draft head distilled on 192 of its own samples (half at temperature 1
    with top-k 8, half greedy)."""
    root = tmp_path_factory.mktemp("spec")
    folder = init_model("qwen3", "tiny", root / "policy")
    model = load_pretrained(folder)
    prompts = _prompts(192, model.config.vocab_size, seed=7)
    kinds = [SamplingParams(temperature=1.0, top_k=8, max_new_tokens=32, ignore_eos=True),
             SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)]
    outs, _ = asyncio.run(_generate(folder, [GenerateRequest(input_ids=p, sampling_params=kinds[i % 2])
                                             for i, p in enumerate(prompts)]))
    seqs = torch.tensor([p + o.output_ids for p, o in zip(prompts, outs)])
    curve = distill_head(model, seqs, PROMPT_LEN, steps=150)
    assert curve[-1] < curve[0]
    out = save_pretrained(model, root / "drafted")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, out / name)
    return out


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_outputs_and_logprobs_equal_the_non_speculative_engine(drafted: Path, batch_invariant: bool) -> None:
    vocab = load_pretrained(drafted).config.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling_params=params, return_logprob=True)
                for p in _prompts(48, vocab, seed=3)]
    plain, _ = asyncio.run(_generate(drafted, requests, batch_invariant=batch_invariant))
    spec, stats = asyncio.run(_generate(drafted, requests, batch_invariant=batch_invariant, speculative_tokens=3))
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
    tolerance = 0.0 if batch_invariant else 1e-5
    for a, b in zip(spec, plain):
        assert max(abs(x - y) for x, y in zip(a.output_token_logprobs, b.output_token_logprobs)) <= tolerance
    assert stats.num_accepted_drafts > 0.15 * stats.num_draft_tokens, stats  # the accept path ran, often
    out = spec[0]
    assert out.spec_verify_ct > 0 and out.spec_accepted_drafts <= out.spec_draft_tokens
    assert out.completion_tokens == 40


def _chi_square(a: list[int], b: list[int]) -> tuple[float, float]:
    """The two-sample chi-square statistic (categories seen fewer than 10 times together merged into
    one) and its critical value at p = 0.001 (Wilson-Hilferty's approximation of the quantile)."""
    counts = {c: (a.count(c), b.count(c)) for c in set(a) | set(b)}
    rare = [c for c, (ca, cb) in counts.items() if ca + cb < 10]
    cells = [v for c, v in counts.items() if c not in rare]
    if rare:
        cells.append((sum(counts[c][0] for c in rare), sum(counts[c][1] for c in rare)))
    na, nb = len(a), len(b)
    stat = sum((ca * math.sqrt(nb / na) - cb * math.sqrt(na / nb)) ** 2 / (ca + cb) for ca, cb in cells)
    df = len(cells) - 1
    z = 3.0902  # the standard normal's 0.999 quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_keep_the_policy_distribution(drafted: Path) -> None:
    """3000 samples of one prompt with and without speculation (temperature 1, top-k 8): at each of
    the positions drafted (2 to 5), the token frequencies agree within the chi-square bound at
    p = 0.001; and each token's log-prob is the policy's filtered log-prob of it."""
    vocab = load_pretrained(drafted).config.vocab_size
    prompt = _prompts(1, vocab, seed=11)[0]
    params = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=5, ignore_eos=True)
    requests = [GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True) for _ in range(3000)]
    plain, _ = asyncio.run(_generate(drafted, requests, max_running_requests=64))
    spec, stats = asyncio.run(_generate(drafted, requests, max_running_requests=64, speculative_tokens=3, seed=1))
    assert stats.num_accepted_drafts > 0.15 * stats.num_draft_tokens, stats
    for position in range(1, 5):
        # the token at `position` given the one before it, for the predecessor most frequent in both
        # runs together: ~180 of 3,000 in each, so 100 is ~6 sigma away (the runs are seeded, but
        # their streams differ by CPU: a floor of 150 failed on one at exactly 150)
        before = max({o.output_ids[position - 1] for o in plain},
                     key=lambda t: sum(o.output_ids[position - 1] == t for o in [*plain, *spec]))
        a = [o.output_ids[position] for o in plain if o.output_ids[position - 1] == before]
        b = [o.output_ids[position] for o in spec if o.output_ids[position - 1] == before]
        assert len(a) > 100 and len(b) > 100, (position, len(a), len(b))
        stat, critical = _chi_square(a, b)
        assert stat < critical, (position, stat, critical, len(a), len(b))
    # log-probs: the policy's filtered distribution, recomputed densely
    model = load_pretrained(drafted)
    seqs = torch.tensor([prompt + o.output_ids for o in spec[:64]])
    with torch.no_grad():
        logits_BTV = model(seqs)
    for row, out in enumerate(spec[:64]):
        logp_TV = filtered_log_probs(logits_BTV[row, len(prompt) - 1:-1].float(), [params] * 5)
        expected = logp_TV.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.output_token_logprobs), expected, atol=1e-5)


def test_the_mixed_workload_runs_speculating(drafted: Path) -> None:
    """Greedy, seeded and unseeded sampling with top-k/top-p, prompt log-probs, top-k lists and a
    prefix-cache hit: greedy outputs and every prompt log-prob as without speculation."""
    vocab = load_pretrained(drafted).config.vocab_size
    requests = mixed_workload(vocab, moe=False, max_new_tokens=24)

    async def run(**config: object) -> list[dict]:
        engine = Engine.from_pretrained(str(drafted), config=EngineConfig(kv_cache_mib=32, batch_invariant=True,
                                                                          **config))
        async with engine:
            return await run_workload(engine, requests)

    plain, spec = asyncio.run(run()), asyncio.run(run(speculative_tokens=4))
    for request, a, b in zip(requests, plain, spec):
        assert a["input_logprobs"] == b["input_logprobs"]
        assert len(b["output_ids"]) == 24 and len(b["output_logprobs"]) == 24
        if b["output_top"] is not None:
            assert len(b["output_top"]) == 24
            for (logprob, token), top in zip(zip(b["output_logprobs"], b["output_ids"]), b["output_top"]):
                assert {t: lp for lp, t in top}.get(token, logprob) == pytest.approx(logprob, abs=1e-6)
        if request.sampling_params.greedy:
            assert a["output_ids"] == b["output_ids"] and a["output_logprobs"] == b["output_logprobs"]


def test_retraction_and_weight_updates_keep_greedy_outputs(drafted: Path, tmp_path: Path) -> None:
    """A KV cache too small for all (requests are retracted and re-prefilled mid-decode), then an update
    to other weights (from a checkpoint without a draft head: the engine keeps its own): greedy
    outputs equal the non-speculative engine's in both."""
    vocab = load_pretrained(drafted).config.vocab_size
    other = init_model("qwen3", "tiny", tmp_path / "other", seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling_params=params) for p in _prompts(24, vocab, seed=5)]

    async def run(**config: object) -> tuple[list[list[int]], list[list[int]], int, int]:
        engine = Engine.from_pretrained(str(drafted), config=EngineConfig(kv_cache_mib=0.4, block_size=8, max_seq_len=64,
                                                                          **config))
        async with engine:
            first = await asyncio.gather(*(engine.generate(r) for r in requests))
            retractions = engine.stats().num_retractions
            await engine.weights.update_from_disk(str(other))
            second = await asyncio.gather(*(engine.generate(r) for r in requests))
            return ([o.output_ids for o in first], [o.output_ids for o in second], retractions,
                    engine.stats().num_accepted_drafts)

    plain_first, plain_second, _, _ = asyncio.run(run(batch_invariant=True))
    spec_first, spec_second, retractions, accepted = asyncio.run(run(batch_invariant=True, speculative_tokens=3))
    assert retractions > 0 and accepted > 0
    assert spec_first == plain_first and spec_second == plain_second


def test_the_draft_head_loads_with_the_model_and_bad_settings_are_refused(drafted: Path) -> None:
    model = load_pretrained(drafted)
    assert model.mtp is not None and any(name.startswith("mtp.") for name in model.state_dict())
    with pytest.raises(ValueError, match="speculative_tokens must be in"):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ValueError, match="LoRA or a weight_format"):
        EngineConfig(speculative_tokens=2, weight_format="int4")


def test_adaptive_drafting_stops_when_drafts_fail_and_keeps_on_when_they_pass(drafted: Path, tmp_path: Path) -> None:
    """A head that has learnt nothing (the seeded one of a fresh model) drafts greedily in vain: the
    adaptive engine soon drafts one token in eight steps, the fixed one three every step, with the
    same outputs. The distilled head keeps drafting."""
    record = (1.0, 1.0)
    for _ in range(4):  # four steps with none of 3 drafts accepted: below the bar
        record = speculative.judged(record, 3, 0)
    assert speculative.acceptance(record) < speculative.MIN_ACCEPTANCE
    assert speculative.acceptance(speculative.judged((1.0, 1.0), 3, 0)) > speculative.MIN_ACCEPTANCE
    # accepting 1 of 3 judges 2 drafts (the refused one too), 3 of 3 judges 3
    assert speculative.judged((0.0, 0.0), 3, 1) == pytest.approx((0.3, 0.6))
    assert speculative.judged((0.0, 0.0), 3, 3) == pytest.approx((0.9, 0.9))
    assert speculative.judged((0.5, 1.0), 0, 0) == (0.5, 1.0)
    fresh = init_model("qwen3", "tiny", tmp_path / "fresh", seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling_params=params) for p in _prompts(8, 512, seed=9)]
    fixed, fixed_stats = asyncio.run(_generate(fresh, requests, speculative_tokens=3, speculative_adaptive=False))
    adaptive, stats = asyncio.run(_generate(fresh, requests, speculative_tokens=3))
    assert [o.output_ids for o in adaptive] == [o.output_ids for o in fixed]
    assert fixed_stats.num_draft_tokens > 2.8 * fixed_stats.num_spec_verifies  # (fewer near max_new_tokens)
    assert stats.num_draft_tokens < 0.3 * fixed_stats.num_draft_tokens, (stats, fixed_stats)
    _, trained = asyncio.run(_generate(drafted, requests, speculative_tokens=3))
    per_step = trained.num_draft_tokens / trained.num_spec_verifies
    assert per_step > 3 * stats.num_draft_tokens / stats.num_spec_verifies and trained.num_accepted_drafts > 0


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_mid_generation_and_abort_keep_greedy_outputs(drafted: Path, mode: str) -> None:
    """Paused mid-decode (retracted: KV to the prefix cache, re-prefilled on continue; or in place),
    then continued, with one request aborted meanwhile: the others' greedy outputs are the
    non-speculative engine's."""
    vocab = load_pretrained(drafted).config.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling_params=params, rid=f"r{i}")
                for i, p in enumerate(_prompts(8, vocab, seed=21))]

    async def run(**config: object) -> tuple[list, object]:
        engine = Engine.from_pretrained(str(drafted), config=EngineConfig(kv_cache_mib=32, batch_invariant=True,
                                                                          **config))
        async with engine:
            states = [engine.submit(r) for r in requests]
            while engine.stats().num_generated_tokens < 8 * 12:
                await asyncio.sleep(0.001)
            await engine.pause(mode)
            assert await engine.abort("r3") == 1
            await engine.resume()
            await asyncio.gather(*(s.done.wait() for s in states))
            return [engine.snapshot(s) for s in states], engine.stats()

    plain, _ = asyncio.run(run())
    spec, stats = asyncio.run(run(speculative_tokens=3))
    assert spec[3].finish_reason["type"] == "abort" and stats.num_accepted_drafts > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        if i != 3:
            assert b.finish_reason["type"] == "length" and b.output_ids == a.output_ids, i
