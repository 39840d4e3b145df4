"""The embedded engine: continuous batching over a paged KV cache with a radix prefix cache.

    engine = Engine.from_pretrained("models/tiny")            # or Engine(model, tokenizer=...)
    async with engine:
        out = await engine.generate(GenerateRequest(input_ids=[1, 2, 3],
                                                    sampling_params=SamplingParams(temperature=0)))
        await engine.weights.update_from_tensors(new_state_dict, weight_version=1)

Three parts, along the seams SGLang and vLLM have, wired by the engine's loop:
  - `Scheduler` (scheduler.py): the waiting and running requests, admission, retraction, the KV
    blocks and the prefix cache, draft budgets. No torch forward.
  - `ModelRunner` (runner.py): the model's features, the forward over a step, drafting and
    verification, reading the outputs back; `prepare()` after each change of the weights.
  - `WeightStore` (weights.py, `engine.weights`): every way new weights arrive (tensors, a
    checkpoint folder, a delta, the colocated handoff, the transports' begin/commit/abort),
    checksums, random fill, release and reclaim.
The engine keeps the lifecycle, the requests, the control calls (abort, pause, flush, memory).

How a step runs. The engine loop is one asyncio task. Each step, holding the engine lock, it
  1. schedules (scheduler.py): decoding requests get their next token, prefilling ones their
     next prompt chunk, waiting ones are admitted while KV blocks allow; a request short of KV
     memory retracts the newest (its KV into the prefix cache, to be re-prefilled later);
  2. runs the model on one packed row of all scheduled tokens, then samples, on the compute
     thread (compute.py: one thread for all torch work; runner.py), so the event loop (and an
     HTTP server on it) stays responsive;
  3. applies the results: appends tokens, checks stop conditions, finishes requests (their full
     KV blocks go into the prefix cache), and wakes whoever waits on them. A request with
     `max_new_tokens = 0` that asked prompt log-probs is prefill only: it finishes when its prompt
     is computed, having sampled nothing (SGLang's scoring request, a distillation teacher's).
Control calls (abort, pause, flush, weight updates) take the same lock, so they act between
steps; `submit` does not need it. After each weight change the prefix cache is flushed (its KV
came from the old weights) and the runner prepares the new weights, once, before the next step.

Device (`EngineConfig.device`: "cpu", "cuda", "cuda:N", or "auto", which is "cuda" where this
process sees a GPU): the weights, the KV blocks, each step's index tensors and masks, the
sampler's generators and the routed-expert slots live there; what callers get back (token ids,
log-probs, routed experts) is Python values and CPU tensors. Shared-memory weights
(`shared_weights`, the shm transport) are CPU memory, so they go with device "cpu" only.

Bounds: at most `max_running_requests` run and `max_waiting_requests` wait (`submit` raises
`EngineOverloadedError` beyond); KV memory is `kv_cache_mib`; every admitted request fits alone
(`submit` rejects prompt + max_new_tokens beyond the context length).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from miles_async.engine import compute, speculative
from miles_async.engine.config import EngineConfig, resolve_device, shared_on_device
from miles_async.engine.request import (
    GenerateOutput,
    GenerateRequest,
    Phase,
    Request,
    Tokenizer,
    TopLogprobs,
    output_text,
    stop_reason,
)
from miles_async.engine.runner import ModelRunner, StepResult
from miles_async.engine.sampling import make_generator
from miles_async.engine.scheduler import Scheduler, SchedulerLimits, Step
from miles_async.engine.weights import WeightStore, WeightsUnavailableError, parse_version
from miles_async.kernels.precision import auto_dtype
from miles_async.trajectory import spans_of

if TYPE_CHECKING:
    from typing_extensions import Self

# EngineConfig, resolve_device and WeightsUnavailableError live below this module; they are
# imported from here as well, as they always were.
__all__ = ["PAUSE_MODES", "Engine", "EngineConfig", "EngineOverloadedError", "EngineStats",
           "WeightsUnavailableError", "resolve_device"]

log = logging.getLogger(__name__)

# SGLang's pause modes, plus "wait" (ours): finish what is in flight, admit nothing new.
PAUSE_MODES = ("abort", "in_place", "retract", "wait")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`); retry later (HTTP 503)."""


