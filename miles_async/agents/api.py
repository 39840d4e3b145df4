"""The three plug-in layers of a multi-turn rollout, innermost first, each a typed Protocol.

    RolloutFn  drives an episode for the loop (which runs many: n per task, sample by sample)
      └─ Environment  sets a task up (its tools, its sandbox) and verifies the result
           └─ Agent  `async def agent(ctx) -> str | None`: ordinary code, any number of turns

An `Agent` talks to the policy through `ctx.chat`, an OpenAI-compatible client bound to this
episode's session on the TITO session server (the server owns tokenization, so whatever the agent
sends, the tokens the model sampled are the ones trained on), calls tools through
`ctx.call_tool` (the environment runs them, in the sandbox), reads the task's data from
`ctx.task`, and may report a reward itself (`ctx.report_reward`); otherwise the environment's
`verify` scores the agent's final answer. `ctx.base_url` is the session's OpenAI base URL, and
`ctx.api_key` the key the session server wants ("-" when it wants none: on loopback), for an
agent harness of its own (`openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)`).

Each layer can be replaced without the others; `tests/unit/test_agents_api.py` holds the contract
tests a replacement must pass.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import aiohttp
import msgspec


class ToolError(RuntimeError):
    """A tool call that failed (bad arguments, a crash, a sandbox limit): the agent sees its message."""


class Episode(msgspec.Struct, kw_only=True):
    """What one episode produced: the final answer, the reward, how the turns went. A reward of
    None is "unscored" (the environment gave none): the sample leaves its group's baseline."""

    answer: str | None = None
    reward: float | None = None
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    error: str = ""  # the agent raised: the episode counts as failed (reward 0)


@runtime_checkable
class Environment(Protocol):
    """A task's world: the tools an agent may call and the verifier of its answer."""

    tools: list[dict[str, Any]]  # OpenAI tool specs (type "function")

    async def call_tool(self, name: str, arguments: Mapping[str, Any], task: Any) -> str: ...

    async def verify(self, task: Any, answer: str | None) -> float | None:
        """The answer's reward; None: unscored (the environment gives none; never read as 0)."""
        ...


class ChatClient:
    """A minimal OpenAI-compatible chat client (aiohttp) bound to one session's base URL.

    `await chat.complete(messages, tools=...)` returns the assistant message (a dict with
    `content` and `tool_calls`, OpenAI's shape) and counts the turn.
    """

    def __init__(self, base_url: str, session: aiohttp.ClientSession, defaults: Mapping[str, Any]) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = session
        self.defaults = dict(defaults)
        self.num_turns = 0

    async def complete(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                       **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "policy", "messages": list(messages), **self.defaults, **params}
        if tools:
            body["tools"] = list(tools)
        async with self._http.post(f"{self.base_url}/chat/completions", json=body) as response:
            reply = await response.json(content_type=None)
            if response.status != 200:
                message = (reply.get("error") or {}).get("message", reply) if isinstance(reply, dict) else reply
                raise RuntimeError(f"chat completion failed ({response.status}): {message}")
        self.num_turns += 1
        return reply["choices"][0]["message"]


class AgentContext:
    """Everything an agent gets: the chat client, the task, the tools, and a way to report a reward."""

    def __init__(self, *, chat: ChatClient, task: Any, environment: Environment, sandbox: Any = None) -> None:
        self.chat = chat
        self.task = task
        self.environment = environment
        self.sandbox = sandbox
        self.tools = environment.tools
        self.reward: float | None = None
        self.num_tool_calls = 0
        self.num_tool_errors = 0

    @property
    def base_url(self) -> str:
        return self.chat.base_url

    @property
    def api_key(self) -> str:
        """The session server's API key: the bearer token of the episode's HTTP session, else "-"."""
        bearer = self.chat._http.headers.get("Authorization", "")
        return bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else "-"

    def report_reward(self, reward: float) -> None:
        self.reward = float(reward)

    async def call_tool(self, tool_call: Mapping[str, Any]) -> str:
        """Run one OpenAI-shaped tool call; a failure comes back as its message (the agent reads it)."""
        self.num_tool_calls += 1
        function = tool_call.get("function") or {}
        try:
            arguments = function.get("arguments") or "{}"
            parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
            if not isinstance(parsed, dict):
                raise ToolError(f"arguments must be a JSON object, got {arguments!r}")
            return await self.environment.call_tool(str(function.get("name", "")), parsed, self.task)
        except (ToolError, ValueError, TypeError) as e:
            self.num_tool_errors += 1
            return f"error: {e}"


