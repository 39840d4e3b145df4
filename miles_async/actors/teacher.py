"""On-policy distillation's teacher: an engine that scores the student's own samples, one more
stage of the asynchronous loop.

    RolloutWorker ──Trajectory──► RefillScheduler ──Score──► TeacherScorer ──one request per sample──► teacher engine
                                  (the sample's      │        (at most max_in_flight      input log-probs of the
                                   engine slot is    │         at once: the bound)        trajectory's tokens from its
                                   refilled at once) ▼                                    first generated one on
                                  group ◄── Trajectory + teacher log-probs (a new blob; the old one is freed)
                                    └──► Buffer ──► trainer: policy_loss.distill_coef folds the
                                                    per-token reverse KL into the advantage

The teacher is any model on any backend (`[teacher]`: `path`, a folder or a Hugging Face id with
`revision`, or `pretrained`, and `backend`: "embedded", "sglang" or "vllm"), in an engine process
of its own that never takes a weight update. For each sample that finished, the scorer reads the
token arrays from the data plane and asks the teacher for the log-prob of every token from the
first generated one on, in one prefill-only request: `logprob_start_len` and `max_new_tokens = 0`
on SGLang's API (our engine answers the same; a `ScoreTokens` message for an embedded teacher,
over its mailbox), vLLM's prompt log-probs. The request holds the trajectory's own token ids (a
multi-turn episode's prompts, answers and tool outputs as they were, never re-rendered text);
log-probs off the loss mask (prompts, tool outputs) are stored as 0.0, like the rollout's.

Overlap and bound: a sample's engine slot is refilled before it is scored, so generation goes
on while the teacher works, and training goes on with the batches already in the buffer; a
group reaches the buffer once all its samples are scored. At most `max_in_flight` scoring
requests are out at once (the rest wait in the scorer's queue, in arrival order); admission's
staleness bound caps how many samples can wait. The time each sample spent (`teacher_s`: the
request; `teacher_wait_s`: the queue before it) is in its trace record and the step's metrics
row (`teacher_s` summed over the step's samples, `teacher_busy_fraction`: the share of the step's
wall time the teacher had work); the simulator's `TeacherCost` is fitted from them.

A scoring request that fails (the teacher answers an error) fails its sample as any engine
error does: the group is dropped as aborted and generated again. The teacher's process dying
ends the run (`RunLostError`, a checkpoint saved), as a lost buffer does.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import ClassVar, Literal

import msgspec
import numpy as np

from miles_async.actors.engine import ScoreTokens
from miles_async.actors.external import ServerConfig
from miles_async.engine.backend import Backend, EngineBackend, connect
from miles_async.engine.config import EngineConfig
from miles_async.runtime import Actor, ActorRef, BlobRef, Message, handler
from miles_async.trajectory import TokenData, Trajectory, blobs, decode_data, encode_data

__all__ = ["Score", "TeacherConfig", "TeacherScorer", "TeacherStats", "teacher_logprobs"]


class TeacherConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[teacher]`: on-policy distillation's teacher (module docstring). Naming a model
    turns distillation on; `trainer.policy_loss.distill_coef` (> 0) weighs its signal. The teacher's
    log-probs are its plain distribution's (temperature 1): sample the student at temperature 1 for
    the signal to be the reverse KL between the two (the run warns otherwise)."""

    # A Hugging Face folder (e.g. another run's final_model) or a Hub id `org/name`, as model.path;
    # "" with pretrained "": no teacher.
    path: str = ""
    revision: str = ""  # of a Hub id: a branch, tag or commit, as model.revision
    pretrained: Literal["", "smollm2"] = ""  # a packaged model, as model.pretrained
    backend: Backend = "embedded"  # what serves the teacher: "embedded" (our engine), "sglang" or "vllm"
    engine: EngineConfig = EngineConfig()  # an embedded teacher's engine
    server: ServerConfig = ServerConfig()  # an sglang / vllm teacher's server: started by the run, or `url`
    threads: int = 1  # torch threads of the teacher's engine
    max_in_flight: int = 16  # scoring requests out at once: the stage's bound

    def __post_init__(self) -> None:
        if self.path and self.pretrained:
            raise ValueError(f"teacher.path ({self.path!r}) and teacher.pretrained ({self.pretrained!r}) both name "
                             "the teacher: keep one")
        if self.revision and not self.path:
            raise ValueError(f"teacher.revision {self.revision!r} picks a revision of a Hugging Face id in "
                             "teacher.path, but teacher.path is empty: name the id or remove teacher.revision")
        if self.max_in_flight < 1 or self.threads < 0:
            raise ValueError(f"teacher.max_in_flight must be >= 1 and teacher.threads >= 0, got "
                             f"{self.max_in_flight} and {self.threads}")

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.pretrained)

    def resolve(self) -> Path | None:
        """The teacher's model folder (a local folder, a Hub id's snapshot, the prepared `pretrained`
        one), None without a teacher; ValueError (one line) when `path` names no model."""
        from miles_async.models import SmolLM2Unavailable, smollm2_checkpoint
        from miles_async.models.hub import resolve_model

        if self.pretrained:
            try:
                return Path(smollm2_checkpoint())
            except SmolLM2Unavailable as e:
                raise ValueError(f"teacher.pretrained = {self.pretrained!r}: {e}") from e
        if not self.path:
            return None
        return resolve_model(self.path, self.revision, key="teacher.path", revision_key="teacher.revision").folder

    def folder(self) -> Path:
        """The teacher's model folder (`resolve`); ValueError when there is no teacher."""
        folder = self.resolve()
        if folder is None:
            raise ValueError("[teacher] names no model: set teacher.path or teacher.pretrained")
        return folder


