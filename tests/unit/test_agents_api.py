"""Contract tests of the agent layers (agents/api.py) with the calculator task: an agent, an
environment and the rollout function, each replaceable. The policy is a scripted OpenAI-compatible
HTTP server (the model is the boundary these tests are not about; the TITO server's own tests
drive the real engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import pytest
from aiohttp import web

from miles_async.agents.api import Environment, Episode, rollout_group, run_episode
from miles_async.tasks.calculator import (
    CalculatorEnv,
    CalculatorTaskConfig,
    Problem,
    agent,
    problems,
    sft_transcripts,
)

TIMEOUT_S = 30


class ScriptedPolicy:
    """Answers each chat completion with the next scripted assistant message; records the requests."""

    def __init__(self, script: list[dict[str, Any]]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        message = self.script[min(len(self.requests) - 1, len(self.script) - 1)]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}]})


async def serve(policy: ScriptedPolicy) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/sessions/{sid}/v1/chat/completions", policy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def tool_call(a: Any, b: Any, name: str = "multiply") -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


PROBLEM = Problem(problem_id=0, a=417, b=38)


@pytest.mark.parametrize(("script", "reward", "tool_errors"), [
    ([{"content": "", "tool_calls": [tool_call(417, 38)]}, {"content": "15846"}], 1.0, 0),
    ([{"content": "15000"}], 0.0, 0),  # answered without the tool, wrongly
    ([{"content": "", "tool_calls": [tool_call("x", 38)]}, {"content": "?"}], 0.0, 1),  # bad arguments
    ([{"content": "", "tool_calls": [tool_call(1, 2, name="divide")]}, {"content": "2"}], 0.0, 1),  # no such tool
])
def test_the_calculator_agent_and_environment(script, reward, tool_errors):
    policy = ScriptedPolicy(script)

    async def main() -> Episode:
        runner, url = await serve(policy)
        try:
            return await run_episode(agent, CalculatorEnv(), PROBLEM, f"{url}/sessions/s1/v1",
                                     sampling={"temperature": 1.0})
        finally:
            await runner.cleanup()

    episode = run(main())
    assert (episode.reward, episode.num_tool_errors, episode.error) == (reward, tool_errors, "")
    if script[0].get("tool_calls"):  # the tool's output went back to the model as a tool message
        second = policy.requests[1]["messages"]
        assert second[-1]["role"] == "tool" and (second[-1]["content"] == "15846" or "error" in second[-1]["content"])
        assert policy.requests[0]["tools"][0]["function"]["name"] == "multiply"
        assert policy.requests[0]["temperature"] == 1.0


def test_an_agent_that_raises_fails_its_episode_only():
    async def broken(ctx) -> str:
        raise RuntimeError("the agent crashed")

    async def main() -> list[Episode]:
        runner, url = await serve(ScriptedPolicy([{"content": "1"}]))
        try:
            return await rollout_group(broken, CalculatorEnv(), PROBLEM, [f"{url}/sessions/{i}/v1" for i in range(3)],
                                       {})
        finally:
            await runner.cleanup()

    episodes = run(main())
    assert [(e.reward, e.error) for e in episodes] == [(0.0, "RuntimeError: the agent crashed")] * 3


def test_a_replacement_agent_and_environment_plug_in_unchanged():
    class Echo:
        tools: ClassVar[list] = []

        async def call_tool(self, name, arguments, task) -> str:
            return "unused"

        async def verify(self, task, answer) -> float | None:
            return None if answer == "?" else 0.5 if answer == "hi" else 0.0

    async def reporter(ctx) -> str:
        reply = await ctx.chat.complete([{"role": "user", "content": "say hi"}])
        ctx.report_reward(0.25)  # the agent's own reward wins over the verifier's
        return reply["content"]

    async def main() -> tuple[Episode, Episode, Episode]:
        runner, url = await serve(ScriptedPolicy([{"content": "hi"}]))
        try:
            base = f"{url}/sessions/s/v1"

            async def puzzled(ctx) -> str:
                await ctx.chat.complete([{"role": "user", "content": "say hi"}])
                return "?"

            return (await run_episode(agent, Echo(), PROBLEM, base), await run_episode(reporter, Echo(), PROBLEM, base),
                    await run_episode(puzzled, Echo(), PROBLEM, base))
        finally:
            await runner.cleanup()

    assert isinstance(Echo(), Environment) and isinstance(CalculatorEnv(), Environment)
    plain, reported, unscored = run(main())
    assert (plain.reward, plain.answer) == (0.5, "hi") and reported.reward == 0.25
    assert unscored.reward is None and not unscored.error  # unscored, not failed and not 0


def test_problems_and_sft_transcripts():
    config = CalculatorTaskConfig(seed=3)
    items = problems(config, 5)
    assert items == problems(config, 5) and items != problems(config, 5, split="probe")
    transcript = sft_transcripts(items[:1])[0]
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[-1]["content"] == str(items[0].a * items[0].b)
    with pytest.raises(ValueError, match="min_value"):
        CalculatorTaskConfig(min_value=5, max_value=2)


def test_a_replacement_rollout_function_drives_the_episodes():
    calls: list[str] = []

    async def retrying(agent_fn, environment, task, base_url, *, sampling=None, sandbox=None, http=None) -> Episode:
        calls.append(base_url)
        episode = await run_episode(agent_fn, environment, task, base_url, sampling=sampling, http=http)
        return episode if not episode.error else await run_episode(agent_fn, environment, task, base_url,
                                                                   sampling=sampling, http=http)

    async def main() -> list[Episode]:
        runner, url = await serve(ScriptedPolicy([{"content": "", "tool_calls": [tool_call(417, 38)]},
                                                  {"content": "15846"}] * 4))
        try:
            return await rollout_group(agent, CalculatorEnv(), PROBLEM, [f"{url}/sessions/{i}/v1" for i in range(2)],
                                       {}, rollout=retrying)
        finally:
            await runner.cleanup()

    episodes = run(main())
    assert len(calls) == 2 and all(e.reward == 1.0 for e in episodes)
