"""The Verifiers adapter (miles_async/agents/verifiers.py) with the calculator environment the tests
ship (tests/data/verifiers_calc, written with Verifiers' API): an episode runs the environment's
harness, tool and rubric against the episode's session; failures end only their episode.

They need Verifiers, which lives in `.venv-verifiers` (`python3 dev.py verifiers`: its mcp pin
cannot share `.venv`); tests/e2e/test_verifiers.py runs this file there. In `.venv` only the last
test runs: without Verifiers the recipe names the extra to install. The policy is a scripted
OpenAI-compatible server (the model is the boundary these tests are not about; the e2e test runs
the real session server and engine).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from miles_async.actors.recipe import load_recipe
from miles_async.agents.api import run_episode
from miles_async.agents.verifiers import (
    VerifiersConfig,
    VerifiersEnvironment,
    VerifiersItem,
    VerifiersTask,
    VerifiersUnavailable,
    agent,
    close_environments,
    episode_of,
    rollout,
    served,
    verifiers,
)

TIMEOUT_S = 30
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "verifiers-calculator.toml"
HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec("verifiers_calc")
needs_verifiers = pytest.mark.skipif(not HAS_VERIFIERS, reason="Verifiers lives in .venv-verifiers "
                                     "(`python3 dev.py verifiers`); tests/e2e/test_verifiers.py runs this file there")
pytestmark = pytest.mark.timeout(TIMEOUT_S + 10)
ENV = {"agent": {"runtime": {"type": "subprocess"}}, "taskset": {"num_tasks": 4}}  # the calculator, four tasks
SAMPLING = {"temperature": 0.5, "top_p": 0.9, "max_tokens": 16}


class ScriptedPolicy:
    """Answers each chat completion with the next assistant message of its session's script (one
    callable per turn, given the request), or HTTP 500 for the sessions in `broken`; records requests."""

    def __init__(self, script: list[Any], broken: tuple[str, ...] = ()) -> None:
        self.script = script
        self.broken = broken
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((body, dict(request.headers)))
        if body.get("session_id") in self.broken:
            return web.json_response({"error": {"message": "the engine is down", "type": "server_error"}}, status=500)
        turn = sum(1 for b, _ in self.requests if b.get("session_id") == body.get("session_id")) - 1
        message = self.script[min(turn, len(self.script) - 1)](body)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response({"id": f"c{len(self.requests)}", "object": "chat.completion", "created": 0,
                                  "model": body["model"], "choices": [
                                      {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


async def serve(policy: ScriptedPolicy) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", policy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def problem(body: dict[str, Any]) -> tuple[int, int]:
    a, b = body["messages"][0]["content"].removeprefix("m:").removesuffix("=").split("*")
    return int(a), int(b)


def call_multiply(body: dict[str, Any]) -> dict[str, Any]:
    a, b = problem(body)
    return {"content": "", "tool_calls": [{"id": "call_0", "type": "function",
                                           "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}]}


def answer_with_the_tool_result(body: dict[str, Any]) -> dict[str, Any]:
    return {"content": body["messages"][-1]["content"]}


def answer_wrong(body: dict[str, Any]) -> dict[str, Any]:
    return {"content": "42"}


def calculator() -> VerifiersConfig:  # made in the tests: without Verifiers, a config is refused
    return VerifiersConfig(environment="verifiers-calc", env=ENV)


def items(count: int) -> list[VerifiersItem]:
    return VerifiersTask(calculator(), tokenizer=None).items("train", count)


def run(coro):
    async def scenario():
        try:
            return await coro
        finally:
            await close_environments()

    return asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))


@needs_verifiers
@pytest.mark.parametrize(("script", "reward", "num_tool_calls"), [
    ([call_multiply, answer_with_the_tool_result], 1.25, 1),  # correct (1.0) + answered (0.25)
    ([answer_wrong], 0.25, 0),  # answered, wrong
    ([call_multiply], 0.0, 3),  # never answers: three tool calls, the harness's max_turns
])
def test_an_episode_runs_the_environments_harness_tool_and_rubric(script, reward, num_tool_calls):
    policy = ScriptedPolicy(script)
    item = items(1)[0]

    async def scenario():
        runner, url = await serve(policy)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer run-key"}) as http:
                return await rollout(None, VerifiersEnvironment(), item, f"{url}/sessions/ep-1/v1",
                                     sampling=SAMPLING, http=http)
        finally:
            await runner.cleanup()

    episode = run(scenario())
    assert episode.error == "" and episode.reward == pytest.approx(reward)
    assert episode.num_tool_calls == num_tool_calls and episode.num_turns == len(policy.requests)
    a, b = item.data["a"], item.data["b"]
    for body, headers in policy.requests:  # every turn: the episode's session, the run's sampling and key
        assert body["session_id"] == "ep-1" and body["model"] == "policy"
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.5, 0.9, 16)
        assert headers["Authorization"] == "Bearer run-key" and body["messages"][0]["content"] == f"m:{a}*{b}="
    if num_tool_calls:  # the environment's tool ran: its result is in the next turn's messages
        assert policy.requests[1][0]["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)}
    if reward > 1:
        assert episode.answer == str(a * b)


@needs_verifiers
def test_episodes_share_one_served_environment_and_a_failure_ends_only_its_own():
    policy = ScriptedPolicy([call_multiply, answer_with_the_tool_result], broken=("ep-bad",))
    good, bad = items(2)
    missing = msgspec.structs.replace(good, config=VerifiersConfig(environment="no-such-environment"))

    async def scenario():
        runner, url = await serve(policy)
        try:
            async with aiohttp.ClientSession() as http:
                episodes = await asyncio.gather(*(
                    rollout(None, VerifiersEnvironment(), item, f"{url}/sessions/{sid}/v1", sampling=SAMPLING, http=http)
                    for item, sid in ((good, "ep-good"), (bad, "ep-bad"), (missing, "ep-missing"), (good, "ep-again"))))
                first, again = await served(calculator()), await served(calculator())
                return episodes, first is again
        finally:
            await runner.cleanup()

    (ok, failed, not_installed, ok_again), shared = run(scenario())
    assert ok.reward == ok_again.reward == 1.25 and not ok.error and shared
    assert failed.reward == 0.0 and "500" in failed.error and "engine is down" in failed.error
    assert not_installed.reward == 0.0 and "no-such-environment" in not_installed.error
    assert not any(body.get("session_id") == "ep-missing" for body, _ in policy.requests)


@needs_verifiers
def test_as_an_agent_under_run_episode_it_reports_the_rubric_reward_and_raises_a_failure():
    policy = ScriptedPolicy([answer_wrong], broken=("probe-bad",))
    item = items(1)[0]

    async def scenario():
        runner, url = await serve(policy)
        try:
            async with aiohttp.ClientSession() as http:
                return await asyncio.gather(*(run_episode(agent, VerifiersEnvironment(), item,
                                                          f"{url}/sessions/{sid}/v1", sampling=SAMPLING, http=http)
                                              for sid in ("probe-ok", "probe-bad")))
        finally:
            await runner.cleanup()

    scored, failed = run(scenario())
    assert scored.reward == 0.25 and scored.answer == "42" and not scored.error
    assert failed.reward == 0.0 and "Verifiers" in failed.error


@needs_verifiers
def test_a_trace_with_no_reward_is_unscored_and_a_failed_one_fails():
    import verifiers.v1 as vf

    task = vf.TraceTask(type="CalcTask", data=vf.TaskData(prompt="m:2*3="))

    def trace(**fields: Any) -> Any:
        agent_info = vf.AgentInfo(config=vf.AgentConfig(runtime={"type": "subprocess"}))
        return vf.Trace(task=task, agent=agent_info, **{"ok": True, **fields})

    def episode(*traces: Any, **fields: Any) -> Any:
        return vf.Episode(task=task, traces=list(traces), **{"ok": True, **fields})

    assert episode_of(episode(trace())).reward is None  # no @vf.reward at all
    assert episode_of(episode(trace(rewards={"correct": None}))).reward is None  # scoring did not run
    rubric = {"correct": vf.Reward(score=1.0), "answered": vf.Reward(score=1.0, weight=0.25)}
    scored = episode_of(episode(trace(rewards=rubric)))
    assert scored.reward == 1.25 and not scored.error
    crashed = episode_of(episode(trace(ok=False, errors=[vf.Error(type="HarnessError", message="exit 1")]), ok=False))
    assert crashed.reward == 0.0 and crashed.error == "Verifiers: HarnessError: exit 1"
    assert "2 agents" in episode_of(episode(trace(), trace())).error


@needs_verifiers
def test_items_cross_a_node_as_plain_data_and_rebuild_the_same_task(tmp_path):
    import verifiers.v1 as vf

    from miles_async.models import init_model, load_tokenizer

    task = VerifiersTask(calculator(), load_tokenizer(init_model("qwen3", "tiny", tmp_path, seed=0)))
    train = task.items("train", 10)
    assert [i.data["idx"] for i in train] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # four tasks, cycled
    wire = msgspec.convert(msgspec.json.decode(msgspec.json.encode(train[1])), VerifiersItem)
    assert wire == train[1]

    async def rebuilt():
        return (await served(calculator())).task(wire.data)

    original = list(vf.load_taskset(task.env_config.taskset))[1]
    again = run(rebuilt())
    assert type(again) is type(original) and again.data == original.data and again.key == original.key
    text = task.tokenizer.decode(task.prompt_ids(train[1]))
    assert f"m:{original.data.a}*{original.data.b}=" in text
    with pytest.raises(TypeError, match="trace"):
        asyncio.run(task.reward(train[1], None))
    # the warm start: none without demonstrations; with the environment's, its ideal conversation
    assert task.sft_examples(train[:2]) == []
    demo = VerifiersTask(msgspec.structs.replace(calculator(), demonstrations="verifiers_calc.warm_start:demonstration"),
                         task.tokenizer)
    ((ids, mask),) = demo.sft_examples(train[1:2])
    trained = task.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert '"multiply"' in trained and trained.endswith(f"{original.data.a * original.data.b}<|im_end|>")
    assert f"m:{original.data.a}*{original.data.b}=" in task.tokenizer.decode(ids)


@needs_verifiers
@pytest.mark.parametrize(("environment", "env", "message"), [
    ("no-such-environment", {}, "not an installed Verifiers environment"),
    ("verifiers-calc", {"agent": {"max_turns": "many"}}, "max_turns"),
    ("verifiers-calc", {"id": "user-sim"}, "agent seats"),
])
def test_a_wrong_environment_or_setting_fails_when_the_task_loads(environment, env, message):
    with pytest.raises(ValueError, match=message):
        VerifiersTask(VerifiersConfig(environment=environment, env=env), tokenizer=None)


@needs_verifiers
def test_the_recipe_names_the_environment_by_its_id():
    config = load_recipe(RECIPE)
    assert config.task.plugin == "miles_async.agents.verifiers:VerifiersTask" and config.sft.max_steps > 0
    task = msgspec.convert(config.task.config, VerifiersConfig)
    assert task.demonstrations == "verifiers_calc.warm_start:demonstration"
    assert task.environment == "verifiers-calc" and task.env["agent"]["runtime"] == {"type": "subprocess"}
    assert (config.agent.rollout, config.agent.sandbox) == ("miles_async.agents.verifiers:rollout", False)


@pytest.mark.skipif(bool(HAS_VERIFIERS), reason="Verifiers is installed here")
def test_without_verifiers_the_recipe_names_the_extra():
    with pytest.raises(ValueError, match=r"Verifiers is not installed: pip install 'miles-async\[verifiers\]'"):
        load_recipe(RECIPE)
    with pytest.raises(VerifiersUnavailable, match=r"pip install 'miles-async\[verifiers\]'"):
        verifiers()  # what every use of Verifiers goes through
