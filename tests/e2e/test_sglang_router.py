"""The real sglang-router (0.3.2, the `[dev]` extra) in front of two embedded engines.

Each test serves the tiny model from two in-process `EngineServer`s on 127.0.0.1 (real sockets,
the test's event loop) and starts the router as a subprocess (`SGLangRouter`) in front of them:
  - /generate through the router reaches both engines and its answer passes through intact;
  - a multi-turn workload (8 sessions x 4 turns, each prompt = the previous prompt + its output +
    new tokens) keeps its prefix-cache hits through the cache_aware router, against the same
    workload sent round-robin straight to the engines and to a single engine (the ideal); the
    rates are printed (`-s`);
  - R3 on the tiny MoE model: through the router plainly the routed experts are dropped; through
    `RoutedBackend` (R3 straight to an engine by prefix affinity) they come back, equal to the
    engine's own answer, and a session's turns stay on one engine.

    pytest tests/e2e/test_sglang_router.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import pytest

from miles_async.engine.backend import GenerateParams, SGLangBackend
from miles_async.engine.client import EngineClient
from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.router import RoutedBackend, RouterPolicy, SGLangRouter
from miles_async.engine.server import EngineServer
from miles_async.models import init_model, load_pretrained
from miles_async.trainer.fsdp import free_port

pytest.importorskip("sglang_router", reason="sglang-router is in the [dev] extra: pip install -e '.[dev]'")

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 180
LIVELY_STD = 0.3
GREEDY = {"temperature": 0.0, "ignore_eos": True}
NUM_SESSIONS, NUM_TURNS = 8, 4
SYSTEM_TOKENS, FIRST_TOKENS, OUTPUT_TOKENS, NEW_TOKENS = 8, 48, 8, 16


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@contextlib.asynccontextmanager
async def engines_and_router(model_dir, policy: RouterPolicy = "cache_aware",
                             num_engines: int = 2) -> AsyncIterator[tuple[list[Engine], list[str], SGLangRouter]]:
    """`num_engines` engine servers on free ports and the router in front of them."""
    async with contextlib.AsyncExitStack() as stack:
        engines, urls = [], []
        for _ in range(num_engines):
            engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=16))
            server = await stack.enter_async_context(EngineServer(engine))
            engines.append(engine)
            urls.append(server.url)
        router = SGLangRouter(urls, port=free_port(), policy=policy)
        await stack.enter_async_context(router)
        yield engines, urls, router


def test_generate_through_the_router_reaches_both_engines(model_dir):
    prompts = [random.Random(i).choices(range(20, 250), k=40) for i in range(8)]

    async def main():
        async with engines_and_router(model_dir) as (engines, urls, router), \
                EngineClient(router.url, timeout_s=60) as via_router, EngineClient(urls[0], timeout_s=60) as direct:
            # Concurrently: the router sends a prompt it has no prefix of to its least loaded worker
            # (its own count of requests in flight), the first listed on a tie.
            outs = await asyncio.gather(*(via_router.generate(
                input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 4}, rid=f"req-{i}", return_logprob=True)
                for i, p in enumerate(prompts)))
            served = [engine.stats().num_prompt_tokens for engine in engines]
            reference = await direct.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 4},
                                              return_logprob=True)
            return outs, reference, served

    outs, reference, prompt_tokens = run(main())
    print(f"\nprompt tokens served per engine through the router: {prompt_tokens}")
    assert all(n > 0 for n in prompt_tokens), f"the router sent every request to one engine: {prompt_tokens}"
    assert sum(prompt_tokens) == sum(len(p) for p in prompts)
    # The answer passes through as the engine wrote it: rid, log-probs, version spans.
    assert [out["meta_info"]["id"] for out in outs] == [f"req-{i}" for i in range(len(prompts))]
    assert outs[0]["output_ids"] == reference["output_ids"]
    assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 4
    assert outs[0]["meta_info"]["weight_versions"] == reference["meta_info"]["weight_versions"]


def session_openings() -> list[list[int]]:
    """Each session's first prompt: a system prompt they all share, then tokens of its own."""
    system = random.Random(100).choices(range(20, 250), k=SYSTEM_TOKENS)
    return [system + random.Random(i).choices(range(20, 250), k=FIRST_TOKENS - SYSTEM_TOKENS)
            for i in range(NUM_SESSIONS)]


async def multi_turn(pick_client) -> tuple[int, int]:
    """Run every session's turns (sessions concurrently, turns in order; each turn's sessions in a
    shuffled order, as arrivals come); `pick_client()` names where each request goes. Returns
    (cached prompt tokens, prompt tokens) over all requests."""
    prompts = session_openings()
    order = random.Random(7)
    cached = total = 0
    for turn in range(NUM_TURNS):
        sessions = list(range(NUM_SESSIONS))
        order.shuffle(sessions)
        clients = {s: pick_client() for s in sessions}
        outs = await asyncio.gather(*(clients[s].generate(
            input_ids=prompts[s], sampling_params={**GREEDY, "max_new_tokens": OUTPUT_TOKENS}) for s in sessions))
        for s, out in zip(sessions, outs):
            cached += out["meta_info"]["cached_tokens"]
            total += out["meta_info"]["prompt_tokens"]
            new = random.Random(1000 * s + turn).choices(range(20, 250), k=NEW_TOKENS)
            prompts[s] = prompts[s] + out["output_ids"] + new
    return cached, total


