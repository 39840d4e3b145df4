"""The simulator's promise: replaying a real run's trace with its own settings predicts that run.

Two checks of the same claim:
- on traces recorded from the shipped recipe (recipes/reverse.toml, 100 steps, fully async and
  sync) and kept in tests/data/sim/: fast, so every change to the simulator or the policies
  is held to them;
- on runs recorded now, by this checkout (slow): the trace the controller writes today, replayed
  by the `miles-async sim` command.

The bar (the issue's): mean step time and throughput within 10% of the measured ones, and the
staleness distribution agreeing (total-variation distance at most 0.15, same largest staleness).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support_run import run_cli

from miles_async.sim import RecordedWorkload, SimConfig, compare, fit_costs, load_trace, measure, simulate

DATA = Path(__file__).resolve().parent.parent / "data" / "sim"
TRACES = {"async": DATA / "reverse-async.trace.jsonl.gz", "sync": DATA / "reverse-sync.trace.jsonl.gz"}
MAX_REL_ERROR = 0.10
MAX_STALENESS_TV = 0.15


def check_prediction(errors: dict[str, float], predicted: dict, measured: dict) -> None:
    assert abs(errors["step_s_mean"]) <= MAX_REL_ERROR, errors
    assert abs(errors["samples_per_s"]) <= MAX_REL_ERROR, errors
    assert errors["staleness_tv"] <= MAX_STALENESS_TV, (errors, predicted["staleness"], measured["staleness"])
    assert max(int(k) for k in predicted["staleness"]) == max(int(k) for k in measured["staleness"])


@pytest.mark.parametrize("costs", ["fitted", "replay"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_recorded_runs_of_the_shipped_recipe_are_predicted(mode: str, costs: str) -> None:
    trace = load_trace(TRACES[mode])
    assert trace.header.mode == mode and trace.header.source == "run" and len(trace.steps) == 100
    config = SimConfig.from_header(trace.header, num_steps=len(trace.steps), costs=costs)
    by_step = {s.step: s.train_s for s in trace.steps} if costs == "replay" else None
    result = simulate(config, fit_costs(trace), RecordedWorkload(trace), train_s_by_step=by_step)
    measured = measure(trace)
    errors = compare(result.stats, measured)
    check_prediction(errors, {"staleness": result.stats.staleness}, {"staleness": measured.staleness})
    if mode == "sync":
        assert result.stats.staleness == {0: 1.0} == measured.staleness


def test_the_async_run_predicts_the_sync_run() -> None:
    """A what-if checked against the real thing: the async trace, replayed with mode=sync, against
    the sync run recorded beside it. On this machine the trainer and the engine share two cores,
    so generation is slower while the trainer trains; the fit sees that in the async trace
    (GenCost.shared_*) and the sync prediction leaves it out where nothing overlaps."""
    trace = load_trace(TRACES["async"])
    config = SimConfig.from_header(trace.header, num_steps=100, mode="sync")
    predicted = simulate(config, fit_costs(trace), RecordedWorkload(trace)).stats
    measured = measure(load_trace(TRACES["sync"]))
    assert abs(predicted.step_s_mean / measured.step_s_mean - 1) <= MAX_REL_ERROR
    assert predicted.staleness == {0: 1.0}


def test_a_what_if_changes_the_prediction_the_expected_way() -> None:
    """The async trace is engine-bound (one engine, the trainer waits ~30% of the time): a second
    engine must shorten the step, and sync mode on the same costs must lengthen it."""
    trace = load_trace(TRACES["async"])
    costs, workload = fit_costs(trace), RecordedWorkload(trace)
    own = SimConfig.from_header(trace.header, num_steps=60)
    base = simulate(own, costs, workload).stats
    two = simulate(SimConfig.from_header(trace.header, num_steps=60, num_engines=2), costs, workload).stats
    sync = simulate(SimConfig.from_header(trace.header, num_steps=60, mode="sync"), costs, workload).stats
    assert two.step_s_mean < 0.9 * base.step_s_mean
    assert two.trainer_idle_fraction < base.trainer_idle_fraction
    assert sync.step_s_mean > 1.3 * base.step_s_mean
    assert sync.staleness == {0: 1.0}


@pytest.mark.slow
@pytest.mark.alone  # its timing is what is checked: no test of another file runs beside it
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_run_recorded_now_is_predicted_by_the_sim_command(tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / mode
    done = run_cli(["run", "recipes/reverse.toml", "--out", str(run_dir), "--quiet", f"loop.mode={mode}",
                    "loop.num_steps=60", "eval.mode=none"], timeout_s=300.0)
    assert done.returncode == 0, done.stderr[-3000:]
    trace_path = run_dir / "trace.jsonl"
    out = run_cli(["sim", str(trace_path), "--json", "--timeline", str(tmp_path / "timeline.png")], timeout_s=120.0)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["config"]["mode"] == mode and report["predicted"]["num_steps"] == 60
    check_prediction(report["errors"], report["predicted"], report["measured"])
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "timeline-recorded.png").stat().st_size > 10_000
    replay = run_cli(["sim", str(trace_path), "--json", "--costs", "replay"], timeout_s=120.0)
    assert replay.returncode == 0, replay.stderr[-3000:]
    report = json.loads(replay.stdout)
    check_prediction(report["errors"], report["predicted"], report["measured"])
