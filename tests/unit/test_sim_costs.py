"""miles_async/sim/costs.py and miles_async/sim/report.py: the cost models, their fit, and the numbers a run is judged by.

Hand-made traces (written and loaded like a real one) give `engine_concurrency` and `measure`
answers computed by hand; a simulated run with known costs, written as a trace and fitted back,
checks that `fit_costs` recovers what made it.
"""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest

from miles_async.observe.records import TRACE_SCHEMA, RunTrace, SampleTrace, StepTrace, UpdateTrace
from miles_async.sim import (
    CostModel,
    GenCost,
    RunStats,
    SampleSpec,
    SimConfig,
    TeacherCost,
    TrainCost,
    UpdateCost,
    compare,
    fit_costs,
    load_trace,
    measure,
    simulate,
    staleness_distance,
    write_trace,
)
from miles_async.sim.costs import engine_concurrency, fit_train, fit_update, nnls
from miles_async.sim.synthetic import write

approx = pytest.approx


def header(**kw) -> RunTrace:
    fields = {"schema": TRACE_SCHEMA, "start_s": 0.0, "num_engines": 2, "trainer_world_size": 1, "mode": "async",
              "max_staleness": 1, "group_size": 2, "batch_groups": 1, "target_in_flight": 4, "capacity_groups": 4,
              "filter": "nonzero_std", "on_stale": "retry", "on_abort": "retry"}
    return RunTrace(**{**fields, **kw})


def sample(prompt_id: int, index: int, engine: int, submit_s: float, end_s: float, versions: list[int],
           attempt: int = 0, **kw) -> SampleTrace:
    fields = {"prompt_tokens": 2, "output_tokens": 3, "finish_reason": "stop", "reward": float(index % 2)}
    return SampleTrace(prompt_id=prompt_id, index=index, attempt=attempt, engine=f"engine-{engine}",
                       submit_s=submit_s, end_s=end_s, versions=versions, **{**fields, **kw})


def step(n: int, start_s: float, train_end_s: float, train_s: float, end_s: float, prompt_ids: list[int],
         num_tokens: int) -> StepTrace:
    return StepTrace(step=n, weight_version=n, start_s=start_s, end_s=end_s, wait_data_s=0.0, train_s=train_s,
                     update_s=end_s - train_end_s, num_samples=2, num_tokens=num_tokens, staleness_mean=0.0,
                     staleness_max=0, prompt_ids=prompt_ids, train_end_s=train_end_s)


# ----- nnls -----

def test_nnls_recovers_exact_coefficients():
    rows = [(1.0, x, x * x) for x in (0.0, 1.0, 2.5, 4.0, 7.0)]
    targets = [0.5 + 2.0 * x + 0.1 * xx for _, x, xx in rows]
    assert nnls(rows, targets) == approx([0.5, 2.0, 0.1], rel=1e-9)


def _residual(coef, rows, targets):
    return sum((sum(c * x for c, x in zip(coef, r)) - t) ** 2 for r, t in zip(rows, targets))


def test_nnls_with_a_negative_true_coefficient_gives_the_best_non_negative_fit():
    rows = [(1.0, float(x)) for x in range(11)]
    targets = [5.0 - 0.5 * x + (0.3 if x % 3 == 0 else -0.1) for x in range(11)]
    coef = nnls(rows, targets)
    assert min(coef) >= 0
    # The slope wants to be negative: the best fit with slope >= 0 is the mean, slope 0.
    assert coef == approx([sum(targets) / len(targets), 0.0], abs=1e-12)
    grid = [(b0 / 100, b1 / 100) for b0, b1 in itertools.product(range(801), range(51))]
    best = min(grid, key=lambda c: _residual(c, rows, targets))
    assert _residual(coef, rows, targets) <= _residual(best, rows, targets) + 1e-12
    assert coef == approx(best, abs=0.01)


def test_nnls_with_a_negative_intercept_fits_through_the_origin():
    rows = [(1.0, float(x)) for x in range(1, 6)]
    targets = [-1.0 + 2.0 * x for x in range(1, 6)]
    b1 = sum(r[1] * t for r, t in zip(rows, targets)) / sum(r[1] ** 2 for r in rows)
    assert nnls(rows, targets) == approx([0.0, b1], abs=1e-12)


