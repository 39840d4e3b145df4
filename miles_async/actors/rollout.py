"""`RolloutWorker`: generates one sample per request, scores it, and hands back its `Trajectory`.

    RefillScheduler ──Rollout(item, engine, sampling)──► RolloutWorker ──Generate or /generate──► engine
                    ◄── Trajectory (metadata + BlobRef) ──┘   │ token arrays
                                                             ▼
                                              this process's data plane (shared memory)

Consumes `Rollout` (many at once: the handler is concurrent; the scheduler bounds how many);
produces a `miles_async.trajectory.Trajectory` whose token arrays it puts into its process's
data plane: the scheduler, buffer and controller pass the reference on and only the trainer
rank that trains the sample reads the arrays. Two ways to an embedded engine: a `Generate`
message to its `EngineActor` (`rollout.client = "actor"`, the default: ZeroMQ and msgspec, about
twice the requests per second of HTTP and JSON here), or SGLang's HTTP API (`"http"`, as for a
real SGLang server); both answer an `EngineOutput`.

The task is a plug-in (`miles_async.task`) the worker loads from the recipe's `[task]`: it gives
the prompt's token ids and the reward. Multi-turn (`[agent]`): each sample is an episode of the
agent in its environment, talking to the policy through a session of the TITO session server;
when it is over the worker takes the session's trajectory from the `SessionHost` (arrays in the
host's data plane) and the reward from the episode.

What can go wrong, and what the scheduler sees: the engine aborts the request (a weight update
in "abort" mode, a pause, a shutdown): `finish_reason == "abort"`; the engine is unreachable or
answers an error: `finish_reason == "error"` with the message; the reward function raises: the
sample is kept as failed (`finish_reason == "reward_error"`, the exception in `error`), the
worker goes on serving. In every case the sample counts as aborted and its group is dropped
(retried or discarded by the buffer's `on_abort`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import aiohttp
import msgspec
import numpy as np

from miles_async.actors.engine import Generate
from miles_async.actors.external import ServerConfig
from miles_async.actors.sessions import TakeSession
from miles_async.engine.backend import Backend, EngineBackend, GenerateParams, connect
from miles_async.engine.client import EngineHTTPError, EngineOutput, bearer
from miles_async.engine.config import EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.models.config import ModelConfig
from miles_async.models.tokenizer import load_tokenizer
from miles_async.runtime import Actor, ActorDeadError, ActorError, ActorRef, Message, RestartPolicy, handler
from miles_async.task import Completion, Task, TaskSpec, decode_item, load_object, load_task
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, blobs, encode_data

log = logging.getLogger("miles_async.actors.rollout")


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's sampling parameters for rollouts (SGLang's names)."""

    max_new_tokens: int = 16  # tokens generated per sample at most (an agent's: per model call)
    temperature: float = 1.0  # 0: greedy; the trainer's log-probs use the same temperature
    top_p: float = 1.0  # nucleus sampling: keep the most likely tokens up to this probability mass; 1: all
    top_k: int = -1  # keep the k most likely tokens; -1: the whole vocabulary

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 is greedy), got {self.temperature}")


class EngineRestartConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What becomes of an engine whose process dies (the recipe's `[rollout.restart]`).

    It is started again on its node under its name (its samples in flight were already given to
    the other engines): it loads the model, gets the run's current weight version (verified as any
    push, `weights.verify`) and only then rejoins the scheduler and the weight pusher. At most
    `max_restarts` restarts per engine within `within_s` seconds; each waits `backoff_s`, doubled
    for every restart of that engine still within the window, at most `max_backoff_s`. Past the
    limit (or with `max_restarts = 0`) the engine stays dead; when no engine is left the run stops:
    a checkpoint is saved, one line names the cause, exit status 1. An engine whose node is lost
    is not restarted here: its node's return brings fresh engines (`miles-async launch`)."""

    max_restarts: int = 3  # restarts per engine within `within_s` at most; 0: never restart
    within_s: float = 600.0  # the window, in seconds, that restarts count in
    backoff_s: float = 1.0  # seconds before a restart, doubled for each recent restart of that engine
    max_backoff_s: float = 30.0  # the longest wait before a restart, in seconds

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.within_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"rollout.restart needs max_restarts >= 0, within_s > 0, backoff_s >= 0 and "
                             f"max_backoff_s >= 0, got {self.max_restarts}, {self.within_s}, {self.backoff_s} and "
                             f"{self.max_backoff_s}")

    def policy(self) -> RestartPolicy:
        """The runtime's restart policy that decides each restart (`RestartBudget` keeps the count)."""
        return RestartPolicy(mode="on_failure" if self.max_restarts else "never", max_restarts=self.max_restarts,
                             within_s=self.within_s, backoff_s=self.backoff_s, backoff_factor=2.0,
                             max_backoff_s=self.max_backoff_s)


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The rollout side of a run (the recipe's `[rollout]`): engines, workers and how they sample."""

    # Which engine serves the rollouts: our embedded one (the default), a real SGLang server, or vLLM
    # (engine/backend.py); the loop, the evaluator and the session server talk to each alike.
    backend: Backend = "embedded"
    num_engines: int = 1  # rollout engines that generate the samples
    num_workers: int = 1  # rollout workers: each sends requests to any engine and scores the samples
    # How workers reach embedded engines: "actor" (a message to the EngineActor's mailbox) or
    # "http" (SGLang's HTTP API, as for a real SGLang server). Other backends are always "http".
    client: Literal["actor", "http"] = "actor"
    # Requests in flight across a weight update: "continue" (paused in place, they go on under the
    # new weights: a partial rollout spans versions) or "abort_retry" (aborted, generated again).
    partial: Literal["continue", "abort_retry"] = "continue"
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()  # the embedded engine's
    server: ServerConfig = ServerConfig()  # an external engine's (backend "vllm"): how to start or reach it
    engine_threads: int = 1  # torch threads of each engine's compute thread (vLLM: its worker's threads)
    # Give every sample its own sampling seed (from loop.seed and prompt, index, attempt), so a run
    # samples the same whatever the completion order; costs the engine ~10% (a generator per row).
    seeded: bool = False
    restart: EngineRestartConfig = EngineRestartConfig()  # an engine process that dies is started again

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.num_workers < 1 or self.engine_threads < 0:
            raise ValueError(f"rollout.num_engines and rollout.num_workers must be >= 1 and rollout.engine_threads "
                             f">= 0, got {self.num_engines}, {self.num_workers} and {self.engine_threads}")


DEFAULT_ROLLOUT = "miles_async.agents.api:run_episode"


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Multi-turn rollouts (the recipe's `[agent]`): each sample is an episode of `agent` in
    `environment` (dotted paths), talking to the policy through the run's TITO session server."""

    agent: str = ""  # "" = single-turn generation
    # What makes each episode's environment: a dotted path to a class or function, called once per
    # episode (with sandbox= when `sandbox`); or the URL of a served environment, handed to the
    # rollout function as it is (`miles_async.agents.openenv:rollout` connects to OpenEnv's server).
    environment: str = ""
    rollout: str = DEFAULT_ROLLOUT  # drives one episode (agents.api.RolloutFn)
    sandbox: bool = True  # a LocalSandbox per episode for the environment's tools

    def __post_init__(self) -> None:
        if self.agent and not self.environment:
            raise ValueError("[agent] agent needs [agent] environment (a dotted path, or a served environment's URL)")
        if is_served(self.environment) and self.rollout == DEFAULT_ROLLOUT:
            raise ValueError(f"[agent] environment {self.environment!r} is a served environment: it needs a rollout "
                             "function that connects to it (rollout = \"miles_async.agents.openenv:rollout\" for "
                             "OpenEnv's server)")


def is_served(environment: str) -> bool:
    """Whether `[agent] environment` is a URL (a served environment) rather than a dotted path."""
    return environment.startswith(("http://", "https://", "ws://", "wss://"))


def environment_factory(environment: str) -> Callable[..., Any]:
    """What makes an episode's environment from `[agent] environment` (AgentConfig): the object its
    dotted path names, or, for a URL, a function that gives the URL (the rollout function opens it)."""
    if is_served(environment):
        return lambda **_: environment
    factory: Callable[..., Any] = load_object(environment, "environment")
    return factory


class Rollout(Message[Trajectory], frozen=True):
    request_id: int
    prompt_id: int
    index: int
    attempt: int
    engine: str
    engine_url: str
    engine_version: int  # the engine's weight version when the scheduler sent this
    item: Any  # the task's item (plain data once it crossed a node)
    sampling: SamplingConfig
    seed: int | None = None
    engine_actor: str = ""  # an EngineActor's name: ask it directly instead of over HTTP
    routed_experts: bool = False  # MoE: record the experts each token was routed to (R3)


class RolloutWorker(Actor):
    """Generates and scores samples (module docstring); one HTTP client per engine URL.

    `task` and `model_dir` load the task (with the model's tokenizer); `agent`, `sessions` (the
    session host's actor name) and `session_url` make it multi-turn; `api_key` is what the engines'
    and the session server's HTTP APIs want (a multi-node run's)."""

    mailbox_capacity: ClassVar[int] = 4096
    task: Task

    def __init__(self, task: TaskSpec, model_dir: str, *, agent: AgentConfig | None = None, sessions: str = "",
                 session_url: str = "", timeout_s: float = 600.0, api_key: str | None = None,
                 backend: Backend = "embedded", adapter: str = "") -> None:
        self.task_spec = task
        self.backend_kind = backend
        self.adapter = adapter  # a LoRA adapter every request names (external engines taking LoRA pushes)
        self.model_dir = model_dir
        self.agent_config = agent or AgentConfig()
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.agent = self.environment_cls = self.rollout_fn = None
        if self.agent_config.agent:
            if not sessions or not session_url:
                raise ValueError("an agent needs the session server (its actor name and URL)")
            self.agent = load_object(self.agent_config.agent, "agent")
            self.environment_cls = environment_factory(self.agent_config.environment)
            self.rollout_fn = load_object(self.agent_config.rollout, "rollout function")
        self.sessions_name = sessions
        self.sessions: ActorRef | None = None
        self.session_url = session_url.rstrip("/")
        self.agent_http: aiohttp.ClientSession | None = None
        self.backends: dict[str, EngineBackend] = {}  # by engine URL
        self.engine_refs: dict[str, ActorRef] = {}
        self.moe_shape: tuple[int, int] | None = None

    async def on_start(self) -> None:
        tokenizer = await asyncio.to_thread(load_tokenizer, self.model_dir)
        self.task = load_task(self.task_spec, tokenizer)
        self.moe_shape = ModelConfig.from_hf(self.model_dir).moe_shape

    async def on_stop(self) -> None:
        for backend in self.backends.values():
            await backend.close()
        if self.agent_http is not None:
            await self.agent_http.close()

    async def on_failure(self, failure: Any) -> None:
        await self.on_stop()

    def _backend(self, url: str) -> EngineBackend:
        backend = self.backends.get(url)
        if backend is None:
            backend = self.backends[url] = connect(self.backend_kind, url, api_key=self.api_key,
                                                   timeout_s=self.timeout_s, adapter=self.adapter)
        return backend

    async def _engine_ref(self, name: str) -> ActorRef:
        ref = self.engine_refs.get(name)
        if ref is None:
            ref = self.engine_refs[name] = await self.system.lookup(name, timeout_s=self.timeout_s)
        return ref

    async def _generate(self, msg: Rollout, prompt_ids: list[int]) -> EngineOutput:
        s = msg.sampling
        if msg.engine_actor:
            sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                      top_k=s.top_k, sampling_seed=msg.seed)
            ref = await self._engine_ref(msg.engine_actor)
            try:
                return await ref.ask(Generate(request=GenerateRequest(
                    input_ids=prompt_ids, sampling_params=sampling, return_logprob=True,
                    return_routed_experts=msg.routed_experts)), timeout_s=self.timeout_s)
            except ActorDeadError:
                # An engine started again under its name listens elsewhere (another port on another
                # node): the next request looks it up afresh.
                if self.engine_refs.get(msg.engine_actor) is ref:
                    del self.engine_refs[msg.engine_actor]
                raise
        params = GenerateParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, seed=msg.seed, return_routed_experts=msg.routed_experts)
        return await self._backend(msg.engine_url).generate(prompt_ids, params, version=msg.engine_version)

    def _identity(self, msg: Rollout, submit_s: float) -> dict[str, Any]:
        return {"prompt_id": msg.prompt_id, "index": msg.index, "attempt": msg.attempt, "request_id": msg.request_id,
                "engine": msg.engine, "submit_s": submit_s}

    @handler(concurrent=True)
    async def rollout(self, msg: Rollout) -> Trajectory:
        item = decode_item(self.task, msg.item)
        if self.agent is not None:
            return await self._episode(msg, item)
        submit_s = time.time()
        prompt_ids = self.task.prompt_ids(item)
        num_prompt = len(prompt_ids)
        try:
            out = await self._generate(msg, prompt_ids)
        except (EngineHTTPError, OSError, TimeoutError, ActorError) as e:  # the engine's failure: report it
            return failed(msg, submit_s, num_prompt, "error", f"{type(e).__name__}: {e}")
        reward, finish, error = 0.0, out.finish_reason, ""
        if finish != "abort":
            try:
                reward = float(await self.task.reward(item, Completion(text=out.text, token_ids=out.output_ids,
                                                                       finish_reason=finish)))
            except Exception as e:  # noqa: BLE001 - a user's reward function: report, keep serving
                log.warning("reward function failed on prompt %d: %r", msg.prompt_id, e)
                finish, error = "reward_error", f"{type(e).__name__}: {e}"
        num_out = len(out.output_ids)
        versions = tuple(VersionSpan(version=v.version, start=v.start + num_prompt, end=v.end + num_prompt)
                         for v in out.weight_versions) or (VersionSpan(msg.engine_version, num_prompt, num_prompt),)
        data_ref = None
        if num_out:
            experts = None
            if out.routed_experts and self.moe_shape is not None:
                experts = np.frombuffer(out.routed_experts, dtype="<i4").reshape(-1, *self.moe_shape)
            data = TokenData.build(tokens=prompt_ids + out.output_ids, loss_mask=[0] * num_prompt + [1] * num_out,
                                   logprobs=[0.0] * num_prompt + out.output_logprobs, routed_experts=experts)
            data_ref = self.system.dataplane.put(encode_data(data))
        return Trajectory(**self._identity(msg, submit_s), finish_reason=finish, error=error, reward=reward,
                          versions=versions, num_tokens=num_prompt + num_out, num_prompt_tokens=num_prompt,
                          num_generated_tokens=num_out, prompt_tokens_sent=num_prompt, cached_tokens=out.cached_tokens,
                          end_s=time.time(), data=data_ref, spec_verify_ct=out.spec_verify_ct,
                          spec_draft_tokens=out.spec_draft_tokens, spec_accepted_drafts=out.spec_accepted_drafts)

    async def _episode(self, msg: Rollout, item: Any) -> Trajectory:
        """One agent episode in its own session (and sandbox); its trajectory is the sample."""
        from miles_async.agents.sandbox import LocalSandbox

        assert self.rollout_fn is not None and self.environment_cls is not None
        submit_s = time.time()
        session_id = f"p{msg.prompt_id}-i{msg.index}-a{msg.attempt}-r{msg.request_id}"
        sandbox = LocalSandbox() if self.agent_config.sandbox else None
        environment = self.environment_cls(sandbox=sandbox) if sandbox is not None else self.environment_cls()
        s = msg.sampling
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens}
        if self.agent_http is None:
            self.agent_http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                    headers=bearer(self.api_key))  # a session server off node 0
        if self.sessions is None:
            self.sessions = await self.system.lookup(self.sessions_name, timeout_s=self.timeout_s)
        try:
            episode = await self.rollout_fn(self.agent, environment, item,
                                            f"{self.session_url}/sessions/{session_id}/v1", sampling=sampling,
                                            sandbox=sandbox, http=self.agent_http)
        finally:
            if sandbox is not None:
                await sandbox.close()
        taken = await self.sessions.ask(TakeSession(session_id=session_id), timeout_s=self.timeout_s)
        if episode.error or taken is None:
            if taken is not None:
                self.system.dataplane.free(blobs([taken]))
            return failed(msg, submit_s, 0, "error", episode.error or "the episode made no turn")
        finish = "abort" if taken.finish_reason == "abort" else taken.finish_reason
        return msgspec.structs.replace(taken, **self._identity(msg, submit_s), finish_reason=finish,
                                       reward=episode.reward or 0.0, scored=episode.reward is not None,
                                       end_s=time.time())


def failed(msg: Rollout, submit_s: float, num_prompt: int, finish: str, error: str) -> Trajectory:
    """A sample that produced nothing to train on (its group is dropped as aborted)."""
    return Trajectory(prompt_id=msg.prompt_id, index=msg.index, attempt=msg.attempt, request_id=msg.request_id,
                      engine=msg.engine, finish_reason=finish, error=error,
                      versions=(VersionSpan(msg.engine_version, num_prompt, num_prompt),), num_tokens=num_prompt,
                      num_prompt_tokens=num_prompt, submit_s=submit_s, end_s=time.time())