MEMORY_TAGS = ("weights", "kv_cache")


def _memory_tags(tags: Sequence[str] | None) -> set[str]:
    wanted = set(MEMORY_TAGS if tags is None else tags)
    if not wanted <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags must be among {', '.join(MEMORY_TAGS)}, got {sorted(wanted)}")
    return wanted


def _trim_heap() -> None:
    """Have glibc give freed heap memory back to the system (a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int
    num_waiting: int
    num_steps: int
    num_generated_tokens: int
    num_prompt_tokens: int  # prompt tokens of admitted requests (first admission)
    num_cached_prompt_tokens: int  # of which the prefix cache held
    prefix_cache_hit_rate: float
    num_retractions: int
    num_free_blocks: int
    num_cached_blocks: int
    num_blocks: int
    weight_version: str
    paused: str | None
    weights_error: str | None = None  # why nothing is served (torn weights), if so
    num_used_tokens: int = 0  # tokens with KV of the running requests
    # Speculative decoding: verify forwards of decoding requests, drafts proposed, drafts accepted
    num_spec_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    num_finished_requests: int = 0  # since start, aborted ones included
    num_aborted_requests: int = 0
    num_used_blocks: int = 0  # KV blocks requests hold (not free, not evictable prefix cache)


class Engine:
    """Continuous-batching generation over one model; all methods run on one event loop.

    The model is moved to `config.device` if it is elsewhere; `config.device` is then the
    resolved device ("auto" and "cuda" become e.g. "cuda:0"), and `device` the same as a torch.device.
    `scheduler`, `runner` and `weights` are its three parts (see the module docstring); weight
    updates go through `weights` (`await engine.weights.update_from_tensors(...)`, ...).
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, model_path: str | None = None,
                 weight_version: str = "0") -> None:
        config = config or EngineConfig()
        self.device = resolve_device(config.device)
        if config.shared_weights and self.device.type != "cpu":
            raise ValueError(shared_on_device(f"{config.device} (here {self.device})"))
        if config.device != str(self.device):
            config = msgspec.structs.replace(config, device=str(self.device))
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config, self.device)
        self.model, self.cache = self.runner.model, self.runner.cache
        self.vocab_size, self.max_seq_len, self.is_moe = self.runner.vocab_size, self.runner.max_seq_len, self.runner.is_moe
        self._lock = asyncio.Lock()
        self.weights = WeightStore(self.model, double_buffer=config.double_buffer, shared=config.shared_weights,
                                   version=parse_version(weight_version, -1)[0], label=weight_version,
                                   names=self.runner.update_names(), weight_format=self.runner.weight_format,
                                   lock=self._lock, on_change=self._weights_changed,
                                   keep_draft=bool(config.speculative_tokens), model_path=model_path)
        self.scheduler = Scheduler(self.cache, SchedulerLimits(
            max_running_requests=config.max_running_requests, max_prefill_tokens=config.max_prefill_tokens,
            max_seq_len=self.max_seq_len, speculative_tokens=config.speculative_tokens,
            speculative_adaptive=config.speculative_adaptive))
        compute.run_sync(self.runner.prepare)  # the weights as loaded: merged, dequantized, prepacked
        # Every id that ends generation unless ignore_eos: the tokenizer's and the generation config's.
        eos_ids = getattr(tokenizer, "eos_token_ids", None) or [getattr(tokenizer, "eos_token_id", None)]
        self._eos_ids = frozenset(i for i in eos_ids if i is not None)
        self._requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()  # set after every step and every finish (pause "wait" watches it)
        self._task: asyncio.Task | None = None
        self._paused: str | None = None
        self._pause_seq = 0  # "wait": only requests that arrived before this run
        self._counters: collections.Counter[str] = collections.Counter()

    @property
    def model_path(self) -> str | None:
        """The checkpoint folder the weights last came from (the start's, or an update from disk)."""
        return self.weights.model_path

    # ----- construction and lifecycle -----

    @classmethod
    def from_pretrained(cls, path: str, *, config: EngineConfig | None = None,
                        dtype: torch.dtype | None = None) -> Engine:
        """Load a Hugging Face checkpoint folder (and its tokenizer, if it has one) onto `config.device`,
        in `dtype` (default: `config.dtype`, "auto" resolved for that device)."""
        from miles_async.models import load_pretrained
        from miles_async.models.tokenizer import load_tokenizer

        config = config or EngineConfig()
        device = resolve_device(config.device)  # before loading: a clear error for CUDA
        dtype = dtype or getattr(torch, auto_dtype(config.dtype, device))
        model = compute.run_sync(load_pretrained, path, dtype=dtype, device=device)
        # Without tokenizer.json the engine takes token ids only; text requests get a 400.
        tokenizer = load_tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        return cls(model, tokenizer=tokenizer, config=config, model_path=str(path))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        """Abort every request and stop the loop."""
        if self._task is None:
            return
        async with self._lock:
            for request in list(self._requests.values()):
                self._finish(request, {"type": "abort", "message": "the engine is shutting down"})
        self._task.cancel()
        # asyncio.wait, not `await self._task`: it raises CancelledError only when stop() itself is
        # cancelled, never for the loop's own cancellation, so there is nothing to tell apart
        # (Task.cancelling(), which could, is Python 3.11+).
        await asyncio.wait([self._task])
        if not self._task.cancelled():
            self._task.result()  # a loop that ended with an error raises it here
        self._task = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ----- requests -----

    def submit(self, request: GenerateRequest) -> Request:
        """Queue a request and return its state (await `.done`, or pass it to `stream`/`snapshot`).

        Raises ValueError if the request is malformed, EngineOverloadedError if the queue is full.
        """
        if self._task is None:
            raise RuntimeError("the engine is not started: use `async with engine:` or `await engine.start()`")
        # A paused engine queues the request even without weights or KV cache (a colocated run's
        # release: the push that brings them back resumes it); otherwise it refuses at once.
        if self._paused is None and (problem := self.weights.serving_error()) is not None:
            raise WeightsUnavailableError(problem)
        if self._paused is None and self.cache.released:
            raise WeightsUnavailableError("the KV cache was released (release_memory_occupation): "
                                          "resume_memory_occupation first")
        ids = request.input_ids
        params = request.sampling_params
        self._check_request(request)
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting (max_waiting_requests); "
                                        "retry later")
        rid = request.rid or uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"rid {rid!r} is already in flight; give each request its own rid")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_ids)
        state = Request(
            rid=rid, seq=next(self._seq), prompt_ids=list(ids), params=params,
            return_logprob=request.return_logprob, return_routed_experts=request.return_routed_experts,
            generator=None if params.sampling_seed is None else make_generator(params.sampling_seed, self.device),
            stop_token_ids=frozenset(stop_ids),
            # SGLang ignores both without return_logprob
            logprob_start_len=request.logprob_start_len if request.return_logprob else -1,
            top_logprobs_num=request.top_logprobs_num if request.return_logprob else 0)
        self._requests[rid] = state
        if params.max_new_tokens == 0 and state.next_scored_position() is None:  # nothing to compute
            self._finish(state, {"type": "length", "length": 0})
            return state
        self.scheduler.waiting.append(state)
        self._wake.set()
        return state

    def _check_request(self, request: GenerateRequest) -> None:
        ids, params = request.input_ids, request.sampling_params
        if not ids:
            raise ValueError("the prompt is empty: give at least one input id (or non-empty text)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})")
        params.check(self.vocab_size)
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the context length of {self.max_seq_len} tokens; shorten the prompt or lower "
                             "max_new_tokens")
        if request.return_routed_experts and not self.is_moe:
            raise ValueError("return_routed_experts needs a mixture-of-experts model; this one is dense")
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer; this engine has none (use stop_token_ids)")
        if request.return_logprob and not -1 <= request.logprob_start_len <= len(ids):
            raise ValueError(f"logprob_start_len={request.logprob_start_len} is outside [-1, {len(ids)}] (-1: no "
                             f"prompt log-probs; at most the prompt's {len(ids)} tokens)")
        if request.return_logprob and not 0 <= request.top_logprobs_num <= self.vocab_size:
            raise ValueError(f"top_logprobs_num={request.top_logprobs_num} is outside [0, {self.vocab_size}] "
                             "(the vocabulary size)")

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Submit and wait for the final output; cancelling the wait aborts the request."""
        state = self.submit(request)
        try:
            await state.done.wait()
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(state.rid))
            raise
        return self.snapshot(state)

    async def stream(self, state: Request) -> AsyncIterator[GenerateOutput]:
        """Yield a snapshot after every step that changed the request, the last one final."""
        while True:
            await state.updated.wait()
            state.updated.clear()
            yield self.snapshot(state)
            if state.phase is Phase.FINISHED:
                return

    def snapshot(self, state: Request) -> GenerateOutput:
        finished = state.phase is Phase.FINISHED
        text = state.final_text if finished else output_text(state, self.tokenizer)
        return GenerateOutput(
            rid=state.rid, output_ids=list(state.output_ids), text=text, finish_reason=state.finish_reason,
            prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.output_ids),
            cached_tokens=state.cached_tokens, weight_version=self.weight_version,
            weight_versions=list(spans_of(state.weight_versions, state.version_counts, 0)),
            weight_version_labels=[label for label, n in zip(state.version_labels, state.version_counts) if n > 0],
            output_token_logprobs=list(state.output_logprobs) if state.return_logprob else None,
            routed_experts_TLk=state.routed_experts_TLk if finished else None,
            e2e_latency_s=(state.finished_s if finished else time.perf_counter()) - state.created_s,
            spec_verify_ct=state.spec_verify_ct, spec_draft_tokens=state.spec_draft_tokens,
            spec_accepted_drafts=state.spec_accepted_drafts, **self._logprob_fields(state))

    @staticmethod
    def _logprob_fields(state: Request) -> dict[str, Any]:
        """SGLang's prompt log-probs (the first scored position has no log-prob) and top-k lists."""
        if not state.return_logprob:
            return {}
        start = state.logprob_start_len
        scored = state.prompt_ids[start:] if start >= 0 else []
        first: list[float | None] = [None] if scored else []
        fields: dict[str, Any] = {"input_token_logprobs": list(zip(first + list(state.input_logprobs), scored))}
        if state.top_logprobs_num:
            top_first: list[TopLogprobs | None] = [None] if scored else []
            fields["input_top_logprobs"] = top_first + list(state.input_top)
            fields["output_top_logprobs"] = list(state.output_top)
        return fields

    # ----- control -----

    async def abort(self, rid: str | None = None, *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort one request (or all); return how many were aborted (0: unknown or finished).

        `prefix`: every request whose rid starts with `rid`, as SGLang's scheduler matches an
        abort (so "r1" aborts "r1", "r1_0" and "r10" alike; an empty prefix is refused).
        """
        if prefix and not rid and not abort_all:
            raise ValueError("an empty rid prefix would abort every request; give abort_all=True for that")
        async with self._lock:
            if abort_all:
                targets = list(self._requests.values())
            elif prefix:
                targets = [r for r in self._requests.values() if r.rid.startswith(rid or "")]
            else:
                targets = [self._requests[rid]] if rid in self._requests else []
            for request in targets:
                self._finish(request, {"type": "abort", "message": f"request {request.rid} was aborted"})
            return len(targets)

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation (SGLang's modes, plus "wait"); requests submitted meanwhile queue.

        abort: abort everything in flight. in_place: keep running requests and their KV as they
        are. retract: move running requests back to the queue, their KV to the prefix cache (it
        can be flushed; they are recomputed on continue). wait: finish what was submitted
        before this call (returns when it has), admit nothing newer.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        async with self._lock:
            self._paused = mode
            if mode == "abort":
                for request in list(self._requests.values()):
                    self._finish(request, {"type": "abort", "message": "generation was paused (mode abort)"})
            elif mode == "retract":
                self.scheduler.retract_all()
                self._wake.set()
            elif mode == "wait":
                self._pause_seq = next(self._seq)
        while mode == "wait" and self._paused == "wait" and any(
                r.seq < self._pause_seq for r in self._requests.values()):
            self._progress.clear()
            await self._progress.wait()

    async def resume(self) -> None:
        """SGLang's continue_generation."""
        async with self._lock:
            self._paused = None
            self._wake.set()

    async def flush_cache(self) -> int:
        """Drop every cached prefix; return the blocks freed (blocks in use stay with their requests)."""
        async with self._lock:
            return self.scheduler.flush_cache()

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give back the memory of the weights and/or the KV cache (`tags`: "weights", "kv_cache";
        None: both), as SGLang's /release_memory_occupation does for a colocated trainer. The engine
        must be idle (pause it with mode "abort" first); it refuses requests until resumed, and
        released weights come back empty: push a complete version after `resume_memory_occupation`.
        A LoRA engine's weights cannot be released (its base is never pushed again), nor shared-memory
        ones (the shm transport)."""
        wanted = _memory_tags(tags)
        async with self._lock:
            if self._requests:
                raise ValueError(f"{len(self._requests)} requests are in flight: release needs an idle engine "
                                 "(pause with mode \"abort\", or let them finish)")
            if "weights" in wanted:
                if self.runner.lora:
                    raise ValueError("a LoRA engine's base weights are never pushed again: release its kv_cache only")
                await compute.run(self.weights.release)
                await compute.run(self.runner.unprepare)  # made again when a complete version commits
            if "kv_cache" in wanted:
                self.scheduler.invalidate_cache()
                await compute.run(self.cache.release_memory)
            await compute.run(_trim_heap)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Allocate again what `release_memory_occupation` gave back (the KV cache empty, the weights
        zeros: the engine serves once a complete weight version is pushed)."""
        wanted = _memory_tags(tags)
        async with self._lock:
            if "kv_cache" in wanted:
                await compute.run(self.cache.reclaim_memory)
            if "weights" in wanted:
                await compute.run(self.weights.reclaim)
            self._wake.set()

    @property
    def weight_version(self) -> str:
        """The label of the weights being served (SGLang's `weight_version`)."""
        return self.weights.label

    async def _weights_changed(self) -> None:
        """The live weights changed (the store calls this under the lock): the prefix cache's KV
        came from the old ones, and the runner makes what it serves from the new ones, once."""
        self.scheduler.invalidate_cache()
        if self.weights.serving_error() is None:  # torn weights are never served: prepared at their commit
            await compute.run(self.runner.prepare)
        self._wake.set()  # a torn engine waits for this

    def stats(self) -> EngineStats:
        scheduler, counters = self.scheduler, self.scheduler.counters
        prompt, cached = counters["prompt_tokens"], counters["cached_tokens"]
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_steps=counters["steps"],
            num_generated_tokens=self._counters["generated_tokens"], num_prompt_tokens=prompt,
            num_cached_prompt_tokens=cached, prefix_cache_hit_rate=cached / prompt if prompt else 0.0,
            num_retractions=counters["retractions"], num_free_blocks=self.cache.num_free,
            num_cached_blocks=len(self.cache.tree), num_blocks=self.cache.num_blocks,
            weight_version=self.weight_version, paused=self._paused, weights_error=self.weights.serving_error(),
            num_used_tokens=scheduler.num_used_tokens,
            num_spec_verifies=self._counters["spec_verifies"], num_draft_tokens=self._counters["draft_tokens"],
            num_accepted_drafts=self._counters["accepted_drafts"],
            num_finished_requests=self._counters["finished_requests"],
            num_aborted_requests=self._counters["aborted_requests"], num_used_blocks=scheduler.num_used_blocks)

    # ----- the loop -----

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            async with self._lock:
                step = None
                try:
                    step = self._schedule()
                    if step is None:
                        self._wake.clear()
                        continue
                    result = await compute.run(self.runner.execute, step)
                    self._apply(step, result)
                except Exception as e:  # the loop's boundary: fail the step's requests, keep serving
                    log.exception("engine step failed")
                    for request in step.requests if step is not None else list(self.scheduler.running):
                        self._finish(request, {"type": "abort", "message": f"engine step failed: {e!r}"})
            await asyncio.sleep(0)  # let HTTP handlers and control calls in between steps

    def _schedule(self) -> Step | None:
        if self._paused not in (None, "wait") or self.weights.serving_error() is not None or self.cache.released:
            return None
        return self.scheduler.schedule(self._pause_seq if self._paused == "wait" else None)

    def _apply(self, step: Step, result: StepResult) -> None:
        self.scheduler.counters["steps"] += 1
        for (i, _, _), logprob, top in zip(step.scored, result.scored_logprobs, result.scored_top):
            request = step.requests[i]
            request.input_logprobs.append(logprob)
            if top is not None:
                request.input_top.append(top)
        picked = iter(zip(result.tokens, result.logprobs, result.top, result.hidden))
        for request, chunk, sampled, drafts in zip(step.requests, step.chunks, step.sampled, step.drafts):
            assert request.phase is Phase.RUNNING, "requests change phase only under the engine lock"
            request.num_computed += chunk.num_tokens - drafts  # the drafts kept are counted as they are emitted
            if not sampled:
                continue
            tokens, logprobs, tops, hidden = next(picked)
            request.draft_hidden = hidden
            if self.config.speculative_tokens and not request.prefilling:
                request.draft_record = speculative.judged(request.draft_record, drafts, len(tokens) - 1)
                request.spec_verify_ct += 1
                request.spec_draft_tokens += drafts
                request.spec_accepted_drafts += len(tokens) - 1
                self._counters["spec_verifies"] += 1
                self._counters["draft_tokens"] += drafts
                self._counters["accepted_drafts"] += len(tokens) - 1
            if request.prefilling:
                self.scheduler.prefilled(request)  # the prompt (or a re-prefill after retraction) is complete
            if request.params.max_new_tokens == 0:  # prefill only, for the prompt's log-probs (SGLang's scoring)
                self._finish(request, {"type": "length", "length": 0})
                continue
            for j, (token, logprob, top) in enumerate(zip(tokens, logprobs, tops)):
                if j:  # an accepted draft before this token: its KV (written by the verify) is kept
                    request.num_computed += 1
                reason = self._emit(request, token, logprob, top)
                if reason is not None:  # the rest of what the verify accepted is dropped
                    self._finish(request, reason)
                    break
            else:
                request.updated.set()
        self._progress.set()

    def _emit(self, request: Request, token: int, logprob: float, top: TopLogprobs | None) -> dict[str, Any] | None:
        """Append one output token to a request; the finish reason it causes, if any."""
        if top is not None:
            request.output_top.append(top)
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        if (request.weight_versions and request.weight_versions[-1] == self.weights.version
                and request.version_labels[-1] == self.weights.label):
            request.version_counts[-1] += 1
        else:  # the first token, or the first after a weight update (a partial rollout spans it)
            request.weight_versions.append(self.weights.version)
            request.version_labels.append(self.weights.label)
            request.version_counts.append(1)
        self._counters["generated_tokens"] += 1
        return stop_reason(request, token, self.tokenizer)

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        if request.phase is Phase.FINISHED:
            return
        if request.phase is Phase.RUNNING and request.return_routed_experts:  # read before its KV goes
            request.routed_experts_TLk = self.runner.routed_experts(request)
        self.scheduler.drop(request)
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        request.final_text = output_text(request, self.tokenizer)
        request.finished_s = time.perf_counter()
        self._counters["finished_requests"] += 1
        self._counters["aborted_requests"] += int(reason.get("type") == "abort")
        del self._requests[request.rid]
        request.updated.set()
        request.done.set()
        self._progress.set()
