"""The OpenEnv adapter (miles_async/agents/openenv.py) on environments written with OpenEnv's own
API: the calculator of tests/data/openenv_calc (an MCPEnvironment whose rubric sets the reward)
in this process and served by OpenEnv's own server (uvicorn in a thread), and a
ResourceSessionFactory. The policy is a scripted OpenAI-compatible server (test_agents_api.py's),
the model being the boundary these tests are not about; tests/e2e/test_openenv_run.py trains on
the calculator in the loop."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("openenv", reason="OpenEnv is not installed (pip install 'miles-async[openenv]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "openenv_calc"))  # the tests' environment

import openenv_calc
from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult
from test_agents_api import ScriptedPolicy, serve

from miles_async.actors.recipe import load_recipe
from miles_async.actors.rollout import AgentConfig, environment_factory
from miles_async.agents.api import Episode
from miles_async.agents.openenv import (
    OpenEnvItem,
    OpenEnvTask,
    OpenEnvTaskConfig,
    agent,
    initial_messages,
    open_session,
    openai_tool,
    openenv_module,
    rollout,
)

TIMEOUT_S = 30
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "openenv-calculator.toml"
ITEM = OpenEnvItem(index=0, seed=7, max_turns=4)
A, B = openenv_calc.question(ITEM.seed)
SUM = A + B


class Calc(openenv_calc.CalcEnvironment):
    """The calculator, counting how often it is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.num_closed = 0

    def close(self) -> None:
        self.num_closed += 1
        super().close()


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"id": f"call_{name}", "type": "function",
                                           "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def episode(environment: Any, script: list[dict[str, Any]], *, item: Any = ITEM, session_id: str = "s1",
                  the_agent: Any = agent) -> tuple[Episode, ScriptedPolicy]:
    policy = ScriptedPolicy(script)
    runner, url = await serve(policy)
    try:
        return await rollout(the_agent, environment, item, f"{url}/sessions/{session_id}/v1",
                             sampling={"temperature": 1.0}), policy
    finally:
        await runner.cleanup()


