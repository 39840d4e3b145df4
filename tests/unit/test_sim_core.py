"""miles_async/sim/simulate.py: the discrete-event loop, checked against answers worked out by hand.

Most tests use a tiny fixed workload (`Fixed`: output lengths by sample index, rewards alternating
by index so the nonzero_std filter keeps every group) and cost models whose numbers make the
closed forms easy: processor sharing on one engine, the sync step as generation + train + export
+ push, trainer-, push- and engine-bound async steps, pauses, evals, replay.
"""

from __future__ import annotations

import itertools
import signal
from collections import Counter

import msgspec
import pytest

from miles_async.observe.records import EvalTrace, SampleTrace, StepTrace, UpdateTrace
from miles_async.sim import (
    CostModel,
    GenCost,
    SampleSpec,
    SimConfig,
    TeacherCost,
    TrainCost,
    UpdateCost,
    load_trace,
    simulate,
    write_trace,
)
from miles_async.sim.synthetic import SCENARIOS, synthesize

approx = pytest.approx


class Fixed:
    """Sample `index` of any prompt: `tokens[index % len(tokens)]` output tokens, reward `index % 2`
    (so a group of >= 2 never has all rewards equal), optional turns, tool time and replay duration."""

    def __init__(self, tokens: list[int], *, prompt_tokens: int = 0, num_turns: int = 1, tool_s: float = 0.0,
                 durations: list[float] | None = None) -> None:
        self.tokens, self.prompt_tokens, self.num_turns, self.tool_s = tokens, prompt_tokens, num_turns, tool_s
        self.durations = durations
        self.asked: list[tuple[int, int, int]] = []

    def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec:
        self.asked.append((prompt_id, index, attempt))
        duration = self.durations[index % len(self.durations)] if self.durations else None
        return SampleSpec(output_tokens=self.tokens[index % len(self.tokens)], reward=float(index % 2),
                          prompt_tokens=self.prompt_tokens, num_turns=self.num_turns, tool_s=self.tool_s,
                          duration_s=duration)


def costs(*, a: float = 0.01, c: float = 0.0, dispatch: float = 0.0, prefill: float = 0.0, base: float = 0.1,
          per_token: float = 0.0, overhead: float = 0.0, export: float = 0.0, push: float = 0.0,
          paused: float = 0.0, eval_s: float = 0.0) -> CostModel:
    return CostModel(gen=GenCost(dispatch_s=dispatch, prefill_s=prefill, token_s=a, token_s_per_seq=c),
                     train=TrainCost(base_s=base, per_token_s=per_token, overhead_s=overhead),
                     update=UpdateCost(export_s=export, push_s=push, paused_s=paused), eval_s=eval_s)


def ps_finish_times(tokens: list[int], a: float, c: float) -> list[float]:
    """Processor sharing on one engine, every sequence starting at 0: while m sequences are left, a
    decode step costs a + c*m and advances each by one token. Finish times, shortest first."""
    t, done, out = 0.0, 0, []
    ordered = sorted(tokens)
    for i, k in enumerate(ordered):
        t += (k - done) * (a + c * (len(ordered) - i))
        done = k
        out.append(t)
    return out


def of(result, kind: type) -> list:
    return [r for r in result.records if type(r) is kind]


def step_intervals(result) -> list[float]:
    ends = [s.train_end_s for s in of(result, StepTrace)]
    return [b - a for a, b in itertools.pairwise(ends)]


# ----- processor sharing and the synchronous step -----

