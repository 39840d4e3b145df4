"""recipes/openenv-calculator.toml, shortened: RL in the loop on an OpenEnv environment (the
calculator of tests/data/openenv_calc, written with OpenEnv's own API), one OpenEnv session per
episode through miles_async.agents.openenv, on the tiny model.

An SFT warm start on the environment's demonstrations teaches the tool-call format first (80 steps
at lr 8e-3: most episodes then call a tool, many submit; measured here, 38 samples of a run: 26
made tool calls, 24 submitted), so that the RL steps see all three kinds of episode: submitted
(the environment's reward), never submitted (unscored) and failed tool calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles_async.actors.controller import Controller
from miles_async.actors.recipe import load_recipe
from miles_async.runtime import run as run_async

pytest.importorskip("openenv", reason="OpenEnv is not installed (pip install 'miles-async[openenv]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "openenv_calc"))  # the tests' environment

import openenv_calc

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "openenv-calculator.toml"
SHORT = ["sft.max_steps=80", "sft.lr=8e-3", "sft.probe_every=80", "sft.num_probe=4", "sft.target_accuracy=1.0",
         "loop.num_steps=3", "loop.batch_groups=2", "scheduler.group_size=4", "scheduler.target_in_flight=8",
         "buffer.filter=none", "eval.mode=none", "task.num_prompts=200"]


@pytest.mark.timeout(240)
def test_rl_on_an_openenv_environment_takes_its_rewards_and_counts_unscored_episodes_as_such(tmp_path):
    config = load_recipe(RECIPE, SHORT)
    controller = Controller(config, tmp_path, progress=False)
    seen = []  # (sample, counted, whether it joined the row's reward_mean)
    trace = controller._trace_sample

    def record(sample, counted):
        before = len(controller.rollout_rewards)
        trace(sample, counted)
        seen.append((sample, counted, len(controller.rollout_rewards) > before))

    controller._trace_sample = record
    openenv_calc.EVENTS.clear()
    result = run_async(controller.run())
    assert result.num_steps == 3
    episodes = [(s, averaged) for s, counted, averaged in seen if counted and not s.aborted]
    calls = {}  # the environment's own record of each episode: its tool calls and the reward it gave
    for event in openenv_calc.EVENTS:
        calls.setdefault(event["episode_id"], []).append(event)
    sid = {id(s): f"p{s.prompt_id}-i{s.index}-a{s.attempt}-r{s.request_id}" for s, _ in episodes}
    # Episodes ran their tool calls through their OpenEnv session (OpenEnv's episode id is the
    # TITO session's), each a turn of the model's after the first.
    with_tools = [s for s, _ in episodes if calls.get(sid[id(s)])]
    assert with_tools and all(s.num_turns >= 2 for s in with_tools)
    # The reward is the environment's: what its rubric gave on submit; none given is unscored, and
    # only scored samples count for the reward the metrics rows average.
    scored = [s for s, _ in episodes if s.scored]
    unscored = [s for s, _ in episodes if not s.scored]
    assert scored and unscored, (len(scored), len(unscored))
    for s, averaged in episodes:
        given = [e["reward"] for e in calls.get(sid[id(s)], []) if e["reward"] is not None]
        assert (s.reward, s.scored) == ((given[-1], True) if given else (0.0, False)), (s, given)
        assert averaged == s.scored
    # the trace says which samples were unscored; the rows how many of each batch
    from miles_async.observe import SampleTrace, decode_trace

    traced = [r for r in decode_trace(tmp_path / "trace.jsonl") if isinstance(r, SampleTrace) and not r.dropped]
    assert {r.scored for r in traced} == {True, False}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["rollout/unscored_fraction"] <= 1 for r in rows)
