"""Engines that come back: the restart budget (limit per window, doubling backoff), the recipe's
`[rollout.restart]`, the refill policy taking a lost engine back under its name, and the trace's
engine records (the simulator's reader checks them and replays without them)."""

from __future__ import annotations

import msgspec
import pytest

from miles_async.actors.recipe import load_recipe
from miles_async.actors.rollout import EngineRestartConfig
from miles_async.observe import EngineTrace, decode_trace
from miles_async.policies import RefillConfig, RefillPolicy
from miles_async.runtime import RestartBudget, RestartPolicy
from miles_async.sim.trace import TraceError, load_trace, write_trace

POLICY = RestartPolicy(mode="on_failure", max_restarts=3, within_s=100.0, backoff_s=1.0, backoff_factor=2.0,
                       max_backoff_s=30.0)


def test_the_budget_doubles_the_backoff_stops_at_the_limit_and_forgets_restarts_past_the_window():
    budget = RestartBudget(POLICY)
    assert [budget.next_delay("engine-0", now=t) for t in (0.0, 5.0, 10.0)] == [1.0, 2.0, 4.0]
    assert budget.recent("engine-0", now=10.0) == 3
    assert budget.next_delay("engine-0", now=20.0) is None  # 3 restarts within 100 s: given up
    assert budget.next_delay("engine-0", now=50.0) is None  # a refusal is not a restart: still 3
    assert budget.next_delay("engine-0", now=100.5) == 4.0  # the first aged out: 2 recent
    assert budget.next_delay("engine-0", now=201.0) == 1.0  # all aged out: the backoff starts over
    assert budget.recent("engine-0", now=201.0) == 1


def test_each_engine_has_a_budget_of_its_own():
    budget = RestartBudget(POLICY)
    for t in (0.0, 1.0, 2.0):
        budget.next_delay("engine-0", now=t)
    assert budget.next_delay("engine-0", now=3.0) is None
    assert budget.next_delay("engine-1", now=3.0) == 1.0


def test_the_backoff_is_capped():
    budget = RestartBudget(msgspec.structs.replace(POLICY, max_restarts=10, max_backoff_s=5.0))
    assert [budget.next_delay("e", now=float(t)) for t in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_the_recipe_section_gives_sane_defaults_and_zero_restarts_never_restarts():
    config = load_recipe(None)
    assert config.rollout.restart == EngineRestartConfig()
    policy = config.rollout.restart.policy()
    assert (policy.mode, policy.max_restarts, policy.backoff_s, policy.backoff_factor) == ("on_failure", 3, 1.0, 2.0)
    off = load_recipe(None, ["rollout.restart.max_restarts=0", "rollout.restart.backoff_s=0.5"]).rollout.restart
    assert off.backoff_s == 0.5 and RestartBudget(off.policy()).next_delay("engine-0", now=0.0) is None


@pytest.mark.parametrize("bad", ["rollout.restart.max_restarts=-1", "rollout.restart.within_s=0",
                                 "rollout.restart.backoff_s=-1"])
def test_bad_restart_settings_are_refused_naming_the_section(bad):
    with pytest.raises(ValueError, match="rollout.restart"):
        load_recipe(None, [bad])


def test_an_unknown_restart_key_names_the_valid_ones():
    with pytest.raises(ValueError, match="max_restarts"):
        load_recipe(None, ["rollout.restart.limit=2"])


def test_a_lost_engine_added_back_under_its_name_gets_its_samples_first_and_its_old_requests_stay_void():
    policy = RefillPolicy(RefillConfig(target_in_flight=4, group_size=2, batch_groups=2, max_staleness=1))
    first = policy.add_engine("engine-0", version=0, now=0.0)
    assert [(s.prompt_id, s.index) for s in first] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    removed = policy.remove_engine("engine-0", now=1.0)
    assert removed.submit == [] and policy.num_in_flight == 0  # no engine: the samples wait
    assert sorted(removed.lost_request_ids) == [s.request_id for s in first]
    policy.on_trainer_step(1, [], now=1.5)  # a step was trained while it was away
    back = policy.add_engine("engine-0", version=1, now=2.0)
    assert [(s.prompt_id, s.index, s.engine) for s in back] == [(0, 0, "engine-0"), (0, 1, "engine-0"),
                                                                (1, 0, "engine-0"), (1, 1, "engine-0")]
    assert not {s.request_id for s in back} & set(removed.lost_request_ids)  # new requests
    assert not any(policy.owns(r) for r in removed.lost_request_ids)  # a late reply is not counted
    assert policy.policy_version == 1


def test_an_engine_cannot_be_added_twice_without_being_removed():
    policy = RefillPolicy(RefillConfig(target_in_flight=4, group_size=2, batch_groups=2, max_staleness=1))
    policy.add_engine("engine-0", version=0, now=0.0)
    with pytest.raises(ValueError, match="already known"):
        policy.add_engine("engine-0", version=0, now=1.0)


def _trace(*engine_records: EngineTrace) -> list:
    from test_sim_trace import base  # the simulator's own fixture trace

    records = base()
    return [*records[:4], *engine_records, *records[4:]]


def test_the_simulator_reads_a_trace_with_engine_records_and_replays_a_fixed_fleet(tmp_path):
    records = _trace(EngineTrace(engine="engine-0", time_s=10.2, event="lost", cause="ProcessExited: ..."),
                     EngineTrace(engine="engine-0", time_s=10.6, event="restarted", pid=42),
                     EngineTrace(engine="engine-0", time_s=10.7, event="serving", weight_version=1, pid=42))
    path = write_trace(tmp_path / "trace.jsonl", records)
    assert [r for r in decode_trace(path) if isinstance(r, EngineTrace)] == records[4:7]
    trace = load_trace(path)
    assert len(trace.steps) == 2 and len(trace.samples) == 3


@pytest.mark.parametrize(("record", "field"), [
    (EngineTrace(engine="engine-0", time_s=10.5, event="exploded"), "event"),
    (EngineTrace(engine="engine-0", time_s=1.0, event="lost"), "time_s"),
])
def test_the_simulator_refuses_a_bad_engine_record_naming_the_field(tmp_path, record, field):
    with pytest.raises(TraceError, match=f"trace.jsonl:5: field `{field}`"):
        load_trace(write_trace(tmp_path / "trace.jsonl", _trace(record)))