def test_two_samples_share_one_engine_exactly():
    a, c = 0.01, 0.002
    k1, k2 = 100, 300
    model = costs(a=a, c=c, base=1.0, per_token=0.001, export=0.5, push=0.3, paused=0.1)
    config = SimConfig(mode="sync", group_size=2, batch_groups=1, target_in_flight=2, capacity_groups=1,
                       num_steps=4)
    result = simulate(config, model, Fixed([k1, k2], prompt_tokens=0), record=True)
    first = [r for r in of(result, SampleTrace) if r.prompt_id == 0]
    assert [(r.index, r.submit_s) for r in first] == [(0, 0.0), (1, 0.0)]
    assert first[0].end_s == approx(k1 * (a + 2 * c), rel=1e-12)  # 1.4: both on the engine
    gen = k1 * (a + 2 * c) + (k2 - k1) * (a + c)  # 3.8: then alone
    assert first[1].end_s == approx(gen, rel=1e-12)
    train = 1.0 + 0.001 * (k1 + k2)  # 1.4
    steps = of(result, StepTrace)
    assert steps[0].train_end_s == approx(gen + train, rel=1e-12)
    assert steps[0].train_s == approx(train, rel=1e-12) and steps[0].wait_data_s == approx(gen, rel=1e-12)
    # The next group is issued when the push commits: generation + train + export + push per step.
    assert result.stats.step_s_mean == approx(gen + train + 0.5 + 0.3, rel=1e-9)
    assert result.stats.step_s_max == approx(gen + train + 0.5 + 0.3, rel=1e-9)
    assert next((r.version, r.start_s, r.end_s) for r in of(result, UpdateTrace)) == (
        1, approx(gen + train + 0.5), approx(gen + train + 0.8))
    second = [r for r in of(result, SampleTrace) if r.prompt_id == 1]
    assert [r.submit_s for r in second] == [approx(gen + train + 0.8)] * 2 and second[0].versions == [1]


@pytest.mark.parametrize("overhead", [0.1, 12.0])
def test_sync_step_time_closed_form_with_eight_sequences(overhead):
    a, c, dispatch, prefill = 0.01, 0.001, 0.05, 0.2
    tokens = [100, 37, 250, 100]
    model = costs(a=a, c=c, dispatch=dispatch, prefill=prefill, base=1.0, per_token=0.0005, overhead=overhead,
                  export=0.5, push=0.3, paused=0.3)
    config = SimConfig(mode="sync", group_size=4, batch_groups=2, target_in_flight=8, capacity_groups=2,
                       num_steps=6)
    result = simulate(config, model, Fixed(tokens, prompt_tokens=10), record=True)
    ps = ps_finish_times(tokens * 2, a, c)
    first = sorted(r.end_s for r in of(result, SampleTrace) if r.prompt_id in (0, 1))
    # submit_s is the issue time + dispatch; decoding starts after the prefill too.
    assert first == approx([dispatch + prefill + t for t in ps], rel=1e-12)
    gen = dispatch + prefill + ps[-1]
    train = 1.0 + 0.0005 * (2 * sum(tokens) + 8 * 10)
    # The trainer asks `overhead` after its export; the batch is ready a push and a generation later.
    step = train + 0.5 + max(overhead, 0.3 + gen)
    stats = result.stats
    assert stats.step_s_mean == approx(step, rel=1e-9)
    assert stats.step_s_p50 == approx(step, rel=1e-9) and stats.step_s_max == approx(step, rel=1e-9)
    assert stats.staleness == {0: 1.0} and stats.staleness_mean == 0.0
    assert stats.trainer_idle_fraction == approx(1 - train / step, rel=1e-9)
    assert stats.samples_per_s == approx(8 / step, rel=1e-9)
    assert stats.tokens_per_s == approx((2 * sum(tokens) + 80) / step, rel=1e-9)
    # An engine is busy from a submit (its dispatch included) to the last sample's end.
    assert stats.engine_utilization == approx(gen / step, rel=1e-9)
    assert stats.samples_generated == 8 * 6 and stats.dropped == {}


def test_multi_turn_sample_prefills_each_turn_and_leaves_the_engine_for_tools():
    a, c, prefill, dispatch = 0.1, 0.05, 0.5, 0.2
    model = costs(a=a, c=c, prefill=prefill, dispatch=dispatch)
    config = SimConfig(mode="sync", group_size=1, batch_groups=1, target_in_flight=1, capacity_groups=1,
                       filter="none", num_steps=2)
    result = simulate(config, model, Fixed([6], num_turns=3, tool_s=3.0), record=True)
    sample = of(result, SampleTrace)[0]
    assert sample.submit_s == approx(dispatch)
    # 3 prefills, 6 tokens alone on the engine (a + c each), the tool calls off the engine.
    assert sample.end_s - sample.submit_s == approx(3 * prefill + 6 * (a + c) + 3.0, rel=1e-12)


