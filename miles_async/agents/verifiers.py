"""Verifiers environments (Prime Intellect's `verifiers` 0.4) as multi-turn tasks: each sample is one
Verifiers episode whose model calls go to the run's TITO session server.

    # recipes/verifiers-calculator.toml, shortened
    [task]
    plugin = "miles_async.agents.verifiers:VerifiersTask"
    [task.config]
    environment = "verifiers-calc"            # an installed Verifiers environment, by its id
    [task.config.env.agent]                   # Verifiers' own [env] table, as vf-eval reads it
    runtime = {type = "subprocess"}
    [agent]
    agent = "miles_async.agents.verifiers:agent"
    environment = "miles_async.agents.verifiers:VerifiersEnvironment"
    rollout = "miles_async.agents.verifiers:rollout"
    sandbox = false

    pip install 'miles-async[verifiers]' && pip install <the environment's package>
    miles-async run recipes/verifiers-calculator.toml --out runs/vf-calc
    # in this repository: python3 dev.py verifiers, then .venv-verifiers/bin/miles-async run ...

An environment is named by its id, the name of the installed package that exports its `Taskset`
(and maybe a `Harness`) through `__all__`: Verifiers 0.4 imports `verifiers-calc` as
`verifiers_calc` (a hub id, `owner/name@version`, names the same package); tests/data/verifiers_calc
is one, written with Verifiers' API. `[task.config.env]` is the rest of Verifiers' `EnvConfig` (the
agent's runtime, turn limits, the taskset's options under `taskset`), checked by Verifiers when the
task loads, so a wrong id or key fails the run at its start. The items are the taskset's tasks (their
data, cycled when the run outlasts a finite taskset); a taskset has no held-out split of its own, so
the evaluation's items are its first tasks too (pick a test split with the taskset's own options
where it has one). `rollout` (the `RolloutFn`) runs one episode per sample; `agent` is the same
episode as an `Agent`, for whatever drives agents through `agents.api.run_episode`.

Which Verifiers client (the issue's choice): the eval client, OpenAI chat completions relayed to
our session server, not the train client. The train client renders the chat template and tokenizes
on Verifiers' side (its `renderers` package) and wants vLLM's token-level `/inference/v1/generate`:
a second owner of tokenization beside the session server, whose whole point (TITO) is to be the
only one, so that the trained ids are the sampled ids and every re-tokenization mismatch is counted
(`num_tito_mismatches`). With the eval client the session server records each turn exactly as for
our own agents, and branches, prefix-cache routing and R3 come for free; we would otherwise have to
serve a second generation API on our engines and trust a second chat template rendering.

How an episode finds its session: Verifiers' interception server (one per served environment, many
rollouts multiplexed) keeps one HTTP client per distinct endpoint configuration for its lifetime,
so a per-episode base URL (`.../sessions/{id}/v1`) would leave one client, and its connections,
behind per episode. Every episode therefore uses one endpoint, the session server's `/v1`, and
names its session in the request body: `session_id` rides in the episode's sampling settings
(Verifiers passes unknown sampling keys through to the provider), and the session server takes the
body's `session_id` before the `X-Session-ID` header, which Verifiers fills with its own trace id
(one the rollout worker cannot know in advance, so it cannot be the session that it takes).

The reward is the episode's trace's: the sum of its weighted `@vf.reward`s (`Trace.reward`, the
Verifiers task's rubric); a trace with no reward, or one whose scoring did not run, is unscored
(`Episode.reward = None`). A failed episode (the harness, a tool, setup or scoring raised; Verifiers
records it on the trace) ends as a failed sample (`Episode.error`) and the run goes on. One trace per
episode: an environment with several agent seats (a judge, a simulated user) would put several
conversations in one session, of which only the latest is trained; such environments are refused.
The episodes share the environment: it is loaded and served (`Env.serving()`: its interception
server, its taskset's shared tool servers) once per process and event loop, from the first episode
until the loop ends (or `close_environments()`). The agent's program is the taskset's harness, else
Verifiers' `bash`; its built-in harnesses (`bash`, `null`) set their program up with uv at run time,
which needs uv and a network, where a harness that runs its loop in-process (tests/data's) needs
neither.

Verifiers is imported only here and only when a recipe names it: without it, loading the recipe fails
naming `pip install 'miles-async[verifiers]'`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import aiohttp
import msgspec

from miles_async.agents.api import Agent, AgentContext, Environment, Episode, ToolError, sft_example
from miles_async.task import Completion, Split, load_object

log = logging.getLogger(__name__)

EXTRA = "pip install 'miles-async[verifiers]'"
# Verifiers reads an endpoint's key only from the environment, by variable name. Its subprocess
# runtime drops every variable whose name holds API_KEY, so the harness programs never see it.
API_KEY_VAR = "MILES_ASYNC_SESSION_API_KEY"
MODEL = "policy"  # the model name the episodes send (the session server serves one policy)
SESSION_URL = re.compile(r"(?P<server>.+)/sessions/(?P<session>[^/]+)/v1/?")


class VerifiersUnavailable(ImportError):
    """Verifiers is not installed; the message names the extra."""


def verifiers() -> Any:
    """`verifiers.v1`, imported on first use (module docstring)."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise VerifiersUnavailable(f"this recipe runs a Verifiers environment, and Verifiers is not installed "
                                   f"({e}): {EXTRA}") from e
    return vf


class VerifiersConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`[task.config]` of `VerifiersTask`: the environment's id, and Verifiers' own `[env]` settings."""

    environment: str  # an installed Verifiers environment's id (its package name), e.g. "verifiers-calc"
    env: dict[str, Any] = {}  # the rest of Verifiers' EnvConfig (vf-eval's [env] table); taskset.id is `environment`
    # The environment's ideal conversations, for an SFT warm start (a Verifiers taskset has none of
    # its own): "module:function", called with a task's data (its TaskData as JSON), returning
    # (messages, tools), the conversation and the tools its harness offers. "": none.
    demonstrations: str = ""

    def __post_init__(self) -> None:
        if not self.environment.strip():
            raise ValueError("task.config.environment must name an installed Verifiers environment, e.g. "
                             "\"verifiers-calc\"")
        if importlib.util.find_spec("verifiers") is None:  # said when the recipe loads, before anything starts
            raise ValueError(f"Verifiers environment {self.environment!r}: Verifiers is not installed: {EXTRA}")


class VerifiersItem(msgspec.Struct, frozen=True, kw_only=True):
    """One Verifiers task: its environment (any worker may run it) and its data (its `TaskData` as JSON)."""

    config: VerifiersConfig
    data: dict[str, Any]


def env_config(config: VerifiersConfig) -> Any:
    """Verifiers' `EnvConfig` for `config`, resolved and checked by Verifiers; ValueError naming the problem."""
    verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import env_config_type

    env = dict(config.env)
    taskset = {**(env.get("taskset") or {}), "id": config.environment}
    try:
        validated = env_config_type(config.environment, env.get("id", "")).model_validate({**env, "taskset": taskset})
    except ImportError as e:
        raise ValueError(f"task.config.environment {config.environment!r}: not an installed Verifiers environment "
                         f"({e}); install its package into this Python") from e
    except (TypeError, ValueError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"task.config.env for Verifiers environment {config.environment!r}: {e}") from e
    seats = list(agent_config_fields(validated))
    if len(seats) != 1:
        raise ValueError(f"Verifiers environment {config.environment!r} has {len(seats)} agent seats ({', '.join(seats)}): "
                         "miles-async trains one conversation per episode, so it runs single-agent environments only")
    return validated


