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

import base64
import importlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import aiohttp
import msgspec

from miles_async.actors.engine import Generate
from miles_async.engine.client import EngineClient, EngineHTTPError, bearer
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
    prompt_tokens_sent: int = 0  # multi-turn: prompt tokens of every turn, and how many the prefix cache held
    cached_tokens: int = 0
    routed_experts: bytes = b""  # MoE (R3): int32 [tokens - 1, MoE layers, top_k], as TrainSample wants

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
    sampling: SamplingConfig
    prompt: Prompt | None = None  # a single-turn prompt, or:
    task: Any = None  # an agent's task (the environment's own struct; plain data on the wire)
    seed: int | None = None
    engine_actor: str = ""  # an EngineActor's name: ask it directly instead of over HTTP
    routed_experts: bool = False  # MoE: record the experts each token was routed to (R3)
    Reply: ClassVar[Any] = SampleOut


def load_object(path: str, what: str) -> Any:
    """`package.module:name` -> the object; ValueError naming what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: {module_name} has no {attr!r}")
    return getattr(module, attr)


def load_reward(path: str) -> RewardFn:
    """`package.module:function` -> the async reward function; ValueError naming what is wrong."""
    fn = load_object(path, "reward")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"reward {path!r} must be an `async def (sample) -> float`")
    return fn


def _version(label: str, fallback: int) -> int:
    return int(label) if label.lstrip("-").isdigit() else fallback


class RolloutWorker(Actor):
    """Generates and scores samples (module docstring); one HTTP client per engine URL."""

    mailbox_capacity: ClassVar[int] = 4096

    def __init__(self, reward: str, *, timeout_s: float = 600.0, agent: str = "", environment: str = "",
                 session_url: str = "", sandbox: bool = False,
                 rollout: str = "miles_async.agents.api:run_episode", api_key: str | None = None) -> None:
        self.reward_fn = load_reward(reward)
        self.api_key = api_key  # the engines' HTTP API key (a multi-node run's; the session server's too)
        self.timeout_s = timeout_s
        # Agent mode: each sample is an episode of `agent` in `environment`, talking to the policy
        # through a session of the TITO server at `session_url`.
        self.agent = load_object(agent, "agent") if agent else None
        self.environment_cls = load_object(environment, "environment") if environment else None
        self.rollout_fn = load_object(rollout, "rollout function") if agent else None
        self.session_url = session_url.rstrip("/")
        self.sandbox = sandbox
        self.agent_http: aiohttp.ClientSession | None = None
        if self.agent is not None and (self.environment_cls is None or not self.session_url):
            raise ValueError("an agent needs an environment and a session server URL")
        self.clients: dict[str, EngineClient] = {}
        self.engine_refs: dict[str, ActorRef] = {}

    async def on_stop(self) -> None:
        for client in self.clients.values():
            await client.close()
        if self.agent_http is not None:
            await self.agent_http.close()

    async def on_failure(self, failure: Any) -> None:
        await self.on_stop()

    def _client(self, url: str) -> EngineClient:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = EngineClient(url, timeout_s=self.timeout_s, api_key=self.api_key)
        return client

    async def _engine_ref(self, name: str) -> ActorRef:
        ref = self.engine_refs.get(name)
        if ref is None:
            ref = self.engine_refs[name] = await self.system.lookup(name, timeout_s=self.timeout_s)
        return ref

    async def _generate(self, msg: Rollout) -> tuple[str, list[int], list[float], str, list[int], bytes]:
        """(finish reason, output ids, log-probs, text, versions, routed experts) from the engine."""
        s = msg.sampling
        if msg.engine_actor:
            params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                    top_k=s.top_k, sampling_seed=msg.seed)
            ref = await self._engine_ref(msg.engine_actor)
            assert msg.prompt is not None
            reply = await ref.ask(Generate(request=GenerateRequest(
                input_ids=msg.prompt.input_ids, sampling_params=params, return_logprob=True,
                return_routed_experts=msg.routed_experts)), timeout_s=self.timeout_s)
            final = _version(reply.weight_version, msg.engine_version)
            versions = reply.weight_versions or sorted({msg.engine_version, final})
            return (reply.finish_reason or "abort", reply.output_ids, list(reply.output_token_logprobs or []),
                    reply.text, versions, reply.routed_experts)
        params_json: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                       "top_p": s.top_p, "top_k": s.top_k}
        if msg.seed is not None:
            params_json["sampling_seed"] = msg.seed
        assert msg.prompt is not None
        out = await self._client(msg.engine_url).generate(input_ids=msg.prompt.input_ids, sampling_params=params_json,
                                                          return_logprob=True,
                                                          return_routed_experts=msg.routed_experts)
        meta = out["meta_info"]
        # Every version the tokens were sampled under (our engine reports them; for an engine that
        # reports only the final one, the version at submission and at the end).
        final = _version(str(meta.get("weight_version", "")), msg.engine_version)
        versions = list(meta.get("weight_versions") or sorted({msg.engine_version, final}))
        experts = base64.b64decode(meta["routed_experts"]) if meta.get("routed_experts") else b""
        return ((meta.get("finish_reason") or {}).get("type", "abort"), list(out.get("output_ids") or []),
                [float(entry[0]) for entry in meta.get("output_token_logprobs") or []], out.get("text", ""), versions,
                experts)

    async def _episode(self, msg: Rollout) -> SampleOut:
        """One agent episode in its own session (and sandbox); its trajectory is the sample."""
        from miles_async.agents.sandbox import LocalSandbox

        submit_s = time.time()
        session_id = f"p{msg.prompt_index}-i{msg.index}-a{msg.attempt}-r{msg.request_id}"
        sandbox = LocalSandbox() if self.sandbox else None
        environment = self.environment_cls(sandbox=sandbox) if sandbox is not None else self.environment_cls()
        s = msg.sampling
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens}
        if self.agent_http is None:
            self.agent_http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                    headers=bearer(self.api_key))  # a session server off node 0
        http = self.agent_http
        try:
            episode = await self.rollout_fn(self.agent, environment, msg.task,
                                            f"{self.session_url}/sessions/{session_id}/v1", sampling=sampling,
                                            sandbox=sandbox, http=http)
            async with http.get(f"{self.session_url}/sessions/{session_id}/samples") as response:
                body = await response.json(content_type=None) if response.status == 200 else None
            async with http.delete(f"{self.session_url}/sessions/{session_id}"):
                pass
        finally:
            if sandbox is not None:
                await sandbox.close()
        fields: dict[str, Any] = {"request_id": msg.request_id, "prompt_index": msg.prompt_index, "index": msg.index,
                                  "attempt": msg.attempt, "engine": msg.engine, "submit_s": submit_s,
                                  "end_s": time.time(), "reward": episode.reward or 0.0, "error": episode.error,
                                  "output_text": episode.answer or ""}
        samples = (body or {}).get("samples") or []
        if episode.error or not samples:
            return SampleOut(**fields, prompt_ids=[], output_ids=[], output_logprobs=[], versions=[msg.engine_version],
                             finish_reason="error" if episode.error or not samples else "abort")
        sample = samples[-1]  # the latest branch: the trajectory the agent finished on
        meta = body.get("metadata") or {}
        mask = sample["loss_mask"]
        versions = sorted({_version(str(v), msg.engine_version) for v in sample["weight_versions"]}
                          or {msg.engine_version})
        finish = sample.get("finish_reason") or "stop"
        return SampleOut(**fields, prompt_ids=[t for t, m in zip(sample["tokens"], mask) if not m],
                         output_ids=[t for t, m in zip(sample["tokens"], mask) if m], output_logprobs=[],
                         finish_reason="abort" if finish == "abort" else finish, versions=versions,
                         tokens=sample["tokens"], loss_mask=mask, token_logprobs=sample["rollout_logprobs"],
                         prompt_tokens_sent=int(meta.get("prompt_tokens", 0)),
                         cached_tokens=int(meta.get("cached_tokens", 0)),
                         routed_experts=base64.b64decode(sample["routed_experts"]) if sample.get("routed_experts") else b"")

    @handler(concurrent=True)
    async def rollout(self, msg: Rollout) -> SampleOut:
        if self.agent is not None:
            return await self._episode(msg)
        submit_s = time.time()
        fields: dict[str, Any] = {
            "request_id": msg.request_id, "prompt_index": msg.prompt_index, "index": msg.index,
            "attempt": msg.attempt, "engine": msg.engine, "prompt_ids": list(msg.prompt.input_ids if msg.prompt else []),
            "submit_s": submit_s}
        try:
            finish, output_ids, logprobs, text, versions, experts = await self._generate(msg)
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
                         finish_reason=finish, versions=versions, reward=reward, end_s=time.time(), error=error,
                         routed_experts=experts)
