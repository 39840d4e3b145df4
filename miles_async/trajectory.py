"""The trajectory: one typed record of a sample, from the engine's reply to the optimizer.

    engine reply ──► RolloutWorker ──Trajectory──► RefillScheduler ──Group──► Buffer ──Batch──► controller
      (JSON/msgpack,    (reward;       (metadata + a BlobRef: the          (typed whatever the   │ each rank
       the edge)        arrays into    arrays stay in the worker's          placement)           ▼ its share
                        the data plane) data plane)                                     TrainerRank: arrays
                                                                                        read, packed to tensors

A single-turn sample and a multi-turn agent episode are the same record: the whole token
sequence (prompts, generated tokens, tool outputs), a loss mask that is 1 exactly on the tokens
the model generated, the rollout log-prob of every token (0.0 where masked), the weight-version
spans the generated tokens were sampled under, the routed experts of an MoE model (R3), the
reward, and what the scheduler, buffer, trace and metrics need to know about it.

The per-token arrays (`TokenData`) are the bulk of a sample and never ride in control messages:
the rollout worker puts them into its process's data plane (`miles_async.runtime.dataplane`)
and the record carries the `BlobRef`; a trainer rank reads its share of a batch from there (zero
copy on one node). At the edges the arrays travel inline: over HTTP (the session server's
`/sessions/{id}/samples`, as base64 in JSON) and in tests. Versions are integers everywhere.

Array layout (STYLE rule 10, T tokens of the trajectory, R rows of routed experts, L MoE layers,
k experts per token): token ids int32 [T]; loss mask uint8 [T]; log-probs float32 [T]; routed
experts [R, L, k] with R = T or T - 1 (the engine never forwards the last token), stored as
uint8 when the model has at most 256 experts (int16/int32 beyond), so R3 costs L * k bytes a
token rather than SGLang's 4 * L * k; all little-endian.

Try it:
    data = TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.1])
    t = Trajectory(prompt_id=7, num_tokens=4, num_prompt_tokens=2, num_generated_tokens=2,
                   versions=(VersionSpan(version=3, start=2, end=4),), reward=1.0, data=data)
    t.weight_versions  # (3,)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from miles_async.runtime.messages import BlobRef

ABORTED = frozenset({"abort", "error", "reward_error"})  # finish reasons of a sample that did not finish
EXPERT_DTYPES: dict[str, Any] = {"uint8": np.uint8, "int16": np.int16, "int32": np.int32}


class VersionSpan(msgspec.Struct, frozen=True, array_like=True):
    """Tokens [start, end) of a trajectory were sampled under weight `version`."""

    version: int
    start: int
    end: int


class TokenData(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The per-token arrays of one trajectory, as little-endian bytes (module docstring)."""

    tokens: bytes  # int32 [T]
    loss_mask: bytes  # uint8 [T]: 1 on the tokens the model generated (trained), 0 elsewhere
    logprobs: bytes  # float32 [T]: the rollout's log-prob of each token, 0.0 where the mask is 0
    routed_experts: bytes = b""  # [R, L, k] (R = T or T - 1), `experts_dtype`; empty: none recorded
    experts_dtype: Literal["", "uint8", "int16", "int32"] = ""
    experts_shape: tuple[int, int] = (0, 0)  # (L, k)
    ref_logprobs: bytes = b""  # float32 [T]: a reference policy's log-probs (KL term); empty: none
    teacher_logprobs: bytes = b""  # float32 [T]: a teacher's log-probs of the same tokens (distillation); empty: none

    @classmethod
    def build(cls, *, tokens: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray,
              logprobs: Sequence[float] | np.ndarray, routed_experts: np.ndarray | None = None,
              ref_logprobs: Sequence[float] | np.ndarray | None = None,
              teacher_logprobs: Sequence[float] | np.ndarray | None = None) -> TokenData:
        """From per-token sequences; `routed_experts` an integer array [R, L, k] (any int dtype)."""
        experts, shape = b"", (0, 0)
        dtype: Literal["", "uint8", "int16", "int32"] = ""
        if routed_experts is not None and routed_experts.size:
            if routed_experts.ndim != 3:
                raise ValueError(f"routed_experts must be [tokens, MoE layers, top_k], got shape {routed_experts.shape}")
            dtype = compact_expert_dtype(int(routed_experts.max()))
            experts = np.ascontiguousarray(routed_experts, dtype=EXPERT_DTYPES[dtype]).astype(
                np.dtype(EXPERT_DTYPES[dtype]).newbyteorder("<"), copy=False).tobytes()
            shape = (int(routed_experts.shape[1]), int(routed_experts.shape[2]))
        data = cls(tokens=np.asarray(tokens, dtype="<i4").tobytes(), loss_mask=np.asarray(loss_mask, dtype=np.uint8).tobytes(),
                   logprobs=np.asarray(logprobs, dtype="<f4").tobytes(), routed_experts=experts,
                   experts_dtype=dtype, experts_shape=shape,
                   ref_logprobs=b"" if ref_logprobs is None else np.asarray(ref_logprobs, dtype="<f4").tobytes(),
                   teacher_logprobs=b"" if teacher_logprobs is None else np.asarray(teacher_logprobs,
                                                                                    dtype="<f4").tobytes())
        data.check()
        return data

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<i4")

    def mask(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask, dtype=np.uint8)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype="<f4")

    def ref_logprob_array(self) -> np.ndarray | None:
        return np.frombuffer(self.ref_logprobs, dtype="<f4") if self.ref_logprobs else None

    def teacher_logprob_array(self) -> np.ndarray | None:
        return np.frombuffer(self.teacher_logprobs, dtype="<f4") if self.teacher_logprobs else None

    def experts(self) -> np.ndarray | None:
        """The routed experts [R, L, k], or None."""
        if not self.routed_experts:
            return None
        flat = np.frombuffer(self.routed_experts, dtype=np.dtype(EXPERT_DTYPES[self.experts_dtype]).newbyteorder("<"))
        num_layers, top_k = self.experts_shape
        return flat.reshape(-1, num_layers, top_k)

    def check(self) -> None:
        """Raise ValueError naming the array whose length does not match the tokens'."""
        if len(self.tokens) % 4 or not self.tokens:
            raise ValueError(f"TokenData.tokens must be int32 bytes of at least one token, got {len(self.tokens)} bytes")
        n = self.num_tokens
        for name, size in (("loss_mask", len(self.loss_mask)), ("logprobs", len(self.logprobs) // 4)):
            if size != n:
                raise ValueError(f"TokenData.{name} has {size} entries for {n} tokens; give one per token")
        for name, values in (("ref_logprobs", self.ref_logprobs), ("teacher_logprobs", self.teacher_logprobs)):
            if values and len(values) // 4 != n:
                raise ValueError(f"TokenData.{name} has {len(values) // 4} entries for {n} tokens")
        if self.routed_experts:
            num_layers, top_k = self.experts_shape
            itemsize = np.dtype(EXPERT_DTYPES[self.experts_dtype or "int32"]).itemsize
            per_row = num_layers * top_k * itemsize
            rows = len(self.routed_experts) // per_row if per_row else -1
            if per_row == 0 or len(self.routed_experts) % per_row or rows not in (n, n - 1):
                raise ValueError(f"TokenData.routed_experts holds {len(self.routed_experts)} bytes; expected "
                                 f"[tokens ({n}) or tokens - 1, {num_layers}, {top_k}] of {self.experts_dtype}")


def compact_expert_dtype(max_id: int) -> Literal["uint8", "int16", "int32"]:
    """The smallest dtype that holds expert ids up to `max_id`."""
    return "uint8" if max_id < 256 else "int16" if max_id < 32768 else "int32"


class Trajectory(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One sample (module docstring). The policies, buffer, trace and metrics read its metadata;
    only a trainer rank reads `data`."""

    prompt_id: int = -1  # the dataset position of its prompt (or task): the refill policy's prompt id
    index: int = 0  # which of the group's n samples
    attempt: int = 0  # 0 for the first try; +1 each time the prompt is generated again
    request_id: int = -1  # the refill policy's id of this attempt
    engine: str = ""  # the engine that generated it
    finish_reason: str = "stop"  # "stop" | "length" | "abort" | "error" | "reward_error"
    error: str = ""  # what went wrong, for "error" and "reward_error"
    reward: float = 0.0
    versions: tuple[VersionSpan, ...] = ()  # the weight version of every generated token, as spans
    num_tokens: int = 0  # T
    num_prompt_tokens: int = 0  # tokens before the first generated one
    num_generated_tokens: int = 0  # tokens under the loss mask
    num_turns: int = 1  # engine calls (an agent episode makes several)
    prompt_tokens_sent: int = 0  # multi-turn: prompt tokens of every turn, and how many the prefix cache held
    cached_tokens: int = 0
    tool_s: float = 0.0  # time spent outside the engine (tools, environment)
    num_tito_mismatches: int = 0  # multi-turn: turns whose re-tokenization disagreed with the ids used (TITO)
    submit_s: float = 0.0  # time.time() when sent to the engine (or the episode began)
    end_s: float = 0.0
    teacher_s: float = 0.0  # distillation: the teacher's scoring request, and the wait for a free request slot
    # speculative decoding (the engine's counts for this sample): decoding steps, drafts proposed, accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0
    teacher_wait_s: float = 0.0
    data: TokenData | BlobRef | None = None  # the arrays, inline or in the data plane; None: nothing generated
    # False: the environment gave no reward (OpenEnv's "unscored", never 0): `reward` is then
    # meaningless, the sample leaves its group's baseline and gets advantage 0
    scored: bool = True

    @property
    def aborted(self) -> bool:
        """It did not finish (aborted, failed, or its reward could not be computed): its group is dropped."""
        return self.finish_reason in ABORTED

    @property
    def weight_versions(self) -> tuple[int, ...]:
        """The distinct versions its tokens were sampled under, in order."""
        out: list[int] = []
        for span in self.versions:
            if not out or out[-1] != span.version:
                out.append(span.version)
        return tuple(out)

    @property
    def oldest_version(self) -> int:
        return min(span.version for span in self.versions)


def spans_of(versions: Sequence[int], counts: Sequence[int], start: int) -> tuple[VersionSpan, ...]:
    """Spans from consecutive runs: `counts[i]` tokens under `versions[i]`, the first at `start`."""
    spans = []
    for version, count in zip(versions, counts):
        if count > 0:
            spans.append(VersionSpan(version=version, start=start, end=start + count))
            start += count
    return tuple(spans)


def blobs(samples: Iterable[Trajectory]) -> list[BlobRef]:
    """The data-plane blobs of `samples`, for `dataplane.free` once they are done with: inline
    arrays (at the edges, in tests) and samples that generated nothing hold none."""
    return [s.data for s in samples if isinstance(s.data, BlobRef)]


def encode_data(data: TokenData) -> bytes:
    return _ENCODER.encode(data)


def decode_data(buffer: bytes | memoryview) -> TokenData:
    return _DECODER.decode(buffer)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TokenData)
