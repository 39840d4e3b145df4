"""`RolloutWorker`: generates one sample per request through an engine's HTTP API and scores it.

    RefillScheduler ──Rollout(prompt, engine, sampling)──► RolloutWorker ──/generate or Generate──► engine
                    ◄──────────────── SampleOut (tokens, log-probs, versions, reward) ─────┘

Consumes `Rollout` (many at once: the handler is concurrent; the scheduler bounds how many);
produces a `SampleOut`. Two ways to an engine: SGLang's HTTP API through `EngineClient` (a real
SGLang server, or ours: `rollout.client = "http"`), or, for an embedded `EngineActor`, a
`Generate` message to its mailbox (`"actor"`, the default: ZeroMQ and msgspec instead of HTTP and
JSON, which measured here let the engine answer about twice the requests per second). The reward function is named in the recipe by a
dotted path (`package.module:function`), an `async def reward(sample) -> float` given a
`RewardInput` (the task's prompt, the output text and ids).

What can go wrong, and what the scheduler sees: the engine aborts the request (a weight update
in "abort" mode, a pause, a shutdown): `finish_reason == "abort"`; the engine is unreachable or
answers an error: `finish_reason == "error"` with the message; the reward function raises: the
sample is kept as failed (`finish_reason == "reward_error"`, the exception in `error`), the
worker goes on serving. In every case the sample counts as aborted and its group is dropped
(retried or discarded by the buffer's `on_abort`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec

from miles_async.actors.engine import Generate
from miles_async.engine.client import EngineClient, EngineHTTPError
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.runtime import Actor, ActorError, ActorRef, Message, handler
from miles_async.tasks.reverse import Prompt

log = logging.getLogger("miles_async.actors.rollout")
RewardFn = Callable[[Any], Awaitable[float]]


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's sampling parameters for rollouts (SGLang's names)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 is greedy), got {self.temperature}")


class RewardInput(msgspec.Struct, frozen=True, kw_only=True):
    """What a reward function is given."""

    prompt: Prompt
    output_text: str
    output_ids: list[int]
    finish_reason: str


class SampleOut(msgspec.Struct, frozen=True, kw_only=True):
    """One finished sample: everything the buffer, the trainer and the trace need."""

    request_id: int
    prompt_index: int  # the dataset position (the refill policy's prompt id)
    index: int  # which of the group's n samples
    attempt: int
    engine: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error" | "reward_error"
    versions: list[int]  # every weight version its tokens were sampled under (one, unless an update came between)
    reward: float
    submit_s: float  # time.time() when sent to the engine
    end_s: float
    error: str = ""
    # A multi-turn sample (an agent's session): the whole trajectory as one sequence, its mask (1 on
    # the tokens the model generated) and the rollout log-prob of every token (0.0 where masked).
    # Empty for a single turn, which is prompt_ids + output_ids.
    tokens: list[int] = []
    loss_mask: list[int] = []
    token_logprobs: list[float] = []

    @property
    def aborted(self) -> bool:
        return self.finish_reason in ("abort", "error", "reward_error")


class Rollout(Message):
    request_id: int
    prompt_index: int
    index: int
    attempt: int
    engine: str
    engine_url: str
    engine_version: int  # the engine's weight version when the scheduler sent this
    prompt: Prompt
    sampling: SamplingConfig
    seed: int | None = None
    engine_actor: str = ""  # an EngineActor's name: ask it directly instead of over HTTP
    Reply: ClassVar[Any] = SampleOut


def load_reward(path: str) -> RewardFn:
    """`package.module:function` -> the async reward function; ValueError naming what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(f"reward {path!r}: {attr!r} must be an `async def {attr}(sample) -> float` in {module_name}")
    return fn


def _version(label: str, fallback: int) -> int:
    return int(label) if label.lstrip("-").isdigit() else fallback