def test_multi_turn_keeps_prefix_cache_hits_through_the_cache_aware_router(model_dir):
    async def main():
        async with engines_and_router(model_dir, policy="cache_aware") as (engines, urls, router), \
                EngineClient(router.url, timeout_s=60) as via_router, \
                contextlib.AsyncExitStack() as stack:
            direct = [await stack.enter_async_context(EngineClient(url, timeout_s=60)) for url in urls]
            rates = {}
            cached, total = await multi_turn(lambda: via_router)
            rates["router_cache_aware"] = cached / total
            per_engine = [engine.stats().num_prompt_tokens for engine in engines]
            for client in direct:
                await client.flush_cache()
            turn = iter(range(10**6))
            cached, total = await multi_turn(lambda: direct[next(turn) % len(direct)])
            rates["round_robin_direct"] = cached / total
            for client in direct:
                await client.flush_cache()
            cached, total = await multi_turn(lambda: direct[0])
            rates["single_engine_ideal"] = cached / total
            return rates, per_engine, total

    rates, per_engine, total = run(main())
    print(f"\nprefix-cache hit rate (cached / prompt tokens, {NUM_SESSIONS} sessions x {NUM_TURNS} turns, "
          f"{total} prompt tokens): " + ", ".join(f"{name} {rate:.3f}" for name, rate in rates.items())
          + f"; prompt tokens per engine through the router: {per_engine}")
    assert all(n > 0 for n in per_engine), f"the router put every session on one engine: {per_engine}"
    assert rates["router_cache_aware"] >= 0.95 * rates["single_engine_ideal"], rates
    assert rates["router_cache_aware"] > rates["round_robin_direct"] + 0.1, rates


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("qwen3_moe"), seed=0, init_std=LIVELY_STD)


def test_r3_goes_straight_to_an_engine_with_session_affinity(moe_dir):
    prompts = session_openings()[:4]
    r3 = GenerateParams(max_new_tokens=OUTPUT_TOKENS, temperature=0.0, return_routed_experts=True)

    async def main():
        async with engines_and_router(moe_dir) as (engines, urls, router), \
                EngineClient(router.url, timeout_s=60) as via_router:
            plain = await via_router.generate(input_ids=prompts[0], sampling_params=GREEDY,
                                              return_routed_experts=True)
            backend = RoutedBackend(router.url, [SGLangBackend(url, timeout_s=60) for url in urls])
            try:
                reference = await backend.engines[0].generate(prompts[0], r3, version=0)
                before = [engine.stats().num_prompt_tokens for engine in engines]
                turns = []
                for prompt in prompts:  # two turns per session: the second extends the first
                    first = await backend.generate(prompt, r3, version=0)
                    second = await backend.generate(prompt + first.output_ids + [42] * NEW_TOKENS, r3, version=0)
                    turns.append((first, second))
                served = [engine.stats().num_prompt_tokens - n for engine, n in zip(engines, before)]
                streamed = [out async for out in backend.generate_stream(prompts[0], r3, version=0)][-1]
                ordinary = await backend.generate(prompts[0], GenerateParams(max_new_tokens=4), version=0)
            finally:
                await backend.close()
            return plain, reference, turns, served, streamed, ordinary

    plain, reference, turns, served, streamed, ordinary = run(main())
    print(f"\nR3 prompt tokens per engine through RoutedBackend: {served}")
    assert all(n > 0 for n in served), f"R3 sessions all went to one engine: {served}"
    assert "routed_experts" not in plain["meta_info"], "the router now forwards return_routed_experts: use it"
    config = load_pretrained(moe_dir).config
    bytes_per_token = len(config.moe_layer_indices) * config.num_experts_per_tok * 4  # int32
    first, second = turns[0]
    assert first.output_ids == reference.output_ids
    assert first.routed_experts == reference.routed_experts
    for first, second in turns:
        assert len(first.routed_experts) == (first.prompt_tokens + len(first.output_ids) - 1) * bytes_per_token
        assert len(second.routed_experts) == (second.prompt_tokens + len(second.output_ids) - 1) * bytes_per_token
        # The second turn went where the first did: its prefix was in that engine's cache.
        assert second.cached_tokens >= first.prompt_tokens // 16 * 16, (first.prompt_tokens, second.cached_tokens)
    assert streamed.routed_experts == reference.routed_experts
    assert len(ordinary.output_ids) == 4 and ordinary.routed_experts == b""