def test_multi_turn_sample_decodes_all_its_output_tokens():
    model = costs(a=1.0)
    config = SimConfig(mode="sync", group_size=1, batch_groups=1, target_in_flight=1, capacity_groups=1,
                       filter="none", num_steps=2)
    first = of(simulate(config, model, Fixed([7], num_turns=2), record=True), SampleTrace)[0]
    assert first.end_s - first.submit_s == approx(7.0)


# ----- async: trainer-, push- and engine-bound -----

@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_trainer_bound_step_is_train_plus_export_plus_overhead(k):
    model = costs(a=0.001, base=10.0, overhead=0.5, export=1.0, push=2.0, paused=0.5)
    config = SimConfig(mode="async", max_staleness=k, group_size=4, batch_groups=2, target_in_flight=8,
                       capacity_groups=16, num_steps=20)
    stats = simulate(config, model, Fixed([100])).stats
    assert stats.step_s_mean == approx(11.5, rel=1e-9) and stats.step_s_max == approx(11.5, rel=1e-9)
    assert stats.trainer_idle_fraction == approx(1 - 10.0 / 11.5, rel=1e-9)
    assert max(stats.staleness) == k


def test_async_trainer_bound_without_export_or_overhead_never_idles():
    model = costs(a=0.001, base=10.0, push=2.0, paused=1.0)
    config = SimConfig(mode="async", max_staleness=1, group_size=4, batch_groups=2, target_in_flight=8,
                       capacity_groups=16, num_steps=10)
    stats = simulate(config, model, Fixed([100])).stats
    assert stats.step_s_mean == approx(10.0, rel=1e-9)
    assert stats.trainer_idle_fraction == approx(0.0, abs=1e-9)


def test_async_push_bound_step_is_the_push():
    # One push at a time: an export finishing while the last push runs waits for its commit.
    model = costs(a=0.001, base=10.0, overhead=0.5, export=1.0, push=20.0, paused=0.0)
    config = SimConfig(mode="async", max_staleness=3, group_size=4, batch_groups=2, target_in_flight=8,
                       capacity_groups=16, num_steps=12)
    result = simulate(config, model, Fixed([100]), record=True)
    # Step 2 trains right after the first export (overhead + train); later ones wait for a commit.
    assert step_intervals(result) == approx([11.5] + [20.0] * 10, rel=1e-9)
    assert result.stats.step_s_mean == approx((11.5 + 10 * 20.0) / 11, rel=1e-9)
    assert result.stats.step_s_p50 == approx(20.0, rel=1e-9)
    pushes = of(result, UpdateTrace)
    assert all(b.start_s == approx(a.end_s) for a, b in itertools.pairwise(pushes))  # back to back


@pytest.mark.parametrize("c", [0.0, 0.001])
def test_async_engine_bound_step_is_one_batch_of_decoding(c):
    a = 0.01
    model = costs(a=a, c=c, base=0.1)
    config = SimConfig(mode="async", max_staleness=4, group_size=4, batch_groups=2, target_in_flight=8,
                       capacity_groups=64, num_steps=30)
    stats = simulate(config, model, Fixed([100])).stats
    # 8 slots, 8 samples per batch, all of 100 tokens at load 8: one batch per 100 decode steps.
    assert stats.step_s_mean == approx(100 * (a + 8 * c), rel=1e-9)
    assert stats.engine_utilization == approx(1.0, abs=1e-9)
    assert stats.trainer_idle_fraction == approx(1 - 0.1 / (100 * (a + 8 * c)), rel=1e-9)


def test_more_engines_never_slow_an_engine_bound_run_and_doubling_halves_it():
    model = costs(a=0.01, base=0.1)
    means, rates = [], []
    for engines in (1, 2, 4):
        config = SimConfig(num_engines=engines, mode="async", max_staleness=4, group_size=4, batch_groups=2,
                           target_in_flight=8 * engines, max_in_flight_per_engine=8, capacity_groups=64,
                           num_steps=60)
        stats = simulate(config, model, Fixed([100])).stats
        assert stats.engine_utilization == approx(1.0, abs=1e-6)
        means.append(stats.step_s_mean)
        rates.append(stats.samples_per_s)
    assert means[0] >= means[1] >= means[2]
    assert means[1] == approx(means[0] / 2, rel=0.05) and means[2] == approx(means[0] / 4, rel=0.05)
    assert rates == approx([8.0, 16.0, 32.0], rel=0.05)