def test_nnls_with_collinear_or_zero_columns_still_fits():
    assert nnls([(1.0, 0.0), (1.0, 0.0)], [2.0, 2.0]) == approx([2.0, 0.0])
    coef = nnls([(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)], [2.0, 4.0, 6.0])  # column 2 = 2 x column 1
    assert coef[0] + 2 * coef[1] == approx(2.0) and min(coef) >= 0
    assert nnls([(1.0,), (2.0,)], [-1.0, -2.0]) == [0.0]  # nothing non-negative helps


# ----- engine concurrency -----

def test_engine_concurrency_is_the_time_averaged_count_in_flight(tmp_path):
    records = [
        header(),
        sample(0, 0, 0, 0.0, 4.0, [0]),                               # P
        sample(0, 1, 0, 2.0, 6.0, [0]),                               # Q
        sample(1, 0, 0, 3.0, 5.0, [0]),                               # R
        sample(1, 1, 1, 1.0, 3.0, [0]),                               # alone on engine-1
        sample(2, 0, 1, 3.0, 4.0, [0]),                               # starts as the other ends
        sample(9, 0, 0, 0.0, 10.0, [0], dropped="filtered"),          # dropped: not counted
        step(1, 0.0, 6.5, 0.5, 7.0, [0], 10),
    ]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", records))
    got = engine_concurrency(trace)
    # P: 1 on [0,2], 2 on [2,3], 3 on [3,4] -> 7/4. Q: 2, 3, 2, 1 over [2,6] -> 8/4. R: 3, 2 -> 5/2.
    assert got == {(0, 0, 0): approx(1.75), (0, 1, 0): approx(2.0), (1, 0, 0): approx(2.5),
                   (1, 1, 0): approx(1.0), (2, 0, 0): approx(1.0)}


# ----- measure, compare -----

def _hand_trace(tmp_path):
    records = [
        header(),
        sample(0, 0, 0, 0.0, 2.0, [0]),
        sample(0, 1, 1, 0.0, 3.0, [0]),
        sample(1, 0, 0, 0.0, 1.0, [0]),                       # attempt 0 of prompt 1 (dropped later)
        sample(1, 1, 1, 0.0, 1.5, [0]),
        sample(9, 0, 0, 1.0, 9.0, [0], dropped="filtered"),   # not counted anywhere
        step(1, 0.0, 4.0, 1.0, 4.5, [0], 20),                 # trains [3, 4]: prompt 0, staleness 0
        UpdateTrace(version=1, start_s=4.5, end_s=4.6, transport="shm", num_bytes=1),
        sample(1, 0, 0, 4.6, 5.5, [1], attempt=1),
        sample(1, 1, 1, 4.6, 6.0, [1], attempt=1),
        sample(2, 0, 0, 6.0, 8.0, [1, 2]),
        step(2, 4.5, 7.0, 0.5, 7.5, [1], 30),                 # trains [6.5, 7]: attempt 1, staleness 0
        UpdateTrace(version=2, start_s=7.5, end_s=7.6, transport="shm", num_bytes=1),
        sample(2, 1, 1, 6.0, 9.0, [2]),
        step(3, 7.5, 10.0, 0.8, 10.5, [2], 40),               # trains [9.2, 10]: versions from 1, staleness 1
    ]
    return load_trace(write_trace(tmp_path / "t.jsonl", records))


def test_measure_a_hand_made_trace(tmp_path):
    stats = measure(_hand_trace(tmp_path))
    assert stats.num_steps == 3 and stats.span_s == approx(6.0)
    assert (stats.step_s_mean, stats.step_s_p50, stats.step_s_max) == (approx(3.0), approx(3.0), approx(3.0))
    assert stats.samples_per_s == approx(4 / 6)  # steps 2 and 3 over the span from step 1's end
    assert stats.tokens_per_s == approx(70 / 6)
    assert stats.trainer_idle_fraction == approx(1 - (0.5 + 0.8) / 6)
    # Busy within [4, 10]: engine-0 [4.6, 5.5] + [6, 8] = 2.9; engine-1 [4.6, 6] U [6, 9] = 4.4.
    assert stats.engine_utilization == approx((2.9 + 4.4) / (2 * 6))
    assert stats.staleness == {0: approx(2 / 3), 1: approx(1 / 3)} and stats.staleness_mean == approx(1 / 3)
    assert stats.samples_generated == 8 and stats.dropped == {}


