"""OpenEnv environments as multi-turn episodes: one OpenEnv session per episode, its tools given to
the agent as OpenAI tools, its reward the environment's own (`pip install 'miles-async[openenv]'`).

    RolloutWorker ─► rollout(agent, environment, item, session URL)       (agents.api.RolloutFn)
                        │ open_session: reset(seed) or ResourceSessionFactory.create, list the tools
                        ├─► run_episode(agent, session, ...)  ctx.chat ⇄ the policy (TITO session server)
                        │        ctx.call_tool ─► a call_tool step of the environment ─► text
                        │        session.verify ─► the environment's reward, or None: unscored
                        └─► session.close()                   whatever happened

A recipe names the environment by its entry point (try: recipes/openenv-calculator.toml):

    [task]
    plugin = "miles_async.agents.openenv:OpenEnvTask"   # a reset seed per prompt, shared by its group
    [agent]
    agent = "miles_async.agents.openenv:agent"           # chat, run tool calls, stop when done
    rollout = "miles_async.agents.openenv:rollout"       # opens and closes each episode's session
    environment = "calc_env:CalcEnvironment"             # module:object, called once per episode
    # environment = "http://127.0.0.1:8000"             # or one served by OpenEnv's own server
    sandbox = false                                      # the environment isolates itself

What the object gives (called with no argument: a class, or a factory like an OpenEnv `app.py`'s):
- an OpenEnv `Environment`, usually an `MCPEnvironment` whose FastMCP tools become the agent's
  tools. It runs in this process exactly as OpenEnv's server runs one per WebSocket session: the
  same dispatch (`reset_async`/`step_async` where overridden, else `reset`/`step` in a thread;
  reset's keyword arguments filtered by its signature; the MCP session held open), the same action
  parsing (`deserialize_action`), the observation as the server's wire JSON. So the same
  environment served by OpenEnv's server (`create_app`; a URL here, one `GenericEnvClient`
  WebSocket session per episode: the server's `max_concurrent_envs` must cover the episodes in
  flight) gives the agent the same messages, tools, outputs and rewards (the tests check it);
- a `ResourceSessionFactory` (`openenv.core.harness`): `create(task, seed, episode_id)` makes the
  episode's `ResourceSession`, whose `initial_messages`, `list_tools`, `call_tool`, `verify` and
  `close` are used as they are, each in a thread (they are synchronous); or a `ResourceSession`.

An environment author writes an ordinary OpenEnv environment (tests/data/openenv_calc has one):

    class CalcEnvironment(MCPEnvironment):
        def __init__(self):
            mcp = FastMCP("calc")
            @mcp.tool
            def add(a: int, b: int) -> int: ...
            @mcp.tool
            def submit(answer: int) -> str: ...
            super().__init__(mcp)
            self.rubric = ExactAnswer()                       # an openenv.core.rubrics.Rubric
        def reset(self, seed=None, episode_id=None, **kwargs):
            return CalcObservation(prompt="7+12=")            # the agent's first message
        async def step_async(self, action, timeout_s=None, **kwargs):
            observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
            if isinstance(action, CallToolAction) and action.tool_name == "submit":
                observation.done, observation.reward = True, self._apply_rubric(action, observation)
            return observation

(`step_async`, not only `step`: MCPEnvironment overrides it, so OpenEnv's server, and this
adapter like it, never calls a `step` override.) The agent's first messages are the reset
observation's `messages`, else its `prompt` as a user message (in the observation or its
metadata), else the observation as JSON.

How the pieces map, and why. OpenEnv's per-rollout contract is the `ResourceSession` (initial
messages, MCP tools, `call_tool`, `verify`, `close`); ours is an `Environment` (`tools`,
`call_tool`, `verify`) made per episode, driven by a `RolloutFn`. A session needs the task to open
(reset takes its seed) and must be closed after `verify` whatever the agent did, which is a
rollout function's job: `rollout` opens the session, hands it to the ordinary `run_episode` as the
episode's `Environment` (`OpenEnvSession`) and closes it. Everything else stays ours: the agent
talks to the policy through the TITO session server (the tokens trained on are the ones sampled),
and any agent works (`ctx.environment.transcript` holds the initial messages, for the agent to
extend with its turns, which a ResourceSession's `verify` reads; `ctx.environment.done` says the
environment ended the episode). A tool's output is its MCP text content; a failure, the tool's or
the transport's, comes back as "error: ..." and counts as a failed call, never as a crash. The
reward is the environment's, never made up here (OpenEnv's rule): the last reward a step reported,
its rubric having run inside `step`, or a ResourceSession's `verify(...).env_reward` (else the last
reward a tool result carried, as OpenEnv's own resolver reads it). None is OpenEnv's "unscored"
(the agent never submitted; verify failed): the sample leaves its group's baseline
(agents.api.Episode), it is not a 0.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import random
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import aiohttp
import msgspec

from miles_async.agents.api import Agent, AgentContext, Episode, ToolError, run_episode, sft_example
from miles_async.task import Completion, Split

# sft_example (agents.api) is here too: an OpenEnvTask subclass renders its demonstrations with it
__all__ = ["OpenEnvItem", "OpenEnvSession", "OpenEnvTask", "OpenEnvTaskConfig", "agent", "open_session",
           "openai_tool", "rollout", "sft_example"]

log = logging.getLogger("miles_async.agents.openenv")

INSTALL = "pip install 'miles-async[openenv]'"
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
MAX_TURNS = 8  # the default agent's turns, for a task item that does not say (OpenEnvItem does)
TIMEOUT_S = 120.0  # one reset, tool call or verify of the environment, likewise


def openenv_module(name: str) -> Any:
    """`import name` (a module of OpenEnv), or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"OpenEnv environments need the openenv package ({name}: {e}); install it with "
                          f"{INSTALL}") from e


