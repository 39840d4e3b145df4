"""The engine's scheduler without a model: admission, chunked prefill, retraction when KV blocks
run out, prefix-cache reuse, aborts, the "wait" pause's bound and draft budgets.

The scheduler and the KV cache are the real ones (a one-layer cache of one-wide heads, so a
block costs a few bytes); the requests are real `Request`s with made-up prompts. What stands in
for the model runner (the boundary these tests are not about) is `compute_step`: it marks each
scheduled chunk computed and appends a made-up token where the engine would sample one, as
`Engine._apply` does, without any forward.
"""

from __future__ import annotations

import itertools

import torch

from miles_async.engine.kv_cache import KVCache
from miles_async.engine.request import Phase, Request
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.scheduler import Scheduler, SchedulerLimits, Step

BLOCK = 4
_seq = itertools.count()


def make_scheduler(num_blocks: int, *, max_running: int = 8, max_prefill: int = 64,
                   speculative_tokens: int = 0) -> Scheduler:
    cache = KVCache(num_layers=1, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=1, head_dim=1)
    return Scheduler(cache, SchedulerLimits(max_running_requests=max_running, max_prefill_tokens=max_prefill,
                                            max_seq_len=256, speculative_tokens=speculative_tokens,
                                            speculative_adaptive=False))


def make_request(prompt: list[int], max_new_tokens: int = 8) -> Request:
    return Request(rid=f"r{next(_seq)}", seq=next(_seq), prompt_ids=list(prompt),
                   params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), return_logprob=False,
                   return_routed_experts=False, generator=None, stop_token_ids=frozenset())


def compute_step(scheduler: Scheduler, step: Step, token: int = 7) -> None:
    """What the runner and Engine._apply do to the scheduler's state: the chunk's KV is written,
    and a sampled chunk appends a token (its first after a prefill shares the prompt's blocks)."""
    for request, chunk, sampled, drafts in zip(step.requests, step.chunks, step.sampled, step.drafts):
        request.num_computed += chunk.num_tokens - drafts
        if sampled:
            if request.prefilling:
                scheduler.prefilled(request)
            request.output_ids.append(token)
    scheduler.counters["steps"] += 1


def test_admits_in_arrival_order_within_the_limits_and_chunks_long_prompts():
    scheduler = make_scheduler(64, max_running=2, max_prefill=6)
    first, second, third = make_request(list(range(10))), make_request([1, 2]), make_request([3, 4])
    scheduler.waiting.extend([first, second, third])
    step = scheduler.schedule()
    # The prefill budget (6 tokens) goes to the first request; the second is admitted (its budget
    # is spent) only once a step leaves room; max_running_requests keeps the third waiting.
    assert step is not None and step.requests == [first] and step.chunks[0].num_tokens == 6
    assert step.sampled == [False] and step.input_ids == list(range(6))
    compute_step(scheduler, step)
    step = scheduler.schedule()
    assert step is not None and step.requests == [first, second]
    assert [c.num_tokens for c in step.chunks] == [4, 2] and step.sampled == [True, True]
    assert list(scheduler.waiting) == [third] and first.phase is Phase.RUNNING
    compute_step(scheduler, step)
    step = scheduler.schedule()  # both decode: one token each
    assert step is not None and [c.num_tokens for c in step.chunks] == [1, 1] and step.input_ids == [7, 7]


def test_a_request_short_of_blocks_retracts_the_newest_whose_kv_goes_to_the_prefix_cache():
    scheduler = make_scheduler(4, max_prefill=64)  # 4 blocks of 4 tokens
    old, new = make_request(list(range(7)), max_new_tokens=8), make_request(list(range(100, 104)), max_new_tokens=8)
    scheduler.waiting.append(old)
    compute_step(scheduler, scheduler.schedule())  # old: 7 prompt tokens + 1 sampled = 2 blocks
    scheduler.waiting.append(new)
    step = scheduler.schedule()
    assert step is not None and step.requests == [old, new]  # new: 4 tokens, 1 block (+1 of headroom is free)
    compute_step(scheduler, step)
    assert scheduler.cache.num_free == 1
    late = make_request([200, 201, 202])
    scheduler.waiting.append(late)
    for _ in range(2):  # old grows past its 2 blocks, new into its second: one block short
        step = scheduler.schedule()
        assert step is not None
        compute_step(scheduler, step)
    assert scheduler.counters["retractions"] == 1 and new.num_retractions == 1
    assert new.phase is Phase.WAITING and list(scheduler.waiting) == [new, late] and new.blocks == []
    assert scheduler.running == [old] and new.output_ids == [7]  # it keeps what it sampled
    assert len(scheduler.cache.tree.match(new.all_ids, max_tokens=BLOCK)) == 1  # its prompt, cached for later
    scheduler.drop(old)  # old finishes: its blocks come back, and new is re-admitted from the cache
    step = scheduler.schedule()
    assert step is not None and step.requests == [new, late] and step.chunks[0].start == BLOCK
    assert step.input_ids[:1] == [7]  # only the token past the cached block is computed again