def _stats(**kw) -> RunStats:
    fields = {"num_steps": 3, "span_s": 6.0, "step_s_mean": 3.0, "step_s_p50": 2.0, "step_s_p90": 4.0,
              "step_s_p99": 4.0, "step_s_max": 4.0, "samples_per_s": 2.0, "tokens_per_s": 10.0,
              "trainer_idle_fraction": 0.25, "engine_utilization": 0.5, "staleness": {0: 0.5, 1: 0.5},
              "staleness_mean": 0.5}
    return RunStats(**{**fields, **kw})


def test_compare_gives_relative_errors_and_the_staleness_distance():
    measured = _stats()
    predicted = _stats(step_s_mean=3.3, step_s_p50=1.5, samples_per_s=2.5, trainer_idle_fraction=0.1,
                       engine_utilization=0.75, staleness={1: 0.25, 2: 0.75})
    assert compare(predicted, measured) == {
        "step_s_mean": approx(0.1), "step_s_p50": approx(-0.25), "samples_per_s": approx(0.25),
        "trainer_idle_fraction_abs": approx(-0.15), "engine_utilization_abs": approx(0.25),
        "staleness_tv": approx(0.75)}
    assert compare(measured, measured) == dict.fromkeys(compare(measured, measured), 0.0)
    zero = _stats(step_s_mean=0.0)
    assert compare(zero, zero)["step_s_mean"] == 0.0
    assert compare(measured, zero)["step_s_mean"] == math.inf


def test_staleness_distance_is_total_variation():
    assert staleness_distance({0: 1.0}, {0: 1.0}) == 0.0
    assert staleness_distance({0: 1.0}, {1: 1.0}) == 1.0
    assert staleness_distance({0: 0.5, 1: 0.5}, {0: 0.25, 1: 0.25, 2: 0.5}) == approx(0.5)
    assert staleness_distance({}, {0: 1.0}) == 0.5
    a, b = {0: 0.2, 3: 0.8}, {0: 0.6, 1: 0.4}
    assert staleness_distance(a, b) == staleness_distance(b, a) == approx(0.8)


# ----- the fit, round trip -----

class Varied:
    """Output lengths 50..449 and prompt lengths 100..160 varying with the key; rewards alternate by index."""

    def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec:
        return SampleSpec(output_tokens=50 + (prompt_id * 37 + index * 91) % 400, reward=float(index % 2),
                          prompt_tokens=100 + (prompt_id % 7) * 10)


TRUE = CostModel(gen=GenCost(prefill_s=0.05, token_s=0.01, token_s_per_seq=0.001),
                 train=TrainCost(base_s=2.0, per_token_s=0.0005, overhead_s=0.3),
                 update=UpdateCost(export_s=0.4, push_s=0.6, paused_s=0.2))


def _round_trip(tmp_path, mode: str):
    config = SimConfig(num_engines=2, mode=mode, max_staleness=1, group_size=4, batch_groups=4, target_in_flight=16,
                       capacity_groups=16, num_steps=30)
    result = simulate(config, TRUE, Varied(), record=True)
    trace = load_trace(write(result, tmp_path / "t.jsonl"))
    return result, trace


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_fit_recovers_the_train_and_update_costs(tmp_path, mode):
    _, trace = _round_trip(tmp_path, mode)
    train, update = fit_train(trace), fit_update(trace)
    assert train.base_s == approx(2.0, rel=0.02) and train.per_token_s == approx(0.0005, rel=0.02)
    assert train.overhead_s == approx(0.3, abs=1e-6) and train.fit_world_size == 1
    assert (update.export_s, update.push_s, update.paused_s) == (approx(0.4), approx(0.6), approx(0.2))
    fitted = fit_costs(trace)
    assert fitted.train == train and fitted.update == update and fitted.eval_s == 0.0


@pytest.mark.parametrize("mode", [
    "async",
    "sync",
])
def test_a_fitted_resimulation_predicts_the_step_time(tmp_path, mode):
    result, trace = _round_trip(tmp_path, mode)
    refit = simulate(SimConfig.from_header(trace.header, num_steps=30), fit_costs(trace), Varied())
    assert refit.stats.step_s_mean == approx(result.stats.step_s_mean, rel=0.05)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_fit_recovers_a_zero_dispatch_latency(tmp_path, mode):
    _, trace = _round_trip(tmp_path, mode)
    assert fit_costs(trace).gen.dispatch_s == approx(0.0, abs=0.01)