# ----- the task plug-in: which episode each prompt is -----


class OpenEnvTaskConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[task.config]` of `OpenEnvTask`."""

    seed: int = 0  # the items' reset seeds are drawn from it (train and probe from different streams)
    reset: dict[str, Any] = {}  # more keyword arguments of every reset (a ResourceSessionFactory: its task)
    max_turns: int = MAX_TURNS  # the default agent's budget of model turns per episode
    timeout_s: float = TIMEOUT_S  # one reset, tool call or verify of the environment

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.timeout_s <= 0:
            raise ValueError(f"OpenEnvTaskConfig needs max_turns >= 1 and timeout_s > 0, got {self.max_turns} "
                             f"and {self.timeout_s}")


class OpenEnvItem(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt: the episode `reset(seed=seed, **reset)` makes (every episode of its group alike)."""

    index: int
    seed: int
    reset: dict[str, Any] = {}
    max_turns: int = MAX_TURNS
    timeout_s: float = TIMEOUT_S


class OpenEnvTask:
    """The task plug-in (`miles_async.task.Task`) for an OpenEnv environment: its items are reset
    seeds; the prompt and the reward are the environment's, so a sample is always an agent episode.

    OpenEnv environments bring no demonstrations, so there is no SFT warm start (`sft.max_steps =
    0`, or a model that calls tools already: `model.path`); an environment package that has some
    subclasses this task and overrides `sft_examples` (with `sft_example` to render each one).
    """

    Config: ClassVar[type[msgspec.Struct]] = OpenEnvTaskConfig
    Item: ClassVar[type] = OpenEnvItem
    multi_turn = True

    def __init__(self, config: OpenEnvTaskConfig, tokenizer: Any) -> None:
        openenv_module("openenv.core.harness")  # a run without the extra stops at its start, saying so
        self.config = config
        self.tokenizer = tokenizer

    def items(self, split: Split, count: int) -> list[OpenEnvItem]:
        if split not in ("train", "probe"):
            raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
        rng = random.Random(f"openenv:{self.config.seed}:{split}")
        c = self.config
        return [OpenEnvItem(index=i, seed=rng.randrange(2**31), reset=dict(c.reset), max_turns=c.max_turns,
                            timeout_s=c.timeout_s) for i in range(count)]

    def prompt_ids(self, item: OpenEnvItem) -> list[int]:
        raise ValueError("an OpenEnv task's prompt is its environment's reset observation: it runs as agent "
                         "episodes only ([agent] in the recipe; eval.mode 'shared' scores episodes)")

    async def reward(self, item: OpenEnvItem, completion: Completion) -> float:
        raise ValueError("an OpenEnv task's reward is its environment's: it runs as agent episodes only")

    def sft_examples(self, items: Sequence[OpenEnvItem]) -> list[tuple[list[int], list[int]]]:
        raise ValueError("an OpenEnv environment ships no demonstrations for the SFT warm start: set "
                         "sft.max_steps = 0 (or start from a model that calls tools: model.path)")


# ----- OpenEnv's data as ours -----


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP tool (OpenEnv's `Tool`, MCP's `Tool`, or either as JSON) as an OpenAI tool spec."""
    if isinstance(tool, Mapping):
        name, description = tool.get("name"), tool.get("description")
        schema = tool.get("input_schema", tool.get("inputSchema"))
    else:
        name, description = getattr(tool, "name", None), getattr(tool, "description", None)
        schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)
    if not name:
        raise ValueError(f"an MCP tool without a name: {tool!r}")
    parameters = dict(schema) if schema else {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": str(name), "description": description or "",
                                             "parameters": parameters}}


def as_text(value: Any) -> str:
    """A tool's result as the text the model reads (strings as they are, the rest as JSON)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def tool_output(observation: Mapping[str, Any]) -> str:
    """The text of a `call_tool` step's observation (MCP's result: its text content); ToolError for
    a failed call (the observation's `error`, or a result marked as an error)."""
    error = observation.get("error")
    if error:
        raise ToolError(error.get("message", as_text(error)) if isinstance(error, Mapping) else as_text(error))
    result = observation.get("result")
    if isinstance(result, Mapping) and "content" in result:  # MCP's CallToolResult
        text = "\n".join(str(c.get("text", "")) for c in result.get("content") or []
                         if isinstance(c, Mapping) and c.get("type") == "text")
        if result.get("is_error") or result.get("isError"):
            raise ToolError(text or "the tool failed")
        if text:
            return text
        return as_text(result.get("data", result.get("structured_content")))
    if result is not None:
        return as_text(result)
    rest = {k: v for k, v in observation.items() if k not in ("tool_name", "error", "result") and v not in
            (None, "", [], {})}
    return as_text(rest)


def initial_messages(observation: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The agent's first messages from a reset observation (module docstring)."""
    metadata = observation.get("metadata")
    for source in (observation, metadata if isinstance(metadata, Mapping) else {}):
        messages = source.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, Mapping) and "role" in m
                                                           for m in messages):
            return [dict(m) for m in messages]
        prompt = source.get("prompt")
        if isinstance(prompt, str) and prompt:
            return [{"role": "user", "content": prompt}]
    shown = {k: v for k, v in observation.items() if v not in (None, "", [], {})}
    return [{"role": "user", "content": as_text(shown)}]


def reset_arguments(item: Any) -> tuple[int | None, dict[str, Any]]:
    """(seed, more reset arguments) of a task item: an `OpenEnvItem`, a mapping of reset arguments
    (its "seed" taken out), or anything else (no arguments)."""
    if isinstance(item, OpenEnvItem):
        return item.seed, dict(item.reset)
    if isinstance(item, Mapping):
        rest = dict(item)
        seed = rest.pop("seed", None)
        return (None if seed is None else int(seed)), rest
    return None, {}


# ----- one episode's session -----


class OpenEnvSession(abc.ABC):
    """One OpenEnv session as the episode's `Environment` (agents.api): `tools`, `call_tool`,
    `verify`; plus `transcript` (the initial messages, extended by the agent), `done`, `close()`.
    A subclass drives one kind of OpenEnv object: `_call`, `_verify` and `_close`."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, timeout_s: float) -> None:
        self.messages = messages
        self.transcript = [dict(m) for m in messages]
        self.tools = tools
        self.timeout_s = timeout_s
        self.done = False
        self.last_reward: float | None = None  # the last reward a tool call reported
        self.tool_trace: list[dict[str, Any]] = []
        self._closed = False

    async def call_tool(self, name: str, arguments: Mapping[str, Any], task: Any) -> str:
        if self.done:
            raise ToolError(f"the episode is over: {name} was not called")
        try:
            output, done, reward = await asyncio.wait_for(self._call(name, dict(arguments)), self.timeout_s)
        except ToolError:
            raise
        except TimeoutError as e:
            raise ToolError(f"{name} did not answer within {self.timeout_s:g}s") from e
        except Exception as e:  # the environment's code failed: the agent reads why, the run goes on
            raise ToolError(f"{type(e).__name__}: {e}") from e
        self.done = self.done or done
        if reward is not None:
            self.last_reward = reward
        self.tool_trace.append({"tool_name": name, "arguments": dict(arguments), "output": output, "done": done,
                                "reward": reward})
        return output

    async def verify(self, task: Any, answer: str | None) -> float | None:
        try:
            return await asyncio.wait_for(self._verify(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - grading failed: OpenEnv's "unscored", not 0 and not a crash
            log.warning("OpenEnv verify failed (the episode is unscored): %s: %s", type(e).__name__, e)
            return None

    async def close(self) -> None:
        """Release the session once; a failure is logged (the episode's result stands)."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._close(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the environment's cleanup: said, never masks the episode
            log.warning("closing an OpenEnv session failed: %s: %s", type(e).__name__, e)

    @abc.abstractmethod
    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool, float | None]: ...

    @abc.abstractmethod
    async def _verify(self) -> float | None: ...

    @abc.abstractmethod
    async def _close(self) -> None: ...


def _reward(value: Any) -> float | None:
    return None if value is None else float(value)


class _InProcess:
    """An OpenEnv `Environment` object driven as OpenEnv's server drives one per WebSocket session."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.stack = contextlib.AsyncExitStack()
        # A bad tool call already comes back to the agent as text and counts as a failed call; FastMCP
        # would also log each one (a warning, or a traceback) on the run's terminal: errors only.
        logging.getLogger("fastmcp").setLevel(logging.ERROR)
        self.interfaces = openenv_module("openenv.core.env_server.interfaces")
        self.serialization = openenv_module("openenv.core.env_server.serialization")
        self.types = openenv_module("openenv.core.env_server.types")
        self.mcp_types = openenv_module("openenv.core.env_server.mcp_types")

    async def start(self) -> None:
        mcp_session = getattr(self.env, "mcp_session", None)
        if callable(mcp_session):  # held open for the session, as the server does
            await self.stack.enter_async_context(mcp_session())

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        base = self.interfaces.Environment
        if _overrides(self.env.reset_async, base.reset_async):
            observation = await self.env.reset_async(**_accepted(self.env.reset_async, kwargs))
        else:
            observation = await asyncio.to_thread(self.env.reset, **_accepted(self.env.reset, kwargs))
        return self._wire(observation)

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        parsed = self.serialization.deserialize_action(action, self.mcp_types.CallToolAction)
        if _overrides(self.env.step_async, self.interfaces.Environment.step_async):
            observation = await self.env.step_async(parsed)
        else:
            observation = await asyncio.to_thread(self.env.step, parsed)
        return self._wire(observation)

    async def close(self) -> None:
        try:
            await self.stack.aclose()
        finally:
            await asyncio.to_thread(self.env.close)

    def _wire(self, observation: Any) -> dict[str, Any]:
        """The observation as the server sends it: {observation, reward, done} as JSON data."""
        response = self.types.WSObservationResponse(data=self.serialization.serialize_observation(observation))
        wire: dict[str, Any] = json.loads(response.model_dump_json())["data"]
        return wire


class _Served:
    """An environment served by OpenEnv's server: one WebSocket session (`GenericEnvClient`)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        generic = openenv_module("openenv.core.generic_client")
        self.client = generic.GenericEnvClient(base_url=url, connect_timeout_s=min(timeout_s, 30.0),
                                               message_timeout_s=timeout_s)

    async def start(self) -> None:
        await self.client.connect()

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        result = await self.client.reset(**kwargs)
        return {"observation": result.observation, "reward": result.reward, "done": result.done}

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        result = await self.client.step(action)
        return {"observation": result.observation, "reward": result.reward, "done": result.done}

    async def close(self) -> None:
        await self.client.close()


class StepSession(OpenEnvSession):
    """An environment driven by reset and step actions (`list_tools`, `call_tool`), in this process
    or served: the reward is the last one a step reported (None: unscored)."""

    def __init__(self, driver: _InProcess | _Served, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 *, timeout_s: float) -> None:
        super().__init__(messages, tools, timeout_s=timeout_s)
        self.driver = driver

    @classmethod
    async def open(cls, driver: _InProcess | _Served, item: Any, *, episode_id: str, timeout_s: float) -> StepSession:
        seed, kwargs = reset_arguments(item)
        try:
            await asyncio.wait_for(driver.start(), timeout_s)
            reset = await asyncio.wait_for(driver.reset(seed=seed, episode_id=episode_id, **kwargs), timeout_s)
            listed = await asyncio.wait_for(driver.step({"type": "list_tools"}), timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(driver.close(), timeout_s)
            raise
        tools = [openai_tool(t) for t in (listed.get("observation") or {}).get("tools") or []]
        return cls(driver, initial_messages(reset.get("observation") or {}), tools, timeout_s=timeout_s)

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool, float | None]:
        reply = await self.driver.step({"type": "call_tool", "tool_name": name, "arguments": arguments})
        observation = reply.get("observation") or {}
        done, reward = bool(reply.get("done")), _reward(reply.get("reward"))
        try:
            return tool_output(observation), done, reward
        except ToolError:
            self.done = self.done or done  # a failed call may still end the episode, with its reward
            if reward is not None:
                self.last_reward = reward
            raise

    async def _verify(self) -> float | None:
        return self.last_reward

    async def _close(self) -> None:
        await self.driver.close()


class ResourceSessionAdapter(OpenEnvSession):
    """An OpenEnv `ResourceSession` (synchronous: each call in a thread); the reward is its
    `verify(transcript, final_state).env_reward`, else the last reward a tool result carried."""

    def __init__(self, session: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                 timeout_s: float) -> None:
        super().__init__(messages, tools, timeout_s=timeout_s)
        self.session = session

    @classmethod
    async def open(cls, session: Any, *, timeout_s: float) -> ResourceSessionAdapter:
        try:
            messages = await asyncio.wait_for(asyncio.to_thread(session.initial_messages), timeout_s)
            tools = await asyncio.wait_for(asyncio.to_thread(session.list_tools), timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(session.close)
            raise
        return cls(session, [dict(m) for m in messages], [openai_tool(t) for t in tools], timeout_s=timeout_s)

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool, float | None]:
        result = await asyncio.to_thread(self.session.call_tool, name, arguments)
        metadata = result.metadata or {}
        reward = metadata.get("reward")
        if reward is None and isinstance(result.data, Mapping):
            reward = result.data.get("reward")
        if result.error:
            self.done = self.done or bool(result.done)
            raise ToolError(str(result.error))
        return as_text(result.data), bool(result.done), _reward(reward)

    async def _verify(self) -> float | None:
        final_state = {"done": self.done, "tool_trace": list(self.tool_trace)}
        verdict = await asyncio.to_thread(self.session.verify, list(self.transcript), final_state)
        reward = getattr(verdict, "env_reward", None)
        return _reward(reward) if reward is not None else self.last_reward

    async def _close(self) -> None:
        await asyncio.to_thread(self.session.close)


async def open_session(environment: Any, item: Any, *, episode_id: str | None = None) -> OpenEnvSession:
    """Open the episode's session on `environment` (module docstring: what it may be) for `item`."""
    timeout_s = float(getattr(item, "timeout_s", TIMEOUT_S))
    episode_id = episode_id or uuid.uuid4().hex
    if isinstance(environment, str):
        if not environment.startswith(URL_SCHEMES):
            raise TypeError(f"an OpenEnv environment given as text must be a server's URL ({', '.join(URL_SCHEMES)}), "
                            f"got {environment!r}")
        return await StepSession.open(_Served(environment, timeout_s), item, episode_id=episode_id,
                                      timeout_s=timeout_s)
    interfaces = openenv_module("openenv.core.env_server.interfaces")
    harness = openenv_module("openenv.core.harness")
    if isinstance(environment, interfaces.Environment):
        return await StepSession.open(_InProcess(environment), item, episode_id=episode_id, timeout_s=timeout_s)
    if isinstance(environment, harness.ResourceSessionFactory):
        seed, task = reset_arguments(item)
        session = await asyncio.wait_for(asyncio.to_thread(environment.create, task=task, seed=seed,
                                                           episode_id=episode_id), timeout_s)
        return await ResourceSessionAdapter.open(session, timeout_s=timeout_s)
    if isinstance(environment, harness.ResourceSession):
        return await ResourceSessionAdapter.open(environment, timeout_s=timeout_s)
    raise TypeError(f"[agent] environment gave a {type(environment).__module__}.{type(environment).__qualname__}; "
                    "an OpenEnv rollout needs an OpenEnv Environment (openenv.core.env_server.Environment), a "
                    "ResourceSessionFactory or ResourceSession (openenv.core.harness), or the URL of an environment "
                    "served by OpenEnv's server")


# ----- the rollout function and the default agent -----


async def rollout(agent: Agent, environment: Any, task: Any, base_url: str, *,
                  sampling: Mapping[str, Any] | None = None, sandbox: Any = None,
                  http: aiohttp.ClientSession | None = None) -> Episode:
    """One episode in its own OpenEnv session (agents.api.RolloutFn; `[agent] rollout =
    "miles_async.agents.openenv:rollout"`): opened for `task`, closed whatever happens.

    An environment that fails to open (reset raised, the server is unreachable or full) fails
    this episode only (`Episode.error`); an `environment` that is no OpenEnv object is a TypeError,
    and OpenEnv not installed an ImportError naming the extra.
    """
    try:
        session = await open_session(environment, task, episode_id=episode_id(base_url))
    except (TypeError, ImportError):  # the recipe's mistake, or the extra missing: said, never a failed episode
        raise
    except Exception as e:  # noqa: BLE001 - the environment's failure: this episode fails, the run goes on
        log.warning("an OpenEnv session did not open: %s: %s", type(e).__name__, e)
        return Episode(error=f"the OpenEnv session did not open: {type(e).__name__}: {e}")
    try:
        return await run_episode(agent, session, task, base_url, sampling=sampling, sandbox=sandbox, http=http)
    finally:
        await session.close()


def episode_id(base_url: str) -> str:
    """OpenEnv's episode id for the session at `base_url`: the TITO session's id (its URL is
    `.../sessions/{id}/v1`), so the environment's records and the run's trace name the same
    episode; else a fresh one."""
    parts = base_url.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-3] == "sessions" and parts[-1] == "v1" and parts[-2]:
        return parts[-2]
    return uuid.uuid4().hex


async def agent(ctx: AgentContext) -> str | None:
    """The default agent for OpenEnv sessions: send the transcript and the tools, run every tool
    call, stop at a reply without one, when the environment says the episode is done, or after
    the item's `max_turns` model turns. Its answer: the last reply's text."""
    session = ctx.environment
    if not isinstance(session, OpenEnvSession) or not session.transcript:
        raise ValueError("the OpenEnv agent needs an OpenEnv session with initial messages "
                         "([agent] rollout = 'miles_async.agents.openenv:rollout')")
    messages = session.transcript
    answer: str | None = None
    for _ in range(int(getattr(ctx.task, "max_turns", MAX_TURNS))):
        reply = await ctx.chat.complete(messages, tools=ctx.tools)
        answer = reply.get("content") or ""
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        calls = reply.get("tool_calls") or []
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
        if not calls:
            return answer
        for call in calls:
            output = await ctx.call_tool(call)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
            if session.done:
                return answer
    return answer


def _overrides(method: Any, base: Any) -> bool:
    """Whether a bound method is a subclass's own (OpenEnv's server decides sync or async by this)."""
    return getattr(method, "__func__", method) is not base


def _accepted(function: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments `function` takes (all, when it takes **kwargs), as OpenEnv's server filters them."""
    parameters = inspect.signature(function).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}
