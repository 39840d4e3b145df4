"""Multiplication with a calculator tool: the multi-turn demo task, where the answer needs a tool.

The user asks `m:417*38=`; the model cannot multiply, but it has a tool, `multiply(a, b)`, which
the environment runs in the task's sandbox (the `expr` command); the model must call it, read the
result, and answer with it. Reward: 1.0 for the exact product, else 0.0.

    {"role": "user", "content": "m:417*38="}
    {"role": "assistant", "tool_calls": [{"function": {"name": "multiply", "arguments": "{\\"a\\": 417, \\"b\\": 38}"}}]}
    {"role": "tool", "content": "15846"}
    {"role": "assistant", "content": "15846"}

`CalculatorEnv` is the environment layer (tools, sandbox, verifier) and `agent` the agent layer
(call tools until the model answers in plain text, at most `max_turns` turns); see
`miles_async.agents.api`. `sft_transcripts` writes the ideal conversations, for a warm start.
`CalculatorTask` is the task plug-in (`miles_async.task`): a multi-turn task, named in a recipe
as `plugin = "miles_async.tasks.calculator:CalculatorTask"` beside `[agent] agent =
"miles_async.tasks.calculator:agent"` and `environment = "miles_async.tasks.calculator:CalculatorEnv"`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from miles_async.agents.api import AgentContext, ToolError, sft_example
from miles_async.task import Completion, Split

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers exactly.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}]


class CalculatorTaskConfig(msgspec.Struct, frozen=True, kw_only=True):
    min_value: int = 2  # smallest factor (inclusive)
    max_value: int = 999  # largest factor (inclusive)
    seed: int = 0  # the problems drawn (each split its own draw)
    max_turns: int = 3  # model turns per episode at most (tool calls and the answer)

    def __post_init__(self) -> None:
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {self.min_value} and {self.max_value}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    problem_id: int
    a: int
    b: int
    max_turns: int = 3  # the agent's turn budget (CalculatorTaskConfig.max_turns)

    @property
    def text(self) -> str:
        return f"m:{self.a}*{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b)


def problems(config: CalculatorTaskConfig, count: int, split: str = "train") -> list[Problem]:
    """`count` problems, the same for the same config and split (the splits use different streams)."""
    if split not in ("train", "probe"):
        raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
    rng = random.Random(f"calculator:{config.seed}:{split}")
    return [Problem(problem_id=i, a=rng.randint(config.min_value, config.max_value),
                    b=rng.randint(config.min_value, config.max_value), max_turns=config.max_turns)
            for i in range(count)]


class CalculatorEnv:
    """The environment layer: the `multiply` tool (run in the sandbox when one is given) and the verifier."""

    tools = TOOLS

    def __init__(self, sandbox: Any = None, timeout_s: float = 5.0) -> None:
        self.sandbox = sandbox
        self.timeout_s = timeout_s

    async def call_tool(self, name: str, arguments: Mapping[str, Any], task: Any) -> str:
        if name != "multiply":
            raise ToolError(f"unknown tool {name!r}; the tools are: multiply")
        try:
            a, b = int(arguments["a"]), int(arguments["b"])
        except (KeyError, TypeError, ValueError) as e:
            raise ToolError(f"multiply needs integer arguments a and b, got {dict(arguments)!r}") from e
        if self.sandbox is None:
            return str(a * b)
        result = await self.sandbox.run(["expr", str(a), "*", str(b)], timeout_s=self.timeout_s)
        if not result.ok:
            raise ToolError(f"the calculator failed: {result.stderr.strip() or result.killed_reason}")
        return result.stdout.strip()

    async def verify(self, task: Problem, answer: str | None) -> float:
        return 1.0 if answer is not None and answer.strip() == task.answer else 0.0


async def agent(ctx: AgentContext) -> str | None:
    """Ask, run every tool call the model makes, feed the results back; the first plain answer ends it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ctx.task.text}]
    max_turns = getattr(ctx.task, "max_turns", 3)
    for _ in range(max_turns):
        reply = await ctx.chat.complete(messages, tools=ctx.tools)
        message = {"role": "assistant", "content": reply.get("content") or ""}
        if reply.get("tool_calls"):
            message["tool_calls"] = reply["tool_calls"]
        messages.append(message)
        if not reply.get("tool_calls"):
            return reply.get("content")
        for call in reply["tool_calls"]:
            output = await ctx.call_tool(call)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
    return None


def sft_examples(items: list[Problem], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each ideal conversation, rendered as the session server renders it
    (the chat template with the tools): the mask is 1 on what the assistant says, up to and
    including its end-of-turn token, and 0 on the prompt, the tool's output and template glue."""
    return [sft_example(tokenizer, messages, TOOLS) for messages in sft_transcripts(items)]


def sft_transcripts(items: list[Problem]) -> list[list[dict[str, Any]]]:
    """The ideal conversation for each problem (a tool call, its result, the answer): SFT data."""
    out = []
    for p in items:
        call = {"id": "call_0", "type": "function",
                "function": {"name": "multiply", "arguments": msgspec.json.encode({"a": p.a, "b": p.b}).decode()}}
        out.append([{"role": "user", "content": p.text},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_0", "content": p.answer},
                    {"role": "assistant", "content": p.answer}])
    return out


class CalculatorTask:
    """The task plug-in (`miles_async.task.Task`): `Problem`s for an agent with the calculator tool.

    Multi-turn: the run drives each problem as an agent episode and `CalculatorEnv.verify` scores
    it. `prompt_ids` and `reward` serve a single generation (e.g. an evaluation without tools):
    the user's question under the chat template with the tools, scored like the environment does.
    """

    Config: ClassVar[type[msgspec.Struct]] = CalculatorTaskConfig
    Item: ClassVar[type] = Problem
    multi_turn = True

    def __init__(self, config: CalculatorTaskConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def items(self, split: Split, count: int) -> list[Problem]:
        return problems(self.config, count, split)

    def prompt_ids(self, item: Problem) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": item.text}], tools=TOOLS,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text))

    async def reward(self, item: Problem, completion: Completion) -> float:
        return await CalculatorEnv().verify(item, completion.text)

    def sft_examples(self, items: list[Problem]) -> list[tuple[list[int], list[int]]]:
        return sft_examples(items, self.tokenizer)