class Score(Message[Trajectory], frozen=True):
    """Score one finished sample; the answer is the sample with its teacher log-probs (a new blob)."""

    sample: Trajectory


class TeacherStats(msgspec.Struct, frozen=True, kw_only=True):
    num_scored: int
    num_failed: int
    busy_s: float  # wall time with at least one request out
    queued: int  # waiting for a free request slot now
    in_flight: int


def teacher_logprobs(mask: np.ndarray, scored: list[float], start: int) -> np.ndarray:
    """The per-token float32 array the trainer reads: `scored` (the log-probs of tokens start..T-1)
    where the loss mask is 1, 0.0 elsewhere and before `start`."""
    out = np.zeros(len(mask), dtype="<f4")
    if len(scored) != len(mask) - start:
        raise ValueError(f"the teacher scored {len(scored)} tokens, expected {len(mask) - start} (tokens {start} to "
                         f"{len(mask) - 1})")
    out[start:] = np.asarray(scored, dtype=np.float32)
    out *= mask.astype(bool)
    return out


class TeacherScorer(Actor):
    """The scoring stage (module docstring). `engine` is an embedded teacher's actor name (scored
    over its mailbox); otherwise `url` and `backend` reach a server of any backend."""

    mailbox_capacity: ClassVar[int] = 4096

    def __init__(self, *, engine: str = "", url: str = "", backend: Backend = "embedded", max_in_flight: int = 16,
                 api_key: str | None = None, timeout_s: float = 600.0) -> None:
        if not engine and not url:
            raise ValueError("TeacherScorer needs the teacher engine's actor name or its URL")
        self.engine_name = engine
        self.url = url
        self.backend_kind = backend
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.slots = asyncio.Semaphore(max_in_flight)  # first come, first served
        self.engine: ActorRef | None = None
        self.backend: EngineBackend | None = None
        self.queued = self.in_flight = 0
        self.num_scored = self.num_failed = 0
        self.busy_s = 0.0
        self._busy_since = 0.0

    async def on_start(self) -> None:
        if self.engine_name:
            self.engine = await self.system.lookup(self.engine_name, timeout_s=60.0)
        else:
            self.backend = connect(self.backend_kind, self.url, api_key=self.api_key, timeout_s=self.timeout_s)

    async def on_stop(self) -> None:
        if self.backend is not None:
            await self.backend.close()

    async def on_failure(self, failure: object) -> None:
        await self.on_stop()

    @handler(concurrent=True)
    async def score(self, msg: Score) -> Trajectory:
        sample = msg.sample
        if sample.aborted or sample.data is None:
            return sample
        queued = time.perf_counter()
        self.queued += 1
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1
        started = time.perf_counter()
        self._busy(+1)
        try:
            inline = isinstance(sample.data, TokenData)
            data = sample.data if isinstance(sample.data, TokenData) else await self._read(sample.data)
            mask = data.mask()
            start = int(np.argmax(mask != 0)) if mask.any() else len(mask)
            if start == 0:
                raise ValueError("the sample's first token is under the loss mask: nothing comes before it to score it")
            scored = await self._request(data.token_ids().tolist(), start) if start < len(mask) else []
            teacher = teacher_logprobs(mask, scored, start)
        except Exception:
            self.num_failed += 1
            raise
        finally:
            self._busy(-1)
            self.slots.release()
        new = msgspec.structs.replace(data, teacher_logprobs=teacher.tobytes())
        if inline:
            ref: TokenData | BlobRef = new
        else:
            ref = self.system.dataplane.put(encode_data(new))
            self.system.dataplane.free(blobs([sample]))
        self.num_scored += 1
        return msgspec.structs.replace(sample, data=ref, teacher_s=time.perf_counter() - started,
                                       teacher_wait_s=started - queued)

    @handler(concurrent=True)
    async def stats(self, msg: GetTeacherStats) -> TeacherStats:
        busy = self.busy_s + (time.perf_counter() - self._busy_since if self.in_flight else 0.0)
        return TeacherStats(num_scored=self.num_scored, num_failed=self.num_failed, busy_s=busy, queued=self.queued,
                            in_flight=self.in_flight)

    async def _read(self, ref: BlobRef) -> TokenData:
        view = await self.system.dataplane.read(ref)
        try:
            return decode_data(view)
        finally:
            view.release()

    async def _request(self, token_ids: list[int], start: int) -> list[float]:
        if self.engine is not None:
            return await self.engine.ask(ScoreTokens(input_ids=token_ids, start=start), timeout_s=self.timeout_s)
        assert self.backend is not None
        return await self.backend.score(token_ids, start)

    def _busy(self, change: int) -> None:
        """Requests out: from 0 to 1 the teacher becomes busy, back to 0 its busy time grows."""
        now = time.perf_counter()
        if change > 0 and self.in_flight == 0:
            self._busy_since = now
        self.in_flight += change
        if self.in_flight == 0:
            self.busy_s += now - self._busy_since


class GetTeacherStats(Message[TeacherStats], frozen=True):
    """The scorer's counters: samples scored and failed, busy time, queue."""
