"""The engine's scheduler: which requests run each step, and where their KV goes.

    scheduler = Scheduler(cache, SchedulerLimits(max_running_requests=8, max_prefill_tokens=256,
                                                 max_seq_len=2048))
    scheduler.waiting.append(request)           # engine.submit does this
    step = scheduler.schedule()                 # None: nothing to run
    ... the model runner computes the step (runner.py); the engine applies its tokens ...

Each step every running request gets its next token (a decoding request) or its next prompt
chunk (a prefilling one, within `max_prefill_tokens` per step), then waiting requests are
admitted in arrival order while KV blocks and `max_running_requests` allow. A request's prompt
is first matched against the prefix cache; the matched blocks are shared, not recomputed. When a
decoding request needs a block and none is free even after evicting unused cached blocks, the
most recently admitted request is retracted: its KV goes to the prefix cache, its blocks are
released, and it waits at the head of the queue, keeping its outputs and its random generator,
to be re-prefilled (mostly from the cache) later. With speculative decoding a decoding request
also gets a draft budget (`num_drafts`), taken from its blocks and the free ones only.

No torch forward runs here: the scheduler works on `Request`s and the `KVCache`'s block pool
and radix tree (host-side state), which is what lets tests drive it without a model
(tests/unit/test_engine_scheduler.py). Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from miles_async.engine import speculative
from miles_async.engine.attention import ScheduledChunk
from miles_async.engine.kv_cache import KVCache, OutOfBlocksError
from miles_async.engine.request import Phase, Request


@dataclass(frozen=True, slots=True)
class Step:
    """One step's work: the chunks to compute, packed, and what to read back after them."""

    requests: list[Request]
    chunks: list[ScheduledChunk]
    sampled: list[bool]  # which chunks end at the request's last token (sample after them)
    input_ids: list[int]  # the chunks' tokens, packed
    # Prompt positions scored this step: (index into requests, packed row, the prompt token it scores).
    scored: list[tuple[int, int, int]]
    drafts: list[int]  # per chunk: draft tokens it verifies (its last ones; speculative decoding), else 0


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The bounds the scheduler keeps (EngineConfig's, `max_seq_len` resolved against the model)."""

    max_running_requests: int
    max_prefill_tokens: int
    max_seq_len: int
    speculative_tokens: int = 0  # drafts per decoding request per step at most (0: no speculative decoding)
    speculative_adaptive: bool = True  # no drafts while a request's drafts fail too often (speculative.py)


class Scheduler:
    """The waiting queue, the running requests and their KV blocks; see the module docstring."""

    def __init__(self, cache: KVCache, limits: SchedulerLimits) -> None:
        self.cache = cache
        self.limits = limits
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Bumped whenever the cached KV stops matching the weights (an update) or is dropped (a
        # release): a request whose KV started in an older epoch never inserts it into the tree.
        self.cache_epoch = 0
        self.counters: collections.Counter[str] = collections.Counter()  # steps, retractions, prompt/cached tokens

    # ----- one step -----

    def schedule(self, admit_before: int | None = None) -> Step | None:
        """The next step's work, or None when there is none. `admit_before`: only requests whose
        `seq` is below it run or are admitted (a pause in mode "wait"); None: every request."""
        budget = self.limits.max_prefill_tokens
        chosen: list[tuple[Request, int, int]] = []  # (request, tokens it computes, drafts among them)
        for request in list(self.running):
            if request.phase is not Phase.RUNNING or not _allowed(request, admit_before):
                continue  # retracted earlier in this loop
            pending = request.num_tokens - request.num_computed
            count = 1 if pending == 1 else min(pending, budget)
            if count == 0:
                continue
            if self.grow(request, request.num_computed + count):
                drafts = self.num_drafts(request) if pending == 1 and self.limits.speculative_tokens else 0
                chosen.append((request, count + drafts, drafts))
                budget -= count if pending > 1 else 0
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_running_requests:
            request = self.waiting[0]
            if not _allowed(request, admit_before) or not self.admit(request):
                break
            self.waiting.popleft()
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
            ids.extend([0] * drafts)  # the drafts' places: the runner drafts them first
        return Step(requests=[r for r, _, _ in chosen], chunks=chunks,
                    sampled=[r.num_computed + n - d == r.num_tokens for r, n, d in chosen], input_ids=ids,
                    scored=scored, drafts=[d for _, _, d in chosen])

    def num_drafts(self, request: Request) -> int:
        """How many tokens to draft for a decoding request this step: `speculative_tokens`, less
        what its max_new_tokens and the context length leave (the verify emits drafts + 1 tokens,
        at positions up to num_computed + drafts), less what its KV blocks and the free blocks hold
        (drafting never evicts the prefix cache nor retracts anyone); none while its drafts fail too
        often (`speculative_adaptive`), or before its first sampled step has left it a hidden state."""
        if request.draft_hidden is None:
            return 0
        budget = self.limits.speculative_tokens
        if (self.limits.speculative_adaptive
                and speculative.acceptance(request.draft_record) < speculative.MIN_ACCEPTANCE):
            if self.counters["steps"] % speculative.PROBE_EVERY:  # its drafts fail too often to pay
                return 0
            budget = 1  # a probe: one draft, on the same step as every other such request's
        drafts = min(budget, request.params.max_new_tokens - len(request.output_ids) - 1,
                     self.limits.max_seq_len - 1 - request.num_computed)
        if drafts <= 0:
            return 0
        extra = self.cache.blocks_for(request.num_computed + 1 + drafts) - len(request.blocks)
        if extra > 0:
            if extra <= self.cache.num_free:
                request.blocks.extend(self.cache.allocate(extra))
            else:
                drafts = len(request.blocks) * self.cache.block_size - request.num_computed - 1
        return max(drafts, 0)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give a running request blocks for num_tokens, retracting newer requests if memory is short.

        Returns False when the request itself had to be retracted (it was the newest).
        """
        need = self.cache.blocks_for(num_tokens) - len(request.blocks)
        while need > 0:
            try:
                request.blocks.extend(self.cache.allocate(need))
                return True
            except OutOfBlocksError:
                victim = self.running[-1]
                self.retract(victim)
                if victim is request:
                    return False
        return True

    def admit(self, request: Request) -> bool:
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
        headroom = max(1, self.cache.num_blocks // 100) if self.running else 0
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
        request.cache_epoch = self.cache_epoch
        request.phase = Phase.RUNNING
        request.prefilling = True
        if not request.admitted_once:
            request.admitted_once = True
            request.cached_tokens = request.num_computed
            self.counters["prompt_tokens"] += len(request.prompt_ids)
            self.counters["cached_tokens"] += request.num_computed
        self.running.append(request)
        return True

    # ----- requests leaving -----

    def retract(self, request: Request) -> None:
        """Back to the head of the queue; its KV goes to the prefix cache, its blocks are released."""
        self.release_kv(request)
        self.running.remove(request)
        request.phase = Phase.WAITING
        request.num_retractions += 1
        self.counters["retractions"] += 1
        self.waiting.appendleft(request)

    def retract_all(self) -> None:
        """Every running request back to the queue, the newest first (so the oldest ends up at the head)."""
        for request in reversed(list(self.running)):
            self.retract(request)

    def release_kv(self, request: Request) -> None:
        """Give a request's blocks back; what it computed (under the current weights) stays in the prefix cache."""
        if request.cache_epoch == self.cache_epoch and request.num_computed:
            self.cache.tree.insert(request.all_ids, request.blocks, request.num_computed)
        self.cache.release(request.blocks)
        request.blocks = []
        request.num_computed = 0

    def drop(self, request: Request) -> None:
        """A finishing request leaves the queues (a running one gives its KV back first)."""
        if request.phase is Phase.RUNNING:
            self.release_kv(request)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # ----- the prefix cache -----

    def prefilled(self, request: Request) -> None:
        """A request's prompt (or re-prefill) is computed: share its full blocks now."""
        request.prefilling = False
        if request.cache_epoch == self.cache_epoch:
            self.cache.tree.insert(request.all_ids, request.blocks, request.num_computed)

    def invalidate_cache(self) -> None:
        """The cached KV no longer matches the weights: drop the tree and keep running requests'
        KV out of it (they continue on their own blocks)."""
        self.cache.tree.flush()
        self.cache_epoch += 1

    def flush_cache(self) -> int:
        """Drop every cached prefix; return the blocks freed (blocks in use stay with their requests)."""
        return self.cache.tree.flush()

    @property
    def num_used_tokens(self) -> int:
        """Tokens with KV of the running requests."""
        return sum(r.num_computed for r in self.running)

    @property
    def num_used_blocks(self) -> int:
        """KV blocks requests hold (not free, not evictable prefix cache)."""
        return self.cache.num_blocks - self.cache.num_free - self.cache.tree.num_evictable()


def _allowed(request: Request, admit_before: int | None) -> bool:
    return admit_before is None or request.seq < admit_before