class RolloutWorker(Actor):
    """Generates and scores samples (module docstring); one HTTP client per engine URL."""

    mailbox_capacity: ClassVar[int] = 4096

    def __init__(self, reward: str, *, timeout_s: float = 600.0) -> None:
        self.reward_fn = load_reward(reward)
        self.timeout_s = timeout_s
        self.clients: dict[str, EngineClient] = {}
        self.engine_refs: dict[str, ActorRef] = {}

    async def on_stop(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def on_failure(self, failure: Any) -> None:
        await self.on_stop()

    def _client(self, url: str) -> EngineClient:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = EngineClient(url, timeout_s=self.timeout_s)
        return client

    async def _engine_ref(self, name: str) -> ActorRef:
        ref = self.engine_refs.get(name)
        if ref is None:
            ref = self.engine_refs[name] = await self.system.lookup(name, timeout_s=self.timeout_s)
        return ref

    async def _generate(self, msg: Rollout) -> tuple[str, list[int], list[float], str, list[int]]:
        """(finish reason, output ids, log-probs, text, versions) from the engine, by mailbox or HTTP."""
        s = msg.sampling
        if msg.engine_actor:
            params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                    top_k=s.top_k, sampling_seed=msg.seed)
            ref = await self._engine_ref(msg.engine_actor)
            reply = await ref.ask(Generate(request=GenerateRequest(input_ids=msg.prompt.input_ids, sampling_params=params,
                                                                   return_logprob=True)), timeout_s=self.timeout_s)
            final = _version(reply.weight_version, msg.engine_version)
            versions = reply.weight_versions or sorted({msg.engine_version, final})
            return (reply.finish_reason or "abort", reply.output_ids, list(reply.output_token_logprobs or []),
                    reply.text, versions)
        params_json: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                       "top_p": s.top_p, "top_k": s.top_k}
        if msg.seed is not None:
            params_json["sampling_seed"] = msg.seed
        out = await self._client(msg.engine_url).generate(input_ids=msg.prompt.input_ids, sampling_params=params_json,
                                                          return_logprob=True)
        meta = out["meta_info"]
        # Every version the tokens were sampled under (our engine reports them; for an engine that
        # reports only the final one, the version at submission and at the end).
        final = _version(str(meta.get("weight_version", "")), msg.engine_version)
        versions = list(meta.get("weight_versions") or sorted({msg.engine_version, final}))
        return ((meta.get("finish_reason") or {}).get("type", "abort"), list(out.get("output_ids") or []),
                [float(entry[0]) for entry in meta.get("output_token_logprobs") or []], out.get("text", ""), versions)

    @handler(concurrent=True)
    async def rollout(self, msg: Rollout) -> SampleOut:
        submit_s = time.time()
        fields: dict[str, Any] = {
            "request_id": msg.request_id, "prompt_index": msg.prompt_index, "index": msg.index,
            "attempt": msg.attempt, "engine": msg.engine, "prompt_ids": list(msg.prompt.input_ids),
            "submit_s": submit_s}
        try:
            finish, output_ids, logprobs, text, versions = await self._generate(msg)
        except (EngineHTTPError, OSError, TimeoutError, ActorError) as e:  # the engine's failure: report it
            return SampleOut(**fields, output_ids=[], output_logprobs=[], output_text="", finish_reason="error",
                             versions=[msg.engine_version], reward=0.0, end_s=time.time(),
                             error=f"{type(e).__name__}: {e}")
        reward, error = 0.0, ""
        if finish != "abort":
            try:
                reward = float(await self.reward_fn(RewardInput(prompt=msg.prompt, output_text=text,
                                                                output_ids=output_ids, finish_reason=finish)))
            except Exception as e:  # noqa: BLE001 - a user's reward function: report, keep serving
                log.warning("reward function failed on prompt %d: %r", msg.prompt_index, e)
                finish, error = "reward_error", f"{type(e).__name__}: {e}"
        return SampleOut(**fields, output_ids=output_ids, output_logprobs=logprobs, output_text=text,
                         finish_reason=finish, versions=versions, reward=reward, end_s=time.time(), error=error)