# ----- staleness -----

@pytest.mark.parametrize("mode, k, bound", [("sync", 1, 0), ("one_step_off", 3, 1), ("async", 1, 1),
                                            ("async", 2, 2), ("async", 3, 3)])
def test_staleness_never_exceeds_the_mode_bound(mode, k, bound):
    model = costs(a=0.005, c=0.0002, base=0.5, per_token=0.0001, export=0.1, push=0.4, paused=0.2)
    config = SimConfig(num_engines=3, mode=mode, max_staleness=k, group_size=4, batch_groups=3,
                       target_in_flight=24, capacity_groups=32, num_steps=25)
    result = simulate(config, model, Fixed([20, 400, 60, 90, 1500], prompt_tokens=5), record=True)
    stats = result.stats
    assert sum(stats.staleness.values()) == approx(1.0)
    assert max(stats.staleness) <= bound
    assert all(s.staleness_max <= bound for s in of(result, StepTrace))
    if mode == "sync":
        assert stats.staleness == {0: 1.0}
        assert all(len(r.versions) == 1 for r in of(result, SampleTrace))  # nothing generates across a push
    if bound > 0:
        assert max(stats.staleness) == bound  # the long tail pushes groups to the bound


# ----- refill granularity -----

def test_group_refill_is_slower_on_a_long_tail_and_equal_without_one():
    model = costs(a=0.01, base=0.1)

    def step(refill: str, tokens: list[int]) -> float:
        config = SimConfig(mode="async", max_staleness=2, refill=refill, group_size=4, batch_groups=2,
                           target_in_flight=8, capacity_groups=16, num_steps=20)
        return simulate(config, model, Fixed(tokens)).stats.step_s_mean

    tail = [10, 10, 10, 400]
    # Group refill: 2 groups at a time, each held by its 400-token sample (4 s): 4 s per batch exactly.
    assert step("group", tail) == approx(4.0, rel=1e-9)
    assert step("sample", tail) < 0.5 * step("group", tail)
    assert step("sample", [100]) == step("group", [100]) == approx(1.0, rel=1e-9)


# ----- partial rollouts across a weight update -----

def _partial_run(partial: str, engines: int = 2):
    model = costs(a=0.01, base=2.0, push=0.5, paused=0.2)
    config = SimConfig(num_engines=engines, mode="async", max_staleness=2, partial=partial, group_size=4,
                       batch_groups=2, target_in_flight=8, capacity_groups=16, num_steps=8)
    return simulate(config, model, Fixed([100, 150, 300]), record=True)


def test_continue_appends_each_commit_to_the_samples_in_flight():
    result = _partial_run("continue")
    commits = [(u.end_s, u.version) for u in of(result, UpdateTrace)]
    samples = of(result, SampleTrace)
    assert all(r.finish_reason == "stop" for r in samples) and "aborted" not in result.stats.dropped
    multi = 0
    for r in samples:
        inside = [v for t, v in commits if r.submit_s < t < r.end_s]
        assert r.versions[1:] == inside, r
        assert r.versions == sorted(r.versions)
        multi += len(r.versions) > 1
    assert multi > 0


def test_pauses_delay_decoding_by_their_overlap_exactly():
    # c = 0: a sample's decode time is its tokens x a, whatever else runs; each push's last
    # paused_s stops the decoding of every sample on the engines.
    result = _partial_run("continue")
    windows = [(u.end_s - u.paused_s, u.end_s) for u in of(result, UpdateTrace)]
    assert all(u.paused_s == 0.2 for u in of(result, UpdateTrace))
    delayed = 0
    for r in of(result, SampleTrace):
        overlap = sum(max(0.0, min(r.end_s, hi) - max(r.submit_s, lo)) for lo, hi in windows)
        assert r.end_s - r.submit_s == approx(r.output_tokens * 0.01 + overlap, abs=1e-9), r
        delayed += overlap > 0
    assert delayed > 0


