"""A calculator environment written with OpenEnv's own API: the tests' OpenEnv environment.

`reset(seed=s)` asks a question such as `7+12=`; the tools are FastMCP tools (`add`, which fails
past six digits, and `submit`); submitting ends the episode, and the
environment's `Rubric` (`ExactAnswer`) sets the reward: 1.0 for the right answer, else 0.0. An
episode that never submits has no reward (OpenEnv's "unscored"); after `MAX_STEPS` tool calls the
environment ends it, still unscored.

    {"role": "user", "content": "7+12="}
    {"role": "assistant", "tool_calls": [add {"a": 7, "b": 12}]}    -> "19"
    {"role": "assistant", "tool_calls": [submit {"answer": 19}]}    -> done, reward 1.0

`CalcEnvironment` is the entry point a recipe names (`openenv_calc:CalcEnvironment`); served by
OpenEnv's own server it is `openenv_calc.app:app` (`uvicorn openenv_calc.app:app`). `CalcTask` is
miles-async's OpenEnv task with this environment's demonstrations (the ideal conversations) for
the SFT warm start. `EVENTS` records each tool call and reward in this process, for the tests.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Sequence
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric

from miles_async.agents.openenv import OpenEnvItem, OpenEnvTask, open_session, sft_example

MAX_STEPS = 6
MAX_RESULT = 999_999
EVENTS: list[dict[str, Any]] = []  # {"episode_id", "tool", "arguments", "reward", "done"} per tool call


def question(seed: int | None) -> tuple[int, int]:
    """The numbers reset(seed) asks to add."""
    rng = random.Random(seed)
    return rng.randint(2, 49), rng.randint(2, 49)


class CalcObservation(Observation):
    prompt: str = ""  # the question: the agent's first user message


class ExactAnswer(Rubric):
    """The reward of a `submit` call: 1.0 when its answer is the expected one, else 0.0."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: int | None = None

    def forward(self, action: Any, observation: Any) -> float:
        try:
            return 1.0 if int(action.arguments.get("answer")) == self.expected else 0.0
        except (TypeError, ValueError):
            return 0.0


class CalcEnvironment(MCPEnvironment):
    """Arithmetic with calculator tools (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("openenv-calc")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            if abs(a + b) > MAX_RESULT:  # the tool raises: the agent reads the error
                raise OverflowError(f"the calculator shows at most {len(str(MAX_RESULT))} digits")
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer (ends the episode)."""
            return f"submitted {answer}"

        super().__init__(mcp)
        self.rubric = ExactAnswer()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CalcObservation:
        self._reset_rubric()
        a, b = question(seed)
        self.rubric.expected = a + b
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return CalcObservation(prompt=f"{a}+{b}=")

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}: use the tools"})

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _scored(self, action: Action, observation: Observation) -> Observation:
        """A submit ends the episode with the rubric's reward; too many calls end it unscored."""
        if not isinstance(action, CallToolAction):
            return observation
        self._state.step_count += 1
        if action.tool_name == "submit" and getattr(observation, "error", None) is None:
            observation.done = True
            observation.reward = self._apply_rubric(action, observation)
        elif self._state.step_count >= MAX_STEPS:
            observation.done = True
        EVENTS.append({"episode_id": self._state.episode_id, "tool": action.tool_name,
                       "arguments": dict(action.arguments), "reward": observation.reward, "done": observation.done})
        return observation

    @property
    def state(self) -> State:
        return self._state


def demonstration(item: OpenEnvItem) -> list[dict[str, Any]]:
    """The ideal conversation for `item`: add, then submit the sum."""
    a, b = question(item.seed)

    def call(name: str, arguments: dict[str, int]) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}

    return [{"role": "user", "content": f"{a}+{b}="}, call("add", {"a": a, "b": b}),
            {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)}, call("submit", {"answer": a + b})]


class CalcTask(OpenEnvTask):
    """miles-async's OpenEnv task, with this environment's demonstrations for the SFT warm start."""

    _tools: list[dict[str, Any]] | None = None

    def sft_examples(self, items: Sequence[OpenEnvItem]) -> list[tuple[list[int], list[int]]]:
        if CalcTask._tools is None:  # the tool specs exactly as an episode's agent gets them
            CalcTask._tools = asyncio.run(_tools())
        return [sft_example(self.tokenizer, demonstration(item), CalcTask._tools) for item in items]


async def _tools() -> list[dict[str, Any]]:
    session = await open_session(CalcEnvironment(), OpenEnvItem(index=0, seed=0))
    try:
        return session.tools
    finally:
        await session.close()