class ServedEnv:
    """A Verifiers `Env`, serving: what each episode of its environment runs on."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.task_cls = type(env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()

    def task(self, data: Mapping[str, Any]) -> Any:
        """The Verifiers task from an item's data, built as the taskset's `load()` builds it (and as
        Verifiers' own env server rebuilds a dispatched task)."""
        return self.task_cls(self.data_cls.model_validate(dict(data)), self.env.config.taskset.task)


# (event loop, encoded config) -> the served environment; a holder task per entry keeps it served.
_served: dict[tuple[asyncio.AbstractEventLoop, bytes], asyncio.Future[ServedEnv]] = {}
_holders: set[asyncio.Task[None]] = set()


async def served(config: VerifiersConfig) -> ServedEnv:
    """`config`'s environment, loaded and serving on this event loop (module docstring)."""
    loop = asyncio.get_running_loop()
    for key in [key for key in _served if key[0].is_closed()]:
        del _served[key]
    key = (loop, msgspec.json.encode(config, order="sorted"))
    ready = _served.get(key)
    if ready is None:
        ready = _served[key] = loop.create_future()
        holder = loop.create_task(_hold(config, key, ready), name=f"verifiers:{config.environment}")
        _holders.add(holder)
        holder.add_done_callback(_holders.discard)
    return await asyncio.shield(ready)


async def _hold(config: VerifiersConfig, key: tuple[asyncio.AbstractEventLoop, bytes],
                ready: asyncio.Future[ServedEnv]) -> None:
    """Load the environment and hold `Env.serving()` open until cancelled (the loop ending, or
    `close_environments`); a failure to start is every waiting episode's, and the next one tries again."""
    # Verifiers warns once per failed model call, then re-raises the error from the episode, which
    # fails the sample: our scheduler reports those (counted, with the latest cause), so the
    # per-call warnings would only repeat them, by the dozen when a run stops with episodes in flight.
    logging.getLogger("verifiers.v1.interception.server").setLevel(logging.ERROR)
    try:
        env = verifiers().load_environment(env_config(config))
        async with env.serving():
            ready.set_result(ServedEnv(env))
            await asyncio.Event().wait()
    except Exception as e:  # the environment's code: its episodes fail, the run goes on
        if not ready.done():
            ready.set_exception(e)
        else:
            log.exception("Verifiers environment %r stopped serving", config.environment)
    finally:
        if _served.get(key) is ready:
            del _served[key]
        if not ready.done():  # cancelled while loading: the waiting episodes are being cancelled too
            ready.cancel()


async def close_environments() -> None:
    """Stop serving every Verifiers environment of this process (their interception servers, shared tools)."""
    holders = list(_holders)
    for holder in holders:
        holder.cancel()
    await asyncio.gather(*holders, return_exceptions=True)


def session_of(base_url: str) -> tuple[str, str]:
    """(the session server's URL, the session id) of an episode's `.../sessions/{id}/v1` base URL."""
    match = SESSION_URL.fullmatch(base_url)
    if match is None:
        raise ValueError(f"a Verifiers episode needs the session server's per-session base URL "
                         f"(SERVER/sessions/ID/v1), got {base_url!r}")
    return match["server"], match["session"]


def model_context(base_url: str, sampling: Mapping[str, Any] | None, api_key: str | None) -> Any:
    """The episode's `ModelContext`: the eval client at the session server's shared `/v1`, the run's
    sampling settings (authoritative over the harness's), and the session in `session_id`."""
    vf = verifiers()
    server, session_id = session_of(base_url)
    if api_key:
        os.environ[API_KEY_VAR] = api_key
    client = vf.EvalClientConfig(base_url=f"{server}/v1", api_key_var=API_KEY_VAR)
    return vf.ModelContext(model=MODEL, client=client,
                           sampling=vf.SamplingConfig.model_validate({**(sampling or {}), "session_id": session_id}))


def episode_of(episode: Any) -> Episode:
    """Our `Episode` from a Verifiers one: its trace's answer, turns and reward (module docstring)."""
    traces = episode.traces
    turns = sum(trace.num_turns for trace in traces)
    errors = [*episode.errors, *(error for trace in traces for error in trace.errors)]
    if errors or not episode.ok or not all(trace.ok for trace in traces):
        last = errors[-1] if errors else None
        reason = f"{last.type}: {last.message}" if last else "the episode did not complete"
        return Episode(reward=0.0, num_turns=turns, error=f"Verifiers: {reason}")
    if len(traces) != 1:
        return Episode(reward=0.0, num_turns=turns,
                       error=f"Verifiers: the episode ran {len(traces)} agents; one conversation per episode is trained")
    trace = traces[0]
    rewards = list(trace.rewards.values())
    reward = None if not rewards or any(r is None for r in rewards) else float(trace.reward)
    num_tool_calls = sum(len(message.tool_calls or ()) for message in trace.assistant_messages)
    return Episode(answer=trace.last_reply or None, reward=reward, num_turns=trace.num_turns,
                   num_tool_calls=num_tool_calls)


async def run_verifiers_episode(item: VerifiersItem, base_url: str, *, sampling: Mapping[str, Any] | None = None,
                                api_key: str | None = None) -> Episode:
    """One Verifiers episode of `item` against the session at `base_url`. Whatever the environment
    raises ends the episode as failed (`Episode.error`); cancellation goes through."""
    try:
        served_env = await served(item.config)
        ctx = model_context(base_url, sampling, api_key)
        (slot,) = served_env.env.slots(served_env.task(item.data))
        episode = await served_env.env.run_slot(slot, ctx)
    except Exception as e:  # the environment's code: the episode fails, the run goes on
        log.debug("Verifiers episode failed", exc_info=True)
        return Episode(reward=0.0, error=f"Verifiers: {type(e).__name__}: {e}")
    return episode_of(episode)


async def rollout(agent: Agent, environment: Environment, task: Any, base_url: str, *,
                  sampling: Mapping[str, Any] | None = None, sandbox: Any = None,
                  http: aiohttp.ClientSession | None = None) -> Episode:
    """The `RolloutFn` (`[agent] rollout`): one Verifiers episode per sample; `agent` and
    `environment` are this module's placeholders (the Verifiers harness and task are the real ones)."""
    bearer = http.headers.get("Authorization", "") if http is not None else ""
    return await run_verifiers_episode(task, base_url, sampling=sampling,
                                       api_key=bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else None)


async def agent(ctx: AgentContext) -> str | None:
    """The `Agent` (`[agent] agent`) for callers that drive agents through `agents.api.run_episode`:
    the same episode as `rollout`'s, its reward reported, its failure raised."""
    episode = await run_verifiers_episode(ctx.task, ctx.base_url, sampling=ctx.chat.defaults,
                                          api_key=None if ctx.api_key == "-" else ctx.api_key)
    if episode.error:
        raise RuntimeError(episode.error)
    if episode.reward is not None:
        ctx.report_reward(episode.reward)
    return episode.answer


class VerifiersEnvironment:
    """The `Environment` (`[agent] environment`): Verifiers' task runs the tools and scores the trace,
    so this has no tools and no verdict of its own (None: unscored)."""

    def __init__(self, sandbox: Any = None) -> None:
        self.tools: list[dict[str, Any]] = []
        self.sandbox = sandbox

    async def call_tool(self, name: str, arguments: Mapping[str, Any], task: Any) -> str:
        raise ToolError(f"tool {name!r}: a Verifiers environment runs its tools itself")

    async def verify(self, task: Any, answer: str | None) -> float | None:
        return None


class VerifiersTask:
    """The task plug-in (`miles_async.task.Task`): a Verifiers environment's tasks, each an episode."""

    Config: ClassVar[type[msgspec.Struct]] = VerifiersConfig
    Item: ClassVar[type] = VerifiersItem
    multi_turn = True

    def __init__(self, config: VerifiersConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.env_config = env_config(config)  # a wrong id or key fails here, at the run's start

    def items(self, split: Split, count: int) -> list[VerifiersItem]:
        """The taskset's first `count` tasks, cycled when it has fewer (both splits: module docstring)."""
        taskset = verifiers().load_taskset(self.env_config.taskset)
        tasks = list(itertools.islice(iter(taskset), count))
        if not tasks:
            raise ValueError(f"Verifiers environment {self.config.environment!r} has no tasks")
        data = [task.data.model_dump(mode="json", exclude_defaults=True) for task in tasks]
        return [VerifiersItem(config=self.config, data=data[i % len(data)]) for i in range(count)]

    def prompt_ids(self, item: VerifiersItem) -> list[int]:
        """The task's opening messages under the chat template (an episode's first turn, before any
        system prompt its harness adds)."""
        task = verifiers().TaskData.model_validate(item.data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
        if isinstance(task.prompt, str):
            messages.append({"role": "user", "content": task.prompt})
        else:
            messages += [message.model_dump(mode="json", exclude_none=True) for message in task.prompt or ()]
        return list(self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))

    async def reward(self, item: VerifiersItem, completion: Completion) -> float:
        raise TypeError("a Verifiers task is scored on an episode's trace, not a single generation: run it as "
                        "agent episodes ([agent] in the recipe)")

    def sft_examples(self, items: Sequence[VerifiersItem]) -> list[tuple[list[int], list[int]]]:
        """The conversations `[task.config] demonstrations` writes for `items`, rendered as the
        session server renders them (`agents.api.sft_example`); none without it (then set
        `sft.max_steps = 0`: a Verifiers taskset has no ideal conversations of its own)."""
        if not self.config.demonstrations:
            return []
        demonstration = load_object(self.config.demonstrations, "task.config.demonstrations")
        return [sft_example(self.tokenizer, *demonstration(item.data)) for item in items]