# (script, reward, number of tool calls, of failed ones, of model turns)
SCRIPTS = {
    "right": ([call("add", a=A, b=B), call("submit", answer=SUM)], 1.0, 2, 0, 2),
    "wrong": ([call("add", a=A, b=B), call("submit", answer=SUM + 1)], 0.0, 2, 0, 2),
    "never submits": ([{"content": str(SUM)}], None, 0, 0, 1),  # unscored: the environment gave no reward
    "a tool raises": ([call("add", a=999_999, b=1), call("submit", answer=SUM)], 1.0, 2, 1, 2),
    "unknown tool": ([call("divide", a=1, b=2), {"content": "?"}], None, 1, 1, 2),
    "bad arguments": ([call("add", a="x"), {"content": "?"}], None, 1, 1, 2),
    "out of turns": ([call("add", a=A, b=B)], None, 4, 0, 4),  # max_turns = 4, never submits
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_an_episode_runs_its_tool_calls_through_one_session_and_takes_the_environments_reward(name):
    script, reward, num_calls, num_errors, num_turns = SCRIPTS[name]
    environment = Calc()
    openenv_calc.EVENTS.clear()
    result, policy = run(episode(environment, script, session_id=f"p0-i{len(name)}"))
    assert (result.reward, result.num_tool_calls, result.num_tool_errors, result.num_turns, result.error) == (
        reward, num_calls, num_errors, num_turns, "")
    assert environment.num_closed == 1  # closed once, after verify
    first = policy.requests[0]
    assert first["messages"] == [{"role": "user", "content": f"{A}+{B}="}]  # the reset observation's prompt
    assert [t["function"]["name"] for t in first["tools"]] == ["add", "submit"]
    assert first["tools"][0]["function"]["parameters"]["required"] == ["a", "b"] and first["temperature"] == 1.0
    if num_calls:  # the tool's output (or its error, as text) went back to the model
        tool_message = policy.requests[1]["messages"][-1]
        assert tool_message["role"] == "tool" and tool_message["tool_call_id"].startswith("call_")
        assert tool_message["content"].startswith("error: ") if num_errors else tool_message["content"] == str(SUM)
    if name == "a tool raises":
        assert "at most 6 digits" in policy.requests[1]["messages"][-1]["content"]
    # the environment saw the calls under the TITO session's id, and gave the reward itself
    assert {e["episode_id"] for e in openenv_calc.EVENTS} <= {f"p0-i{len(name)}"}
    given = [e["reward"] for e in openenv_calc.EVENTS if e["reward"] is not None]
    assert given == ([] if reward is None else [reward])


def test_failures_end_the_episode_only_and_the_session_is_closed_whatever_happens():
    async def broken(ctx) -> str:
        raise RuntimeError("the agent crashed")

    class BadReset(Calc):
        def reset(self, seed=None, episode_id=None, **kwargs):
            raise RuntimeError("no question today")

    crashed, bad = Calc(), BadReset()
    result, _ = run(episode(crashed, [{"content": "1"}], the_agent=broken))
    assert result.error == "RuntimeError: the agent crashed" and result.reward == 0.0 and crashed.num_closed == 1
    result, policy = run(episode(bad, [{"content": "1"}]))
    assert "did not open: RuntimeError: no question today" in result.error and bad.num_closed == 1
    assert not policy.requests  # the model was never asked
    port = free_port()  # nothing serves there: the episode fails, the run goes on
    result, _ = run(episode(f"http://127.0.0.1:{port}", [{"content": "1"}]))
    assert "did not open" in result.error
    with pytest.raises(TypeError, match="an OpenEnv rollout needs an OpenEnv Environment"):
        run(episode(object(), [{"content": "1"}]))
    with pytest.raises(TypeError, match="must be a server's URL"):
        run(episode("calc_env:Calc", [{"content": "1"}]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """The calculator served by OpenEnv's own server (create_app, uvicorn) in a thread: its URL."""
    import uvicorn
    from openenv_calc.app import app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(TIMEOUT_S)
    sock.close()


def test_served_by_openenvs_own_server_an_environment_gives_what_it_gives_in_process(served):
    for name, (script, reward, *_) in SCRIPTS.items():
        local, local_policy = run(episode(Calc(), script))
        remote, remote_policy = run(episode(served, script))
        assert remote == local and remote.reward == reward, name
        assert remote_policy.requests == local_policy.requests, name  # the same prompt, tools and tool outputs


class ShoutSession(ResourceSession):
    """A ResourceSession (OpenEnv's harness API): one tool; verify grades the final answer in the
    transcript, and gives no reward when there is none."""

    closed: ClassVar[list[str]] = []

    def __init__(self, word: str, episode_id: str | None) -> None:
        self.word, self.episode_id = word, episode_id

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Shout."}, {"role": "user", "content": self.word}]

    def list_tools(self) -> list[Tool]:
        return [Tool(name="shout", description="Upper-case a word.",
                     input_schema={"type": "object", "properties": {"word": {"type": "string"}}})]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != "shout":
            raise KeyError(f"Unknown tool: {name}")
        if not arguments.get("word"):
            return ToolResult(error="shout needs a word")
        return ToolResult(data={"shouted": arguments["word"].upper()})

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        last = transcript[-1]
        if last["role"] != "assistant" or not last["content"]:
            return VerifyResult(env_reward=None)
        return VerifyResult(env_reward=1.0 if last["content"] == self.word.upper() else 0.0)

    def close(self) -> None:
        ShoutSession.closed.append(self.episode_id or "")


class ShoutFactory(ResourceSessionFactory[ShoutSession]):
    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ShoutSession:
        return ShoutSession(task["word"], episode_id)


@pytest.mark.parametrize(("script", "reward", "num_errors"), [
    ([call("shout", word="hi"), {"content": "HI"}], 1.0, 0),
    ([{"content": "hi"}], 0.0, 0),
    ([call("shout"), {"content": ""}], None, 1),  # the tool's error; no answer: unscored
    ([call("whisper", word="hi"), {"content": "HI"}], 1.0, 1),  # an unknown tool: the session's KeyError, as text
])
def test_a_resource_session_factory_plugs_in(script, reward, num_errors):
    ShoutSession.closed.clear()
    result, policy = run(episode(ShoutFactory(), script, item={"word": "hi"}, session_id="p3-i1"))
    assert (result.reward, result.num_tool_errors, result.error) == (reward, num_errors, "")
    assert policy.requests[0]["messages"][0] == {"role": "system", "content": "Shout."}
    assert policy.requests[0]["tools"][0]["function"]["name"] == "shout"
    if script[0].get("tool_calls") and not num_errors:
        assert json.loads(policy.requests[1]["messages"][-1]["content"]) == {"shouted": "HI"}
    assert ShoutSession.closed == ["p3-i1"]


def test_mcp_tools_become_openai_tools():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    expected = {"type": "function", "function": {"name": "inc", "description": "Add one.", "parameters": schema}}
    mcp_types = pytest.importorskip("mcp.types")
    assert openai_tool(Tool(name="inc", description="Add one.", input_schema=schema)) == expected
    assert openai_tool(mcp_types.Tool(name="inc", description="Add one.", inputSchema=schema)) == expected
    assert openai_tool({"name": "inc", "description": "Add one.", "inputSchema": schema}) == expected
    assert openai_tool({"name": "ping"})["function"] == {"name": "ping", "description": "",
                                                         "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(ValueError, match="without a name"):
        openai_tool({"description": "?"})


def test_the_agents_first_messages_come_from_the_reset_observation():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert initial_messages({"messages": messages, "prompt": "x"}) == messages
    assert initial_messages({"prompt": "2+2="}) == [{"role": "user", "content": "2+2="}]
    assert initial_messages({"metadata": {"prompt": "q"}}) == [{"role": "user", "content": "q"}]
    assert initial_messages({"board": [1, 2], "metadata": {}}) == [{"role": "user", "content": '{"board": [1, 2]}'}]


def test_open_session_alone_lists_the_tools_and_closes(served):
    async def main() -> tuple[list[str], list[str], bool]:
        local, remote = await open_session(Calc(), ITEM), await open_session(served, ITEM)
        try:
            names = [[t["function"]["name"] for t in s.tools] for s in (local, remote)]
            assert await local.call_tool("add", {"a": 1, "b": 2}, ITEM) == "3"
            return names[0], names[1], local.done
        finally:
            await local.close()
            await remote.close()
            await remote.close()  # closing twice is harmless

    assert run(main()) == (["add", "submit"], ["add", "submit"], False)


def test_the_task_gives_a_seed_per_prompt_and_refuses_single_generations():
    task = OpenEnvTask(OpenEnvTaskConfig(seed=3, reset={"split": "test"}, max_turns=5), tokenizer=None)
    items = task.items("train", 4)
    assert items == task.items("train", 4) and items != task.items("probe", 4)
    assert len({i.seed for i in items}) == 4 and items[0].reset == {"split": "test"} and items[0].max_turns == 5
    with pytest.raises(ValueError, match="agent episodes only"):
        task.prompt_ids(items[0])
    with pytest.raises(ValueError, match="sft.max_steps = 0"):
        task.sft_examples(items)
    with pytest.raises(ValueError, match="max_turns"):
        OpenEnvTaskConfig(max_turns=0)


def test_the_environments_demonstrations_render_as_the_session_server_renders_them(tmp_path):
    from miles_async.models import init_model
    from miles_async.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(init_model("qwen3", "tiny", tmp_path))
    task = openenv_calc.CalcTask(OpenEnvTaskConfig(), tokenizer)
    item = task.items("train", 1)[0]
    a, b = openenv_calc.question(item.seed)
    tokens, mask = task.sft_examples([item])[0]
    said = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert f'"name": "add", "arguments": {{"a": {a}, "b": {b}}}' in said
    assert f'"name": "submit", "arguments": {{"answer": {a + b}}}' in said and f"{a}+{b}=" not in said


def test_the_recipe_names_the_environment_by_its_entry_point_or_its_url():
    config = load_recipe(RECIPE)
    assert (config.agent.environment, config.agent.rollout, config.agent.agent) == (
        "openenv_calc:CalcEnvironment", "miles_async.agents.openenv:rollout", "miles_async.agents.openenv:agent")
    assert config.task.plugin == "openenv_calc:CalcTask" and not config.agent.sandbox
    assert isinstance(environment_factory(config.agent.environment)(), openenv_calc.CalcEnvironment)
    served = load_recipe(RECIPE, ["agent.environment=http://127.0.0.1:8000"]).agent.environment
    assert environment_factory(served)() == environment_factory(served)(sandbox=None) == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="needs a rollout function that connects to it"):
        AgentConfig(agent="miles_async.agents.openenv:agent", environment="http://127.0.0.1:8000")


def test_without_openenv_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.harness", None)  # what a missing package looks like
    with pytest.raises(ImportError, match=r"pip install 'miles-async\[openenv\]'"):
        openenv_module("openenv.core.harness")
    with pytest.raises(ImportError, match=r"miles-async\[openenv\]"):
        OpenEnvTask(OpenEnvTaskConfig(), tokenizer=None)
    with pytest.raises(ImportError, match=r"miles-async\[openenv\]"):  # never a failed episode
        run(episode(Calc(), [{"content": "1"}]))