def test_abort_retry_aborts_in_flight_samples_and_drops_their_groups():
    result = _partial_run("abort_retry")
    samples = of(result, SampleTrace)
    aborted = [r for r in samples if r.finish_reason == "abort"]
    assert aborted and all(len(r.versions) == 1 for r in samples)
    commit_times = {u.end_s for u in of(result, UpdateTrace)}
    assert all(r.end_s in commit_times for r in aborted)  # aborted at a commit
    assert result.stats.dropped.get("aborted", 0) > 0
    # on_abort="retry": a dropped group's prompt comes back with the next attempt.
    assert any(r.attempt > 0 for r in samples)
    # Every trained group was generated at a single version (nothing crosses a commit).
    assert result.stats.samples_generated == len(samples)


def test_abort_retry_with_one_engine_never_aborts_a_sample_that_did_not_run():
    for r in of(_partial_run("abort_retry", engines=1), SampleTrace):
        if r.finish_reason == "abort":
            assert r.end_s > r.submit_s


def test_abort_retry_never_aborts_a_sample_issued_at_the_commit():
    for r in of(_partial_run("abort_retry", engines=2), SampleTrace):
        if r.finish_reason == "abort":
            assert r.end_s > r.submit_s, r


# ----- evals -----

@pytest.mark.parametrize("eval_s", [1.0, 3.0])
def test_shared_eval_delays_the_next_ask_by_eval_s(eval_s):
    # Sync: the eval waits for the step's push; the next group is issued at that commit, before the
    # eval holds anything (as in the controller: settle, then HoldRollouts), so the next training
    # starts at commit + max(generation, eval_s + overhead).
    model = costs(a=0.01, base=1.0, overhead=0.1, export=0.5, push=0.3, paused=0.3, eval_s=eval_s)
    config = SimConfig(mode="sync", group_size=2, batch_groups=1, target_in_flight=2, capacity_groups=1,
                       eval_every=2, num_steps=7)
    result = simulate(config, model, Fixed([100, 200]), record=True)
    gen, rest = 2.0, 1.0 + 0.5 + 0.3  # generation; train + export + push
    normal, after_eval = gen + rest, max(gen, eval_s + 0.1) + rest
    assert step_intervals(result) == approx([normal, after_eval] * 3, rel=1e-9)
    # The eval starts when the step's push commits (it evaluates the new weights) and lasts eval_s.
    evals = of(result, EvalTrace)
    commits = {u.version: u.end_s for u in of(result, UpdateTrace)}
    assert [e.step for e in evals] == [2, 4, 6]
    assert [(e.start_s, e.end_s - e.start_s) for e in evals] == [(approx(commits[s]), approx(eval_s))
                                                                 for s in (2, 4, 6)]
    assert result.stats.step_s_max == approx(max(normal, after_eval), rel=1e-9)
    assert result.stats.step_s_mean == approx((3 * normal + 3 * after_eval) / 6, rel=1e-9)


def test_shared_eval_holds_the_rollouts_issued_during_it():
    # Admission wide open (max_staleness 20): every slot freed during an eval is refilled at its end.
    model = costs(a=0.01, base=0.5, push=0.2, eval_s=1.5)
    config = SimConfig(mode="async", max_staleness=20, group_size=2, batch_groups=1, target_in_flight=4,
                       capacity_groups=16, eval_every=3, num_steps=10)
    result = simulate(config, model, Fixed([30, 70, 110]), record=True)
    windows = [(e.start_s, e.end_s) for e in of(result, EvalTrace)]
    assert len(windows) == 3
    samples = of(result, SampleTrace)
    assert not [r for r in samples for lo, hi in windows if lo + 1e-9 < r.submit_s < hi - 1e-9]
    for lo, hi in windows[:2]:  # the last eval's refills may not finish before the run ends
        freed = sum(lo < r.end_s < hi for r in samples)
        assert freed > 0 and sum(abs(r.submit_s - hi) < 1e-9 for r in samples) == freed


