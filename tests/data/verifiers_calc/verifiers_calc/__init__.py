"""Multiplication with a calculator tool, as a Verifiers 0.4 environment (`verifiers.v1`'s own API).

Verifiers finds it by its id, the package's name: `vf-eval verifiers-calc` (with
`--env.agent.runtime.type subprocess`), or in miles-async's recipe
`[task.config] environment = "verifiers-calc"` (recipes/verifiers-calculator.toml). The pieces:
- `CalcTaskset` yields `CalcTask`s: the user asks `m:417*38=` (the same problems as
  miles_async.tasks.calculator);
- `CalcTask` scores a finished trace with two `@vf.reward`s: `correct` (1.0 when the final reply is
  the product) and `answered` (weight 0.25: the episode ended on a plain reply, not a tool call);
- `CalcHarness` is the agent's program: a chat loop run in-process (Verifiers allows a harness
  that makes every model call through the rollout's interception endpoint, which records the
  trace), with one local tool, `multiply(a, b)`. Verifiers' built-in harnesses (`bash`, `null`)
  install a script with uv at run time, which needs a network this package's tests do not have.

Both classes are exported through `__all__`: that is how Verifiers pairs a taskset with its harness.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers exactly.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}]


class CalcData(vf.TaskData):
    a: int
    b: int


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == str(task.a * task.b) else 0.0

    @vf.reward(weight=0.25)
    async def answered(self, trace: vf.Trace) -> float:
        last = trace.assistant_messages[-1] if trace.assistant_messages else None
        return 1.0 if last is not None and not last.tool_calls and (last.content or "").strip() else 0.0


class CalcTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 256
    min_value: int = 2
    max_value: int = 99
    seed: int = 0


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self) -> Iterator[CalcTask]:
        rng = random.Random(f"verifiers-calc:{self.config.seed}")
        for _ in range(self.config.num_tasks):
            a, b = (rng.randint(self.config.min_value, self.config.max_value) for _ in range(2))
            yield CalcTask(CalcData(prompt=f"m:{a}*{b}=", a=a, b=b), self.config.task)


class CalcHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3


class CalcHarness(vf.Harness[CalcHarnessConfig]):
    """Ask; run each `multiply` call the model makes and feed the result back; a plain reply ends it."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData,
                     tool_interception_url: str | None = None) -> vf.ProgramResult:
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": data.prompt_text}]
        try:
            for _ in range(self.config.max_turns):
                reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                              tools=TOOLS)).choices[0].message
                messages.append(reply.model_dump(exclude_none=True))
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": multiply(call)})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def multiply(call: Any) -> str:
    """The tool: the product, or an error the model reads."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
        return str(int(arguments["a"]) * int(arguments["b"])) if call.function.name == "multiply" else \
            f"error: unknown tool {call.function.name!r}"
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return f"error: multiply needs integer arguments a and b ({e})"


__all__ = ["CalcHarness", "CalcTaskset"]