def test_fit_gen_predicts_sample_durations_of_its_own_trace(tmp_path):
    # The regression is on per-sample averages: its predictions, not its coefficients, are what must hold.
    _, trace = _round_trip(tmp_path, "async")
    gen = fit_costs(trace).gen
    b = engine_concurrency(trace)
    errors = []
    for s in trace.samples:
        key = (s.prompt_id, s.index, s.attempt)
        predicted = gen.prefill_s + s.output_tokens * gen.step_s(1) + gen.token_s_per_seq * s.output_tokens * (
            b[key] - 1)
        pauses = sum(max(0.0, min(s.end_s, u.end_s) - max(s.submit_s, u.end_s - u.paused_s)) for u in trace.updates)
        errors.append(abs(predicted + pauses - (s.end_s - s.submit_s)) / (s.end_s - s.submit_s))
    assert sum(errors) / len(errors) < 0.05


def test_a_synthetic_trace_measures_like_its_simulation(tmp_path):
    result, trace = _round_trip(tmp_path, "async")
    measured = measure(trace)
    assert measured.engine_utilization == approx(result.stats.engine_utilization, abs=0.01)
    assert measured.step_s_mean == approx(result.stats.step_s_mean, rel=0.01)
    assert measured.samples_generated == result.stats.samples_generated


def test_a_synthetic_trace_keeps_the_staleness_of_its_simulation(tmp_path):
    result, trace = _round_trip(tmp_path, "async")
    assert staleness_distance(measure(trace).staleness, result.stats.staleness) < 0.05


def test_a_synthetic_trace_holds_every_step(tmp_path):
    result, trace = _round_trip(tmp_path, "async")
    assert len(trace.steps) == result.stats.num_steps


# ----- the models themselves -----

def test_cost_formulas():
    assert GenCost(token_s=0.02, token_s_per_seq=0.001).step_s(10) == approx(0.03)
    train = TrainCost(base_s=2.0, per_token_s=0.001, fit_world_size=4)
    assert train.train_s(1000, 4) == approx(3.0) and train.train_s(1000, 8) == approx(2.5)
    assert GenCost(token_s=0.0, token_s_per_seq=0.1).step_s(2) == approx(0.2)  # all per sequence is fine


@pytest.mark.parametrize("make, match", [
    (lambda: GenCost(dispatch_s=-1.0), "dispatch_s"),
    (lambda: GenCost(prefill_s=math.nan), "prefill_s"),
    (lambda: GenCost(token_s=-0.01), "token_s"),
    (lambda: GenCost(token_s=0.0, token_s_per_seq=0.0), "cannot take no time"),
    (lambda: TrainCost(base_s=-1.0), "base_s"),
    (lambda: TrainCost(per_token_s=math.nan), "per_token_s"),
    (lambda: TrainCost(overhead_s=-0.1), "overhead_s"),
    (lambda: TrainCost(fit_world_size=0), "fit_world_size"),
    (lambda: UpdateCost(export_s=-1.0), "export_s"),
    (lambda: UpdateCost(push_s=math.nan), "push_s"),
    (lambda: UpdateCost(push_s=1.0, paused_s=2.0), "cannot exceed"),
    (lambda: CostModel(eval_s=-1.0), "eval_s"),
])
def test_cost_models_refuse_impossible_numbers(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cost_model_round_trips_as_json():
    assert msgspec.json.decode(msgspec.json.encode(TRUE), type=CostModel) == TRUE
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"gen": {"tokens_s": 1.0}}', type=CostModel)  # a typo is not ignored


def test_fit_recovers_the_teacher_cost_and_the_resimulation_with_it(tmp_path):
    true = msgspec.structs.replace(TRUE, teacher=TeacherCost(request_s=0.05, token_s=0.002))
    config = SimConfig(num_engines=2, mode="async", max_staleness=1, group_size=4, batch_groups=4,
                       target_in_flight=16, capacity_groups=16, num_steps=30, teacher_in_flight=2)
    result = simulate(config, true, Varied(), record=True)
    trace = load_trace(write(result, tmp_path / "t.jsonl"))
    assert trace.header.teacher_in_flight == 2
    fitted = fit_costs(trace)
    assert fitted.teacher.request_s == approx(0.05, rel=1e-6) and fitted.teacher.token_s == approx(0.002, rel=1e-6)
    refit = simulate(SimConfig.from_header(trace.header, num_steps=30), fitted, Varied())
    assert refit.stats.step_s_mean == approx(result.stats.step_s_mean, rel=0.05)
    assert fit_costs(load_trace(write(simulate(msgspec.structs.replace(config, teacher_in_flight=0), TRUE, Varied(),
                                               record=True), tmp_path / "u.jsonl"))).teacher == TeacherCost()