# ----- determinism, replay -----

def test_the_same_inputs_give_identical_results():
    scenario = SCENARIOS["math-8gpu"]
    config = msgspec.structs.replace(scenario.config, num_steps=8)
    first = simulate(config, scenario.costs, scenario.workload, record=True)
    second = simulate(config, scenario.costs, scenario.workload, record=True)
    assert first.stats == second.stats and first.num_events == second.num_events
    assert first.records == second.records and first.intervals == second.intervals


def test_replay_takes_recorded_durations_and_train_times_exactly():
    durations = [1.25, 0.5, 3.0, 0.75]
    model = costs(a=1.0, c=1.0, dispatch=0.1, prefill=9.0, base=1.0, push=0.5, paused=0.25)
    config = SimConfig(num_engines=2, mode="async", max_staleness=1, group_size=4, batch_groups=1,
                       target_in_flight=8, capacity_groups=8, num_steps=6, costs="replay")
    by_step = {1: 2.0, 2: 0.5, 3: 1.5, 4: 0.25, 5: 1.0, 6: 0.75}
    result = simulate(config, model, Fixed([100, 5, 7, 9], durations=durations), record=True,
                      train_s_by_step=by_step)
    samples = of(result, SampleTrace)
    assert len(samples) > 8
    for r in samples:  # neither the cost model, the load nor the pauses change a replayed duration
        assert r.end_s - r.submit_s == approx(durations[r.index], abs=1e-12), r
    assert {s.step: s.train_s for s in of(result, StepTrace)} == approx(by_step, rel=1e-12)


def test_replay_falls_back_to_the_fitted_model_without_a_duration():
    model = costs(a=0.01)
    config = SimConfig(mode="sync", group_size=2, batch_groups=1, target_in_flight=2, capacity_groups=1,
                       num_steps=2, costs="replay")
    first = [r for r in of(simulate(config, model, Fixed([100, 200]), record=True), SampleTrace)]
    assert [r.end_s for r in first[:2]] == approx([1.0, 2.0])


# ----- stalls and settings -----

def test_a_run_that_can_never_fill_a_batch_stalls_with_a_clear_error():
    # Group refill holds a finished sample's slot until its group is done: 2 slots never finish a group of 4.
    config = SimConfig(mode="async", refill="group", group_size=4, batch_groups=1, target_in_flight=2,
                       capacity_groups=4, num_steps=3)
    with pytest.raises(RuntimeError, match="stalled after 0 of 3 steps"):
        simulate(config, costs(), Fixed([10]))


def test_a_run_whose_groups_are_all_filtered_ends_with_an_error():
    class Constant:
        def spec(self, prompt_id: int, index: int, attempt: int) -> SampleSpec:
            return SampleSpec(output_tokens=10, reward=1.0)

    def timeout(*_: object) -> None:
        raise TimeoutError("simulate() still running after 0.5 s")

    config = SimConfig(group_size=2, batch_groups=1, target_in_flight=2, capacity_groups=2, num_steps=2)
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(RuntimeError):
            simulate(config, costs(), Constant())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("fields, match", [
    ({"batch_groups": 9, "capacity_groups": 8}, "batch_groups"),
    ({"num_engines": 0}, "num_engines"),
    ({"group_size": 0}, "group_size"),
    ({"target_in_flight": 0}, "target_in_flight"),
    ({"num_steps": 0}, "num_steps"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"eval_every": -1}, "eval_every"),
])
def test_sim_config_refuses_impossible_settings(fields, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**fields)


def test_sim_config_refuses_a_bad_mode_when_converted():
    with pytest.raises(msgspec.ValidationError, match="mode"):
        msgspec.convert({"mode": "bogus"}, SimConfig)
    with pytest.raises(ValueError, match="mode"):
        SimConfig.from_header(SimConfig().header(), mode="bogus")


def test_sim_config_refuses_a_bad_mode_when_constructed():
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="bogus")  # type: ignore[arg-type]