def test_a_shared_prompt_prefix_is_taken_from_the_cache_and_counted():
    scheduler = make_scheduler(32)
    prompt = list(range(50, 60))  # 10 tokens: 2 full blocks
    a = make_request(prompt)
    scheduler.waiting.append(a)
    compute_step(scheduler, scheduler.schedule())
    b = make_request(prompt + [1, 2])
    scheduler.waiting.append(b)
    step = scheduler.schedule()
    assert step is not None and step.requests == [a, b]
    assert b.cached_tokens == 2 * BLOCK and b.blocks[:2] == a.blocks[:2]  # the same blocks, shared
    assert step.chunks[1].start == 2 * BLOCK and step.chunks[1].num_tokens == len(prompt) + 2 - 2 * BLOCK
    assert scheduler.counters["prompt_tokens"] == 22 and scheduler.counters["cached_tokens"] == 2 * BLOCK
    scheduler.invalidate_cache()  # the weights changed: nothing cached is served again
    c = make_request(prompt)
    scheduler.waiting.append(c)
    compute_step(scheduler, step)
    step = scheduler.schedule()
    assert step is not None and c in step.requests and c.cached_tokens == 0


def test_dropping_a_request_frees_its_blocks_and_its_place_in_the_queue():
    scheduler = make_scheduler(8, max_running=1)
    running, waiting = make_request(list(range(9))), make_request([1, 2, 3])
    scheduler.waiting.extend([running, waiting])
    step = scheduler.schedule()
    assert step is not None and step.requests == [running] and scheduler.cache.num_free == 8 - 3
    scheduler.drop(waiting)
    assert not scheduler.waiting
    scheduler.invalidate_cache()  # its KV must not reach the tree either (the epoch moved on)
    scheduler.drop(running)  # an abort midway through its prefill
    assert scheduler.running == [] and running.blocks == [] and scheduler.cache.num_free == 8
    assert len(scheduler.cache.tree) == 0 and scheduler.schedule() is None


def test_the_wait_pause_runs_only_what_arrived_before_it():
    scheduler = make_scheduler(16)
    before, after = make_request([1, 2, 3]), make_request([4, 5, 6])
    scheduler.waiting.extend([before, after])
    step = scheduler.schedule(admit_before=after.seq)
    assert step is not None and step.requests == [before] and list(scheduler.waiting) == [after]
    compute_step(scheduler, step)
    step = scheduler.schedule(admit_before=after.seq)
    assert step is not None and step.requests == [before]


def test_draft_budgets_take_free_blocks_only_and_stop_at_max_new_tokens():
    scheduler = make_scheduler(3, speculative_tokens=4)
    request = make_request([1, 2, 3], max_new_tokens=4)
    scheduler.waiting.append(request)
    compute_step(scheduler, scheduler.schedule())  # 3 prompt tokens, 1 sampled: 4 tokens, 1 block
    request.draft_hidden = torch.zeros(1)  # what the runner leaves after a sampled step
    step = scheduler.schedule()
    # 4 drafts asked; max_new_tokens leaves 4 - 1 - 1 = 2 (the verify emits drafts + 1 tokens)
    assert step is not None and step.drafts == [2] and step.chunks[0].num_tokens == 3
    assert step.input_ids == [7, 0, 0]  # the drafts' places, which the runner fills
    other = make_scheduler(2, speculative_tokens=4)
    crowded = make_request(list(range(7)), max_new_tokens=16)
    other.waiting.append(crowded)
    compute_step(other, other.schedule())  # 8 tokens in both blocks: none free for drafts
    crowded.draft_hidden = torch.zeros(1)
    step = other.schedule()
    assert step is not None and step.drafts == [0] and step.chunks[0].num_tokens == 1