class Agent(Protocol):
    """The innermost layer: `async def agent(ctx) -> str | None`, the final answer (or None)."""

    def __call__(self, ctx: AgentContext) -> Awaitable[str | None]: ...


async def run_episode(agent: Agent, environment: Environment, task: Any, base_url: str, *,
                      sampling: Mapping[str, Any] | None = None, sandbox: Any = None,
                      http: aiohttp.ClientSession | None = None) -> Episode:
    """One episode: the agent against the session at `base_url`, scored by the environment.

    The agent's exceptions end the episode as failed (reward 0, `error` says why); the caller
    (the rollout function) goes on with the others.
    """
    owned = http is None
    http = http or aiohttp.ClientSession()
    chat = ChatClient(base_url, http, sampling or {})
    ctx = AgentContext(chat=chat, task=task, environment=environment, sandbox=sandbox)
    try:
        try:
            answer = await agent(ctx)
        except Exception as e:  # noqa: BLE001 - a user's agent: the episode fails, the run goes on
            return Episode(answer=None, reward=0.0, num_turns=chat.num_turns, num_tool_calls=ctx.num_tool_calls,
                           num_tool_errors=ctx.num_tool_errors, error=f"{type(e).__name__}: {e}")
        reward = ctx.reward if ctx.reward is not None else await environment.verify(task, answer)
        return Episode(answer=answer, reward=None if reward is None else float(reward), num_turns=chat.num_turns,
                       num_tool_calls=ctx.num_tool_calls, num_tool_errors=ctx.num_tool_errors)
    finally:
        if owned:
            await http.close()


def sft_example(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation rendered as the session server renders it (the
    chat template with `tools`): 1 on what the assistant says up to its end-of-turn token, 0 on the
    rest, the prompt, tool outputs and template glue included (an SFT warm start's example: the
    calculator task's; an `agents.openenv.OpenEnvTask` subclass whose environment ships
    demonstrations)."""
    end_id = tokenizer.eos_token_id
    tokens: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.encode(tokenizer.apply_chat_template(list(messages[:i]), tools=list(tools),
                                                                add_generation_prompt=True))
        full = tokenizer.encode(tokenizer.apply_chat_template(list(messages[:i + 1]), tools=list(tools)))
        if full[:len(tokens)] != tokens or prefix[:len(tokens)] != tokens:
            raise ValueError("the chat template is not append-only for these messages")
        mask += [0] * (len(prefix) - len(tokens))
        reply = full[len(prefix):]
        cut = reply.index(end_id) + 1 if end_id in reply else len(reply)
        mask += [1] * cut + [0] * (len(reply) - cut)
        tokens = full
    return tokens, mask


class RolloutFn(Protocol):
    """The outer layer: how the loop drives an episode (the refill scheduler decides which and when,
    sample by sample). `run_episode` is the default; a replacement (retries, a harness of its own,
    several agents in one episode) is named in the recipe (`[agent] rollout`)."""

    async def __call__(self, agent: Agent, environment: Environment, task: Any, base_url: str, *,
                       sampling: Mapping[str, Any] | None = None, sandbox: Any = None,
                       http: aiohttp.ClientSession | None = None) -> Episode: ...


async def rollout_group(agent: Agent, environment: Environment, task: Any, session_urls: Sequence[str],
                        sampling: Mapping[str, Any], rollout: RolloutFn = run_episode) -> list[Episode]:
    """A group's episodes (one per session URL) concurrently through `rollout`, one HTTP session shared."""
    import asyncio

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(rollout(agent, environment, task, url, sampling=sampling, http=http)
                                           for url in session_urls)))