def test_staleness_of_each_mode():
    assert SimConfig(mode="sync", max_staleness=5).staleness == 0
    assert SimConfig(mode="one_step_off", max_staleness=5).staleness == 1
    assert SimConfig(mode="async", max_staleness=5).staleness == 5


def test_from_header_reads_a_recorded_runs_settings(tmp_path):
    config = SimConfig(num_engines=3, trainer_world_size=2, mode="async", max_staleness=2, group_size=4,
                       batch_groups=3, target_in_flight=20, max_in_flight_per_engine=7, refill="group",
                       partial="abort_retry", capacity_groups=9, filter="none", on_stale="discard",
                       on_abort="discard", eval_every=5, num_steps=17)
    assert SimConfig.from_header(config.header()) == config
    step = StepTrace(step=1, weight_version=1, start_s=0.0, end_s=1.0, wait_data_s=0.0, train_s=1.0, update_s=0.0,
                     num_samples=1, num_tokens=1, staleness_mean=0.0, staleness_max=0)
    header = msgspec.structs.replace(config.header(source="run"), eval_mode="dedicated", num_steps=0)
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [header, step]))
    read = SimConfig.from_header(trace.header, num_engines=8)
    # A dedicated eval does not hold the rollouts; a run without a step count is given one step.
    assert read == msgspec.structs.replace(config, eval_every=0, num_steps=1, num_engines=8)
    sync = SimConfig.from_header(SimConfig(mode="sync").header())
    assert (sync.mode, sync.max_staleness, sync.staleness) == ("sync", 0, 0)


# ----- the calibrated scenario -----

def test_agentic_64gpu_median_step_is_the_seeds_263_s():
    # The calibration the synthetic.py docstring promises ("a test holds it there"); about 1 s.
    stats = synthesize(SCENARIOS["agentic-64gpu"], record=False).stats
    assert stats.step_s_p50 == approx(263.0, rel=0.05)
    assert stats.num_steps == 40 and max(stats.staleness) <= 2


def test_recorded_counts_match_the_stats():
    result = _partial_run("continue")
    samples = of(result, SampleTrace)
    assert result.stats.samples_generated == len(samples)
    assert Counter(r.engine for r in samples).keys() == {"engine-0", "engine-1"}
    steps = of(result, StepTrace)
    assert [s.step for s in steps] == list(range(1, result.stats.num_steps + 1))  # the last step too
    assert all(s.num_samples == 8 for s in steps)


# ----- distillation: the teacher's scoring stage -----

def test_the_teacher_scores_each_sample_at_most_k_at_once_before_its_group_is_put():
    a, score_s = 0.01, 0.5 + 0.001 * (10 + 100)
    model = msgspec.structs.replace(costs(a=a, base=1.0), teacher=TeacherCost(request_s=0.5, token_s=0.001))
    config = SimConfig(mode="sync", group_size=4, batch_groups=2, target_in_flight=8, capacity_groups=2,
                       num_steps=4, teacher_in_flight=2)
    result = simulate(config, model, Fixed([100], prompt_tokens=10), record=True)
    gen = ps_finish_times([100] * 8, a, 0.0)[-1]
    # eight samples end together; two at a time are scored, so the batch is ready four requests later
    assert result.stats.step_s_mean == approx(gen + 4 * score_s + 1.0, rel=1e-9)
    first = [r for r in of(result, SampleTrace) if r.prompt_id in (0, 1)]
    assert sorted(r.teacher_wait_s for r in first) == approx([0, 0, score_s, score_s, 2 * score_s, 2 * score_s,
                                                              3 * score_s, 3 * score_s])
    assert all(r.teacher_s == approx(score_s) for r in first)
    # asynchronous and teacher-bound: one request at a time caps the run at 1 / score_s samples a second
    config = SimConfig(mode="async", max_staleness=2, group_size=4, batch_groups=2, target_in_flight=8,
                       capacity_groups=16, num_steps=20, teacher_in_flight=1)
    stats = simulate(config, model, Fixed([100], prompt_tokens=10)).stats
    assert stats.samples_per_s == approx(1 / score_s, rel=1e-6)
    with pytest.raises(ValueError, match="teacher_in_flight must be >= 0"):
        SimConfig(teacher_in_flight=-1)
