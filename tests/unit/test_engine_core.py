"""The embedded engine's parts, in process: KV blocks and the radix cache, the paged attention
backend, the sampler, and the engine loop on real tiny models (miles_async.models.init_model)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from miles_async.engine import compute
from miles_async.engine.attention import GatherWorkspace, PagedAttention, ScheduledChunk, build_plan
from miles_async.engine.core import Engine, EngineConfig, EngineOverloadedError
from miles_async.engine.kv_cache import KVCache, OutOfBlocksError
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams, make_generator, sample
from miles_async.kernels import cpu_kernels
from miles_async.models import DenseCausalAttention, init_model, load_pretrained, load_tokenizer

TIMEOUT_S = 60
# Weights drawn wider than init's 0.02, so that greedy output does not repeat one token.
LIVELY_STD = 0.3


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=0, init_std=LIVELY_STD)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("qwen3_moe"), seed=0, init_std=LIVELY_STD)


def greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Full forward over the whole sequence for every token: no cache of any kind."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(count: int, vocab: int, start_len: int = 5, step: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (start_len + step * i,), generator=gen).tolist() for i in range(count)]


# ----- KV blocks and the radix cache -----

def small_cache(num_blocks: int = 8, block_size: int = 4) -> KVCache:
    return KVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=2)


def test_radix_cache_shares_full_blocks_and_evicts_least_recently_used_leaves():
    cache = small_cache()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks = cache.allocate(3)
    cache.tree.insert(tokens, blocks, num_tokens=10)
    assert len(cache.tree) == 2  # only full blocks enter the tree
    cache.release(blocks)
    assert cache.num_free == 5 + 1  # the partial block is freed, the two cached ones are kept
    assert cache.tree.match(tokens + [99], max_tokens=11) == blocks[:2]
    assert cache.tree.match(tokens[:8], max_tokens=7) == blocks[:1]  # at least one token left to compute
    other = cache.allocate(2)
    cache.tree.insert([50, 51, 52, 53, 54, 55, 56, 57], other, num_tokens=8)
    cache.release(other)
    cache.tree.match(tokens, max_tokens=10)  # touch the first prefix: the other one is now older
    taken = cache.allocate(cache.num_free + 2)  # forces two evictions: the older prefix goes first
    assert cache.tree.match([50, 51, 52, 53, 54, 55, 56, 57], max_tokens=8) == []
    assert cache.tree.match(tokens, max_tokens=10) == blocks[:2]
    with pytest.raises(OutOfBlocksError):
        cache.allocate(3)  # only two cached blocks left to evict
    cache.release(taken)


def test_blocks_in_use_are_never_evicted_and_flush_leaves_them_to_their_request():
    cache = small_cache(num_blocks=4)
    blocks = cache.allocate(2)
    cache.tree.insert(list(range(8)), blocks, num_tokens=8)
    with pytest.raises(OutOfBlocksError):
        cache.allocate(3)  # both cached blocks are still used by their request
    assert cache.tree.flush() == 0
    assert len(cache.tree) == 0 and cache.num_free == 2
    cache.release(blocks)  # no longer cached: freed at once
    assert cache.num_free == 4


def test_a_second_copy_of_a_cached_prefix_stays_private_and_is_freed():
    cache = small_cache()
    first, second = cache.allocate(1), cache.allocate(1)
    cache.tree.insert([1, 2, 3, 4], first, num_tokens=4)
    cache.tree.insert([1, 2, 3, 4], second, num_tokens=4)  # computed concurrently by another request
    assert cache.tree.match([1, 2, 3, 4, 5], max_tokens=5) == first
    cache.release(second)
    cache.release(first)
    assert cache.num_free == 7 and len(cache.tree) == 1


# ----- paged attention -----

@pytest.mark.parametrize("per_token", [
    False,  # padded groups: gathered keys, the matmuls or SDPA
    pytest.param(True, marks=pytest.mark.skipif(not cpu_kernels.supports(torch.float32, torch.device("cpu")),
                                                reason="fused CPU kernels unavailable")),  # one kernel call
])
def test_paged_attention_equals_dense_attention_for_mixed_prefill_and_decode(per_token: bool):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    cache = KVCache(num_layers=1, num_blocks=32, block_size=block_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim)
    lengths = [3, 9, 17, 30, 6]  # total tokens per request after this step
    new = [3, 1, 1, 5, 6]  # a fresh prefill, two decodes, a prefill chunk over a cached prefix, a prefill
    tables = [cache.allocate(-(-n // block_size)) for n in lengths]
    full = [(torch.randn(n, num_heads, head_dim), torch.randn(n, num_kv_heads, head_dim),
             torch.randn(n, num_kv_heads, head_dim)) for n in lengths]
    with torch.inference_mode():  # the cache's tensors are inference tensors
        for (q, k, v), table, n, fresh in zip(full, tables, lengths, new):  # the cached part, written before
            for p in range(n - fresh):
                cache.k_blocks[0][:, table[p // block_size], p % block_size] = k[p]
                cache.v_blocks[0][:, table[p // block_size], p % block_size] = v[p]
    chunks = [ScheduledChunk(table, n - fresh, fresh) for table, n, fresh in zip(tables, lengths, new)]
    plan = build_plan(chunks, block_size, per_token=per_token)
    assert (plan.tokens is not None) == per_token and (not plan.groups) == per_token
    q_1TNH = torch.cat([q[n - f:] for (q, _, _), n, f in zip(full, lengths, new)])[None]
    k_1TKH = torch.cat([k[n - f:] for (_, k, _), n, f in zip(full, lengths, new)])[None]
    v_1TKH = torch.cat([v[n - f:] for (_, _, v), n, f in zip(full, lengths, new)])[None]
    with torch.inference_mode():
        out_1TNH = PagedAttention(cache, plan, GatherWorkspace())(0, q_1TNH, k_1TKH, v_1TKH, plan.positions_T[None])
    offset = 0
    for (q, k, v), n, fresh in zip(full, lengths, new):
        dense_TNH = DenseCausalAttention()(0, q[None], k[None], v[None], torch.arange(n)[None])[0]
        torch.testing.assert_close(out_1TNH[0, offset:offset + fresh], dense_TNH[n - fresh:], atol=1e-5, rtol=1e-5)
        offset += fresh


def test_decode_requests_of_very_different_lengths_get_separate_buckets():
    chunks = [ScheduledChunk(list(range(64)), start, 1) for start in (1000, 990, 900, 40, 30, 10)]
    plan = build_plan(chunks, block_size=16)
    sizes = sorted(g.q_index_GQ.shape[0] for g in plan.groups)
    assert len(plan.groups) >= 2 and sum(sizes) == 6


def test_serial_index_select_equals_index_select_and_work_runs_on_one_thread():
    source = torch.arange(50_000 * 6, dtype=torch.int32).view(50_000, 6)
    index = torch.randint(0, 50_000, (20_000,))
    assert torch.equal(compute.serial_index_select(source, index), source[index])
    threads = {compute.run_sync(lambda: threading.get_ident()) for _ in range(3)}
    threads.add(run(compute.run(threading.get_ident)))
    assert len(threads) == 1 and threading.get_ident() not in threads


# ----- sampling -----

def test_sampler_greedy_top_k_top_p_and_seeds():
    logits_RV = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.5, top_k=2)]
    shared = make_generator(0)
    tokens_R, logprobs_R = sample(logits_RV, params, [None, None, make_generator(7), None], shared)
    assert tokens_R[:3].tolist() == [1, 1, 1]  # top_p=0.5: token 1 alone holds 0.64 of the mass
    assert tokens_R[3].item() in (1, 3)
    assert logprobs_R[0].item() == pytest.approx(torch.log_softmax(logits_RV[0], -1)[1].item())
    assert logprobs_R[1].item() == pytest.approx(0.0)  # the only token left
    kept = torch.log_softmax(torch.tensor([3.0, 2.0]) / 0.5, -1)
    assert logprobs_R[3].item() == pytest.approx(kept[0 if tokens_R[3].item() == 1 else 1].item())
    uniform_RV = torch.zeros(2, 1000)
    draws = [sample(uniform_RV, [SamplingParams()] * 2, [make_generator(5), make_generator(5)], shared)[0]
             for _ in range(2)]
    assert draws[0][0] == draws[0][1] == draws[1][0]  # a seed fixes the draw whatever its row


@pytest.mark.parametrize("fields, message", [
    ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": "8"}, "max_new_tokens"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tempreature": 1.0}, "tempreature"), ({"stop_token_ids": [10**6]}, "stop_token_ids"), ({"stop": [""]}, "stop"),
])
def test_sampling_params_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_json(fields, vocab_size=100)


def test_sampling_params_accept_sglang_spellings():
    params = SamplingParams.from_json({"stop": "END", "temperature": 0, "top_k": -1, "skip_special_tokens": False,
                                       "frequency_penalty": 0.0, "sampling_seed": 3}, vocab_size=100)
    assert params.stop == ("END",) and params.greedy and params.sampling_seed == 3


# ----- the engine loop -----

def test_greedy_under_kv_pressure_and_chunked_prefill_equals_a_full_forward_loop(dense_dir):
    model = load_pretrained(dense_dir)
    # Room for a few requests at a time only: the rest queue, decoders get retracted, prompts chunk.
    config = EngineConfig(kv_cache_mib=0.14, block_size=4, max_seq_len=128, max_prefill_tokens=24)
    engine = Engine(model, config=config)
    batch = prompts(10, model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    async def scenario():
        async with engine:
            return await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p, sampling_params=params))
                                          for p in batch))

    outs = run(scenario())
    for prompt, out in zip(batch, outs):
        assert out.output_ids == greedy_reference(model, prompt, 24)
        assert out.finish_reason == {"type": "length", "length": 24}
    stats = engine.stats()
    assert stats.num_retractions > 0, "the test must exercise retraction"
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks  # nothing leaked


def test_routed_experts_of_every_token_match_the_models_own_routing(moe_dir):
    model = load_pretrained(moe_dir)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=4, block_size=4))
    prompt = prompts(1, model.config.vocab_size, start_len=11)[0]

    async def scenario():
        async with engine:
            first = await engine.generate(GenerateRequest(
                input_ids=prompt, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                return_routed_experts=True))
            # The same prompt again: its prefix comes from the cache, its experts from the slots.
            second = await engine.generate(GenerateRequest(
                input_ids=prompt, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                return_routed_experts=True))
            return first, second

    first, second = run(scenario())
    assert second.cached_tokens > 0
    ids = prompt + first.output_ids
    with torch.inference_mode():
        _, experts_L1Tk = model(torch.tensor([ids[:-1]]), return_routed_experts=True)
    expected_TLk = experts_L1Tk[:, 0].transpose(0, 1).to(torch.int32)
    for out in (first, second):
        assert out.routed_experts_TLk.shape == (len(ids) - 1, len(model.config.moe_layer_indices),
                                                model.config.num_experts_per_tok)
        assert torch.equal(out.routed_experts_TLk.sort(-1).values, expected_TLk.sort(-1).values)


def test_weight_update_from_tensors_checks_names_and_shapes_then_bumps_the_version(dense_dir, tmp_path):
    model = load_pretrained(dense_dir)
    other = load_pretrained(init_model("qwen3", "tiny", tmp_path / "other", seed=3, init_std=LIVELY_STD))
    engine = Engine(model, tokenizer=load_tokenizer(dense_dir), config=EngineConfig(kv_cache_mib=4))
    prompt = prompts(1, model.config.vocab_size, start_len=9)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    async def scenario():
        async with engine:
            before = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            with pytest.raises(ValueError, match="not in the model"):
                await engine.weights.update_from_tensors({"model.nope.weight": torch.zeros(1)})
            name = "model.norm.weight"
            with pytest.raises(ValueError, match="shape"):
                await engine.weights.update_from_tensors([(name, torch.zeros(3))])
            assert engine.weight_version == "0"
            version = await engine.weights.update_from_tensors(other.state_dict())
            after = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            return before, version, after

    before, version, after = run(scenario())
    assert version == "1" and before.weight_version == "0" and after.weight_version == "1"
    assert after.cached_tokens == 0  # the cache was flushed with the old weights
    assert after.output_ids == greedy_reference(other, prompt, 8) != before.output_ids


def test_submit_refuses_bad_requests_and_a_full_queue(dense_dir):
    model = load_pretrained(dense_dir)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=2, max_seq_len=64, max_waiting_requests=2))

    async def scenario():
        async with engine:
            for ids, params, message in [([], SamplingParams(), "empty"), ([10**6], SamplingParams(), "vocabulary"),
                                         ([1] * 60, SamplingParams(max_new_tokens=8), "context length"),
                                         ([1], SamplingParams(stop=("x",), max_new_tokens=8), "tokenizer")]:
                with pytest.raises(ValueError, match=message):
                    engine.submit(GenerateRequest(input_ids=ids, sampling_params=params))
            await engine.pause("in_place")  # nothing is admitted: the queue fills up
            short = SamplingParams(max_new_tokens=4)
            engine.submit(GenerateRequest(input_ids=[1], rid="a", sampling_params=short))
            with pytest.raises(ValueError, match="already in flight"):
                engine.submit(GenerateRequest(input_ids=[1], rid="a", sampling_params=short))
            engine.submit(GenerateRequest(input_ids=[1], sampling_params=short))
            with pytest.raises(EngineOverloadedError):
                engine.submit(GenerateRequest(input_ids=[1], sampling_params=short))

    run(scenario())


def test_sampling_draws_tokens_with_their_probabilities():
    logits_RV = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * logits_RV.shape[0]
    tokens_R, logprobs_R = sample(logits_RV, params, [None] * logits_RV.shape[0], make_generator(7))
    frequencies_V = torch.bincount(tokens_R, minlength=4).double() / tokens_R.numel()
    expected_V = torch.softmax(logits_RV[0].double(), dim=-1)
    assert torch.allclose(frequencies_V, expected_V, atol=0.01), (frequencies_V, expected_V)
    assert torch.allclose(logprobs_R, torch.log_softmax(logits_RV, -1).gather(1, tokens_R[:, None]).squeeze(1))


def full_log_probs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full forward: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


@pytest.mark.parametrize("config", [
    EngineConfig(kv_cache_mib=4, block_size=4),
    EngineConfig(kv_cache_mib=4, block_size=4, max_prefill_tokens=5),  # scored positions span prefill chunks
])
def test_prompt_log_probs_and_top_k_equal_a_full_forward_even_over_a_cached_prefix(dense_dir, config):
    model = load_pretrained(dense_dir)
    engine = Engine(model, config=config)
    prompt = prompts(1, model.config.vocab_size, start_len=19)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    start, k = 6, 3

    async def scenario():
        async with engine:
            warm = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            # The whole prompt is cached now; the scored positions must be computed again all the same.
            scored = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                           return_logprob=True, logprob_start_len=start,
                                                           top_logprobs_num=k))
            plain = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                          return_logprob=True))
            return warm, scored, plain

    warm, scored, plain = run(scenario())
    assert 0 < scored.cached_tokens <= start and plain.cached_tokens > start
    logp_TV = full_log_probs(model, prompt + scored.output_ids)
    inputs = scored.input_token_logprobs
    assert [t for _, t in inputs] == prompt[start:] and inputs[0][0] is None
    expected = [float(logp_TV[p - 1, prompt[p]]) for p in range(start + 1, len(prompt))]
    assert [lp for lp, _ in inputs[1:]] == pytest.approx(expected, abs=1e-4)
    assert scored.input_top_logprobs[0] is None and len(scored.input_top_logprobs) == len(prompt) - start
    for p, top in zip(range(start + 1, len(prompt)), scored.input_top_logprobs[1:]):
        values_K, ids_K = logp_TV[p - 1].topk(k)
        assert [i for _, i in top] == ids_K.tolist() and [v for v, _ in top] == pytest.approx(values_K.tolist(), abs=1e-4)
    # Greedy: the chosen token is the most likely one, with the same log-prob in both lists.
    assert len(scored.output_top_logprobs) == len(scored.output_ids) == 4
    for token, logprob, top in zip(scored.output_ids, scored.output_token_logprobs, scored.output_top_logprobs):
        assert top[0] == (pytest.approx(logprob), token) and len(top) == k
    assert scored.output_ids == warm.output_ids == plain.output_ids
    # Without logprob_start_len (SGLang's -1): output log-probs only, no prompt ones, no top-k.
    assert plain.input_token_logprobs == [] and plain.input_top_logprobs is None
    assert warm.input_token_logprobs is None and warm.output_token_logprobs is None


def test_prompt_log_probs_from_position_0_and_bad_starts(dense_dir):
    model = load_pretrained(dense_dir)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=4, block_size=4))
    prompt = prompts(1, model.config.vocab_size, start_len=7)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

    async def scenario():
        async with engine:
            for start, top_k, message in [(8, 0, "logprob_start_len=8"), (-2, 0, "logprob_start_len=-2"),
                                          (0, -1, "top_logprobs_num=-1")]:
                with pytest.raises(ValueError, match=message):
                    engine.submit(GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True,
                                                  logprob_start_len=start, top_logprobs_num=top_k))
            whole = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                          return_logprob=True, logprob_start_len=0))
            # Without return_logprob SGLang ignores both fields, and so does the engine.
            ignored = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                            logprob_start_len=99, top_logprobs_num=5))
            return whole, ignored

    whole, ignored = run(scenario())
    logp_TV = full_log_probs(model, prompt)
    assert whole.input_token_logprobs[0] == (None, prompt[0])
    assert [lp for lp, _ in whole.input_token_logprobs[1:]] == pytest.approx(
        [float(logp_TV[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)
    assert ignored.input_token_logprobs is None and ignored.output_top_logprobs is None


def test_abort_matches_a_rid_prefix_as_sglang_does(dense_dir):
    model = load_pretrained(dense_dir)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=4))
    long = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)

    async def scenario():
        async with engine:
            await engine.pause("in_place")  # keep them all in flight
            states = {rid: engine.submit(GenerateRequest(input_ids=[5, 6, 7], rid=rid, sampling_params=long))
                      for rid in ("r1", "r1_0", "r10", "r2")}
            with pytest.raises(ValueError, match="empty rid prefix"):
                await engine.abort("", prefix=True)
            exact = await engine.abort("r1_", prefix=False)  # no request is called exactly "r1_"
            prefixed = await engine.abort("r1", prefix=True)
            await engine.resume()
            await states["r2"].done.wait()
            return exact, prefixed, {rid: s.finish_reason["type"] for rid, s in states.items()}

    exact, prefixed, reasons = run(scenario())
    assert (exact, prefixed) == (0, 3)
    assert reasons == {"r1": "abort", "r1_0": "abort", "r10": "abort", "r2": "length"}


def test_a_relabelled_version_starts_a_span_of_its_own(dense_dir):
    model = load_pretrained(dense_dir)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=4))
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompt = list(range(5, 25))  # longer than a block: the prefix cache keeps some of it

    async def scenario():
        async with engine:
            first = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            assert await engine.weights.relabel("step-1") == "step-1"  # a name: the version stays 0
            named = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            assert await engine.weights.relabel("4") == "4"
            with pytest.raises(ValueError, match="older"):
                await engine.weights.relabel("3")
            numbered = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params))
            return first, named, numbered

    first, named, numbered = run(scenario())
    assert [(s.version, s.start, s.end) for s in first.weight_versions] == [(0, 0, 6)]
    assert first.weight_version_labels == ["0"]
    assert named.weight_version_labels == ["step-1"] and named.weight_versions[0].version == 0
    assert numbered.weight_version_labels == ["4"] and numbered.weight_versions[0].version == 4
    assert numbered.cached_tokens > 0  # relabelling keeps the weights, so the prefix cache stays
