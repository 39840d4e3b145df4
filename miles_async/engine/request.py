"""What a caller submits to the engine, what it gets back, and the engine's state of one request.

`GenerateRequest` is the input (token ids and sampling parameters; the HTTP layer has already
tokenized any text). Log-probs follow SGLang: with `return_logprob`, every output token's;
`logprob_start_len` >= 0 adds the prompt's from that position on (the first of them has none:
nothing before it is scored); `top_logprobs_num` adds the k most likely tokens at each position.
`GenerateOutput` is a snapshot of a request's progress: the final one has a `finish_reason` in
SGLang's shape ({"type": "stop" | "length" | "abort", ...}). `Request` is the engine's own
mutable record, touched only on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch

from miles_async.engine.sampling import SamplingParams
from miles_async.trajectory import VersionSpan


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (miles_async.models.tokenizer.load_tokenizer has it)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    input_ids: list[int]
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = None
    return_logprob: bool = False
    return_routed_experts: bool = False
    logprob_start_len: int = -1  # with return_logprob: the first prompt position to report (-1: none)
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each reported position


# (log-prob, token id) of one of the k most likely tokens at a position, most likely first.
TopLogprobs = list[tuple[float, int]]


class GenerateOutput(msgspec.Struct, kw_only=True):
    """A request's outputs so far; `finish_reason` is None until it finishes.

    `output_token_logprobs[i]` is the log-prob of `output_ids[i]` (when asked for);
    `input_token_logprobs` pairs (log-prob, token id) for the prompt from `logprob_start_len` on,
    the first log-prob None (SGLang's shape); `input_top_logprobs` / `output_top_logprobs` the k
    most likely tokens at each of those positions (the first input one None);
    `routed_experts_TLk` (MoE, when asked for) covers every token with KV, prompt included:
    prompt_tokens + completion_tokens - 1 rows, as SGLang reports them.
    """

    rid: str
    output_ids: list[int]
    text: str | None
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    output_token_logprobs: list[float] | None = None
    routed_experts_TLk: torch.Tensor | None = None
    e2e_latency_s: float = 0.0
    # The weight version of every output token, as spans over output positions (a partial rollout
    # that ran across a weight update has one span per version), and each span's label (SGLang's
    # `weight_version` text at the time: "3", or a name such as "step-7").
    weight_versions: list[VersionSpan] = []
    weight_version_labels: list[str] = []
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    output_top_logprobs: list[TopLogprobs] | None = None
    # Speculative decoding (an engine with speculative_tokens): decoding steps (SGLang's
    # `spec_verify_ct`), draft tokens proposed and accepted. Accept length: completion_tokens / spec_verify_ct.
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """The engine's record of one request. `num_computed` tokens of prompt+output have KV."""

    rid: str
    seq: int  # arrival order
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    return_routed_experts: bool
    generator: torch.Generator | None
    stop_token_ids: frozenset[int]
    logprob_start_len: int = -1  # -1: no prompt log-probs (GenerateRequest's, -1 unless return_logprob)
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    # Log-probs of prompt tokens logprob_start_len + 1, ... (each scored by the position before it).
    input_logprobs: list[float] = field(default_factory=list)
    input_top: list[TopLogprobs] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    admitted_once: bool = False
    prefilling: bool = False  # admitted, no token sampled since
    cache_epoch: int = 0  # the engine's epoch when this request's KV started; stale after a weight update
    num_retractions: int = 0
    weight_versions: list[int] = field(default_factory=list)  # every version a token was sampled under, in order
    version_counts: list[int] = field(default_factory=list)  # how many output tokens each of them sampled
    version_labels: list[str] = field(default_factory=list)  # the label of each of them
    phase: Phase = Phase.WAITING
    finish_reason: dict[str, Any] | None = None
    routed_experts_TLk: torch.Tensor | None = None
    # Speculative decoding: the policy's final hidden state at the last position with KV (the
    # draft head's input), and the counts SGLang reports: verify steps, drafts proposed, accepted.
    draft_hidden: torch.Tensor | None = None
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0
    # EngineConfig.speculative_adaptive: moving sums of its drafts accepted and judged (speculative.judged)
    draft_record: tuple[float, float] = (1.0, 1.0)
    final_text: str | None = None
    created_s: float = field(default_factory=time.perf_counter)
    finished_s: float = 0.0
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def next_scored_position(self) -> int | None:
        """The next prompt position whose logits the prompt log-probs still need, or None.

        Position p scores prompt token p + 1, so positions logprob_start_len .. len(prompt) - 2
        are needed; the prefix cache must not skip them (the engine caps its match here).
        """
        if self.logprob_start_len < 0:
            return None
        position = self.logprob_start_len + len(self.input_logprobs)
        return position if position < len(self.prompt_ids) - 1 else None


def stop_reason(request: Request, token_id: int, tokenizer: Tokenizer | None) -> dict[str, Any] | None:
    """The finish reason a newly sampled token causes, if any (SGLang's shapes)."""
    if token_id in request.stop_token_ids:
        return {"type": "stop", "matched": token_id}
    if request.params.stop and tokenizer is not None:
        longest = max(len(s) for s in request.params.stop)
        # A character can take up to 4 byte-level tokens; decode enough of the tail to hold any match.
        tail = tokenizer.decode(request.output_ids[-(4 * longest + 4):],
                                skip_special_tokens=request.params.skip_special_tokens)
        for stop in request.params.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if len(request.output_ids) >= request.params.max_new_tokens:
        return {"type": "length", "length": request.params.max_new_tokens}
    return None


def output_text(request: Request, tokenizer: Tokenizer | None) -> str | None:
    """The decoded output, cut before a matched stop string (SGLang trims it too)."""
    if tokenizer is None:
        return None
    text = tokenizer.decode(request.output_ids, skip_special_tokens=request.params.skip_special_tokens)
    reason = request.finish_reason
    if reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return text
