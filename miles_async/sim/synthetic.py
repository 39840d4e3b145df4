"""Synthetic traces: plan a run at a scale this machine cannot run, then replay it like a real one.

A scenario is three things: the loop's settings (`SimConfig`), the hardware as cost models
(`CostModel`) and the task as a sample distribution (`SyntheticWorkload`). `synthesize` runs the
simulator on it and returns the simulated run with its trace records; `write` saves them as a
`trace.jsonl` that `miles-async sim` replays (and fits) like any recorded run.

`agentic-64gpu`, modelled on the seeds' case study (a 744B-A40B MoE trained with fully
asynchronous agentic RL on terminal-use coding tasks, 64 GPUs: 32 for rollout, 32 for training,
a median of 263 s per step): 8 engines of 4 GPUs; episodes of 4 to 20 turns, each turn a
long-tailed output (log-normal, median 300 tokens) and a tool call (median 2 s); a decode step of
25 ms plus 0.1 ms per sequence in the batch; 16 prompts x 8 samples per step; a trainer step of
20 s plus 110 us per token on 32 ranks (about 2.5 M tokens a step); the seeds' 8.5 s P2P weight
update with generation paused for its last 4 s. The decode cost and the tool time were set so that the
simulated median step comes out at the seeds' 263 s (a test holds it there); the rest are
round numbers of the right size, not measurements.

Try it: `miles-async sim --synthetic agentic-64gpu --write /tmp/agentic.jsonl`, then
`miles-async sim /tmp/agentic.jsonl --set num_engines=16`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from miles_async.sim.costs import CostModel, GenCost, TrainCost, UpdateCost
from miles_async.sim.simulate import SimConfig, SimResult, simulate
from miles_async.sim.trace import write_trace
from miles_async.sim.workload import SyntheticWorkload


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    description: str
    config: SimConfig
    costs: CostModel
    workload: SyntheticWorkload


SCENARIOS: dict[str, Scenario] = {
    "agentic-64gpu": Scenario(
        description="744B-A40B MoE, agentic coding RL, 64 GPUs (8 engines x 4 for rollout, 32 training ranks)",
        config=SimConfig(num_engines=8, trainer_world_size=32, mode="async", max_staleness=2, group_size=8,
                         batch_groups=16, target_in_flight=256, max_in_flight_per_engine=32, capacity_groups=64,
                         partial="continue", num_steps=40),
        costs=CostModel(
            gen=GenCost(dispatch_s=0.05, prefill_s=1.0, token_s=0.025, token_s_per_seq=0.0001),
            train=TrainCost(base_s=20.0, per_token_s=0.00011, fit_world_size=32, overhead_s=1.0),
            update=UpdateCost(export_s=3.0, push_s=8.5, paused_s=4.0)),
        workload=SyntheticWorkload(prompt_tokens=4000, tokens_median=300.0, tokens_sigma=1.0,
                                   max_tokens_per_turn=8192, turns_min=4, turns_max=20, tool_s_median=2.0,
                                   tool_s_sigma=1.0, success_rate=0.45)),
    "math-8gpu": Scenario(
        description="single-turn math RL on one 8-GPU node (4 engines x 1 GPU, 4 training ranks), long tails",
        config=SimConfig(num_engines=4, trainer_world_size=4, mode="async", max_staleness=1, group_size=8,
                         batch_groups=32, target_in_flight=512, capacity_groups=128, num_steps=40),
        costs=CostModel(
            gen=GenCost(dispatch_s=0.005, prefill_s=0.05, token_s=0.012, token_s_per_seq=0.00005),
            train=TrainCost(base_s=2.0, per_token_s=0.00003, fit_world_size=4, overhead_s=0.2),
            update=UpdateCost(export_s=0.5, push_s=1.5, paused_s=0.5)),
        workload=SyntheticWorkload(prompt_tokens=300, tokens_median=900.0, tokens_sigma=0.9,
                                   max_tokens_per_turn=16384, success_rate=0.5)),
}


def scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"no synthetic scenario {name!r}; there are: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def synthesize(chosen: Scenario, *, record: bool = True) -> SimResult:
    """Simulate the scenario; with `record`, the result carries the run's trace records."""
    return simulate(chosen.config, chosen.costs, chosen.workload, record=record)


def write(result: SimResult, path: str | Path) -> Path:
    """Save a recorded simulation as a trace (its header first), replayable by `miles-async sim`."""
    return write_trace(path, [result.config.header(source="synthetic"), *result.records])
