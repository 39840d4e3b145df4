"""RefillPolicy: sample- and group-level refill under admission control, over engines that come and go."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from miles_async.policies import (
    BufferConfig,
    BufferPolicy,
    Group,
    RefillConfig,
    RefillPolicy,
    Submit,
)
from miles_async.trajectory import Trajectory, VersionSpan


def sample(prompt_id, index, versions, reward, aborted=False):
    """A finished sample's metadata (all the policies read), one span per engine call's version."""
    return Trajectory(prompt_id=prompt_id, index=index, versions=tuple(VersionSpan(v, 0, 0) for v in versions),
                      reward=reward, finish_reason="abort" if aborted else "stop")


def make(target=8, n=2, b=2, k=1, max_prompts=None, engines=("e0",), per_engine=None, refill="sample"):
    policy = RefillPolicy(RefillConfig(target_in_flight=target, group_size=n, batch_groups=b, max_staleness=k,
                                       max_prompts=max_prompts, max_in_flight_per_engine=per_engine, refill=refill))
    submits = [s for name in engines for s in policy.add_engine(name, version=0, now=0.0)]
    return policy, submits


def finish_group(policy, submits, prompt_id):
    out = []
    for s in [s for s in submits if s.prompt_id == prompt_id]:
        out += policy.on_sample_done(s.request_id, now=0.0)
    return out


def test_keeps_the_target_in_flight_and_refills_a_finished_sample_at_once():
    policy, submits = make(target=5, n=4, b=4, k=1)
    assert len(submits) == 5 and policy.num_in_flight == 5
    assert [(s.prompt_id, s.index) for s in submits] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    refill = policy.on_sample_done(submits[2].request_id, now=1.0)
    assert [(s.prompt_id, s.index) for s in refill] == [(1, 1)]
    assert policy.num_in_flight == 5


def test_spreads_samples_over_the_least_loaded_engines():
    policy, submits = make(target=9, n=3, b=3, k=1, engines=("a", "b", "c"), per_engine=4)
    assert Counter(s.engine for s in submits) == {"a": 4, "b": 4, "c": 1}  # capped, then least loaded
    freed = [s for s in submits if s.engine == "b"][:3]
    refill = [r for s in freed for r in policy.on_sample_done(s.request_id, now=0.0)]
    assert [r.engine for r in refill] == ["c", "b", "b"]  # ties go to the engine added first
    assert policy.metrics(now=0.0).in_flight_per_engine == {"a": 4, "b": 3, "c": 2}


def test_sync_mode_admits_one_step_and_waits_for_the_trainer_and_the_weights():
    policy, submits = make(target=100, n=2, b=3, k=0)
    assert len(submits) == 6 and {s.prompt_id for s in submits} == {0, 1, 2}
    more = [r for p in range(3) for r in finish_group(policy, submits, p)]
    assert more == [] and policy.num_in_flight == 0
    assert policy.on_trainer_step(1, [0, 1, 2], now=5.0) == []  # the engines still hold version 0
    assert policy.metrics(now=5.0).admission_idle_s == 5.0
    nxt = policy.on_weight_version("e0", 1, now=6.0)
    assert len(nxt) == 6 and {s.prompt_id for s in nxt} == {3, 4, 5}
    assert policy.metrics(now=9.0).admission_idle_s == 6.0  # the wait ended at 6


def test_k2_admits_up_to_three_steps_and_one_more_step_per_trained_step():
    policy, submits = make(target=100, n=2, b=2, k=2)
    assert len({s.prompt_id for s in submits}) == 6 and policy.num_pending_groups == 6
    for p in range(6):
        assert finish_group(policy, submits, p) == []
    assert policy.on_trainer_step(1, [0, 1], now=0.0) == []  # engines at 0, trainer at 1: (0+2-1+1)*2 - 4
    assert {s.prompt_id for s in policy.on_weight_version("e0", 1, now=0.0)} == {6, 7}  # (1+2-1+1)*2 - 4
    assert policy.on_trainer_step(2, [2, 3], now=0.0) == []  # the engines must catch up first
    assert {s.prompt_id for s in policy.on_weight_version("e0", 2, now=0.0)} == {8, 9}


def test_a_removed_engines_samples_go_first_on_the_others():
    policy, submits = make(target=4, n=2, b=2, k=1, engines=("a", "b", "c"), per_engine=2)
    on_b = [s for s in submits if s.engine == "b"]
    removed = policy.remove_engine("b", now=1.0)
    assert removed.lost_request_ids == [s.request_id for s in on_b]
    assert [(s.prompt_id, s.index, s.attempt, s.engine) for s in removed.submit] == \
        [(s.prompt_id, s.index, s.attempt, "c") for s in on_b]
    assert not any(policy.owns(s.request_id) for s in on_b)
    with pytest.raises(ValueError, match="owns"):
        policy.on_sample_done(on_b[0].request_id, now=1.0)


def test_a_retried_prompt_is_generated_again_first_with_the_next_attempt():
    policy, submits = make(target=2, n=2, b=1, k=1)
    submits += finish_group(policy, submits, 0)
    assert policy.on_groups_dropped([0], retry=True, now=0.0) == []  # no free slot
    assert policy.num_pending_groups == 1 and policy.metrics(now=0.0).num_retry_prompts == 1
    nxt = finish_group(policy, submits, 1)
    assert [(s.prompt_id, s.attempt) for s in nxt] == [(0, 1), (0, 1)]


def test_runs_out_of_prompts_and_says_so():
    policy, submits = make(target=8, n=2, b=1, k=3, max_prompts=2)
    assert {s.prompt_id for s in submits} == {0, 1} and not policy.exhausted
    for p in (0, 1):
        finish_group(policy, submits, p)
    policy.on_trainer_step(1, [0], now=0.0)
    policy.on_groups_dropped([1], retry=False, now=0.0)
    assert policy.exhausted


@pytest.mark.parametrize("refill", ["sample", "group"])
def test_accounting_every_sample_is_generated_once_or_explicitly_retried(refill):
    """A whole loop: random completion order, rewards, aborts, an engine lost, buffer drops and retries."""
    rng = random.Random(0)
    n, b, k, num_prompts = 3, 2, 1, 30
    policy, submits = make(target=7, n=n, b=b, k=k, max_prompts=num_prompts, engines=("a", "b", "c"), per_engine=3,
                           refill=refill)
    buffer = BufferPolicy(BufferConfig(capacity_groups=16, max_staleness=k, on_abort="retry", on_stale="retry"))
    in_flight: dict[int, tuple[Submit, int]] = {}
    issued: Counter = Counter()
    lost: list[Submit] = []
    done: dict[tuple[int, int], Trajectory] = {}
    trained, discarded, num_stale, versions = [], set(), 0, {"a": 0, "b": 0, "c": 0}

    def record(new):
        for s in new:  # the sample records the version its engine holds when it starts
            in_flight[s.request_id] = (s, versions[s.engine])
            issued[(s.prompt_id, s.index, s.attempt)] += 1

    def finish(s, version, tick):
        done[(s.prompt_id, s.index)] = sample(s.prompt_id, s.index, (version,), reward=float(rng.random() < 0.6),
                                              aborted=rng.random() < 0.02)
        record(policy.on_sample_done(s.request_id, now=tick))
        if all((s.prompt_id, i) in done for i in range(n)):
            group = Group(prompt_id=s.prompt_id, samples=tuple(done.pop((s.prompt_id, i)) for i in range(n)))
            decision = buffer.put(group, now=tick)
            assert decision.status != "full"
            if decision.status == "dropped":
                if not decision.retry:
                    discarded.add(group.prompt_id)
                record(policy.on_groups_dropped([group.prompt_id], retry=decision.retry, now=tick))

    record(submits)
    for tick in range(5000):
        if policy.exhausted:
            break
        if "c" in versions and tick >= 20 and any(s.engine == "c" for s, _ in in_flight.values()):
            removed = policy.remove_engine("c", now=tick)
            lost += [in_flight.pop(r)[0] for r in removed.lost_request_ids]
            del versions["c"]
            record(removed.submit)
        if in_flight:
            finish(*in_flight.pop(rng.choice(sorted(in_flight))), tick)
        drawn = buffer.get(b, trainer_version=policy.trainer_version, now=tick, allow_partial=not in_flight)
        num_stale += len(drawn.retry)
        record(policy.on_groups_dropped(drawn.retry, retry=True, now=tick))
        assert all(g.staleness(policy.trainer_version) <= k for g in drawn.groups)
        if drawn.groups:
            trained += [g.prompt_id for g in drawn.groups]
            record(policy.on_trainer_step(policy.trainer_version + 1, [g.prompt_id for g in drawn.groups], now=tick))
            for engine in versions:  # the new weights reach the engines at once
                versions[engine] = policy.trainer_version
                record(policy.on_weight_version(engine, policy.trainer_version, now=tick))

    assert policy.exhausted and not in_flight and buffer.num_groups == 0 and policy.num_in_flight == 0
    assert len(trained) == len(set(trained)) and set(trained) | discarded == set(range(num_prompts))
    reissued = Counter((s.prompt_id, s.index, s.attempt) for s in lost)
    assert reissued and all(count == 1 + reissued[key] for key, count in issued.items())
    for prompt_id, _, attempt in issued:  # every index of every attempt 0..a was issued
        assert all((prompt_id, i, a) in issued for i in range(n) for a in range(attempt + 1))
    assert num_stale <= num_prompts // 5  # stragglers overtaken by later groups; admission keeps them rare


def test_bad_configs_and_events_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="target_in_flight"):
        RefillConfig(target_in_flight=0)
    with pytest.raises(ValueError, match="max_staleness"):
        RefillConfig(max_staleness=-1)
    with pytest.raises(ValueError, match=r"RefillConfig.refill must be 'sample' or 'group', got 'batch'"):
        RefillConfig(refill="batch")
    assert RefillConfig().refill == "sample"
    policy, _ = make()
    with pytest.raises(ValueError, match="already known"):
        policy.add_engine("e0", version=0, now=0.0)
    with pytest.raises(ValueError, match="trainer_version"):
        policy.add_engine("e1", version=3, now=0.0)
    with pytest.raises(ValueError, match="not generated"):
        policy.on_trainer_step(1, [0], now=0.0)  # prompt 0 is still generating
    with pytest.raises(ValueError, match="not known"):
        policy.remove_engine("zz", now=0.0)


def test_group_mode_holds_finished_slots_until_the_group_completes_then_refills_n_at_once():
    policy, submits = make(target=6, n=3, b=4, k=1, refill="group")
    assert [(s.prompt_id, s.index) for s in submits] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    first, second, third = submits[:3]
    assert policy.on_sample_done(first.request_id, now=0.0) == []  # its slot stays taken
    assert policy.on_sample_done(submits[3].request_id, now=0.0) == []
    assert policy.on_sample_done(second.request_id, now=0.0) == []
    assert policy.num_in_flight == 6 and policy.metrics(now=0.0).in_flight_per_engine == {"e0": 6}
    assert not policy.owns(first.request_id) and policy.owns(third.request_id)  # owns: not reported yet
    with pytest.raises(ValueError, match="owns"):
        policy.on_sample_done(first.request_id, now=0.0)  # reported twice
    refill = policy.on_sample_done(third.request_id, now=0.0)  # the group's last sample frees all three
    assert [(s.prompt_id, s.index) for s in refill] == [(2, 0), (2, 1), (2, 2)]
    assert policy.num_in_flight == 6 and policy.num_pending_groups == 3
    assert policy.on_trainer_step(1, [0], now=0.0) == []  # group 0 is generated; group 1 still holds 3 slots


def test_group_mode_engine_removal_reissues_only_unfinished_samples_and_releases_held_slots():
    policy, submits = make(target=4, n=2, b=4, k=1, engines=("a", "b", "c"), per_engine=2, refill="group")
    req = {(s.prompt_id, s.index): s for s in submits}
    assert {key: s.engine for key, s in req.items()} == {(0, 0): "a", (0, 1): "a", (1, 0): "b", (1, 1): "b"}
    assert policy.on_sample_done(req[0, 0].request_id, now=0.0) == []  # held on a
    assert policy.on_sample_done(req[1, 0].request_id, now=0.0) == []  # held on b
    removed = policy.remove_engine("a", now=1.0)
    # (0, 0) is done: not lost, not issued again; its held slot went with the engine, so the lost
    # (0, 1) and one sample of a new group fill the two free slots.
    assert removed.lost_request_ids == [req[0, 1].request_id]
    assert [(s.prompt_id, s.index, s.engine) for s in removed.submit] == [(0, 1, "c"), (2, 0, "c")]
    assert policy.num_in_flight == 4 and policy.metrics(now=1.0).in_flight_per_engine == {"b": 2, "c": 2}
    for gone in (req[0, 0], req[0, 1]):
        assert not policy.owns(gone.request_id)
        with pytest.raises(ValueError, match="owns"):
            policy.on_sample_done(gone.request_id, now=1.0)
    # Group 0 completes with its reissued sample: only that slot is freed (nothing held is left).
    refill = policy.on_sample_done(removed.submit[0].request_id, now=2.0)
    assert [(s.prompt_id, s.index, s.engine) for s in refill] == [(2, 1, "c")]
    assert policy.num_in_flight == 4
    # Group 1 completes on b: both of its slots free there together.
    refill = policy.on_sample_done(req[1, 1].request_id, now=2.0)
    assert [(s.prompt_id, s.index, s.engine) for s in refill] == [(3, 0, "b"), (3, 1, "b")]
    assert policy.metrics(now=2.0).in_flight_per_engine == {"b": 2, "c": 2}
    assert policy.on_trainer_step(1, [0, 1], now=2.0) == []


def test_group_mode_removing_the_engine_of_every_held_sample_frees_the_whole_group():
    policy, submits = make(target=2, n=2, b=2, k=1, engines=("a",), refill="group")
    policy.on_sample_done(submits[0].request_id, now=0.0)
    policy.add_engine("b", version=0, now=0.0)  # the target is full: b gets nothing
    removed = policy.remove_engine("a", now=0.0)
    assert removed.lost_request_ids == [submits[1].request_id]
    assert [(s.prompt_id, s.index, s.engine) for s in removed.submit] == [(0, 1, "b"), (1, 0, "b")]
    refill = policy.on_sample_done(removed.submit[0].request_id, now=0.0)
    assert [(s.prompt_id, s.index) for s in refill] == [(1, 1)] and policy.num_in_flight == 2


@pytest.mark.parametrize("refill", ["sample", "group"])
@pytest.mark.parametrize("per_engine", [None, 3])
def test_least_loaded_choice_matches_a_brute_force_reference(refill, per_engine):
    """Random adds, removals, re-adds and completions: every submit goes where a full scan says."""
    rng = random.Random(1234)
    n, target = 3, 14
    policy = RefillPolicy(RefillConfig(target_in_flight=target, group_size=n, batch_groups=10_000,
                                       max_staleness=10, max_in_flight_per_engine=per_engine, refill=refill))
    order: list[str] = []  # live engines in the order added (a re-added one goes last)
    load: dict[str, int] = {}  # slots taken per engine, counted here from the events alone
    unreported: dict[int, Submit] = {}
    held: dict[int, list[Submit]] = {}  # group mode: finished samples per prompt, still holding a slot
    finished: Counter = Counter()  # finished samples per prompt (of its current attempt)

    def expected() -> str | None:
        eligible = [e for e in order if per_engine is None or load[e] < per_engine]
        return min(eligible, key=lambda e: (load[e], order.index(e)), default=None)

    def check(submits):
        for s in submits:
            assert s.engine == expected()
            load[s.engine] += 1
            unreported[s.request_id] = s
        assert policy._least_loaded() == expected()
        assert policy.num_in_flight == sum(load.values()) <= target
        assert policy.metrics(now=0.0).in_flight_per_engine == {e: load[e] for e in order}
        assert all(policy.owns(r) for r in unreported)

    names = [f"e{i}" for i in range(6)]
    for _ in range(3000):
        roll = rng.random()
        if roll < 0.1 and len(order) < len(names):
            name = rng.choice([x for x in names if x not in order])
            order.append(name)
            load[name] = 0
            check(policy.add_engine(name, version=0, now=0.0))
        elif roll < 0.17 and len(order) > 1:
            name = rng.choice(order)
            removed = policy.remove_engine(name, now=0.0)
            assert removed.lost_request_ids == sorted(r for r, s in unreported.items() if s.engine == name)
            for r in removed.lost_request_ids:
                del unreported[r]
            for samples in held.values():
                samples[:] = [s for s in samples if s.engine != name]
            order.remove(name)
            del load[name]
            check(removed.submit)
        elif unreported:
            s = unreported.pop(rng.choice(sorted(unreported)))
            finished[s.prompt_id] += 1
            if refill == "group" and finished[s.prompt_id] < n:
                held.setdefault(s.prompt_id, []).append(s)
            else:
                for freed in [s, *held.pop(s.prompt_id, [])]:
                    load[freed.engine] -= 1
            if finished[s.prompt_id] == n:
                check(policy.on_sample_done(s.request_id, now=0.0))
                check(policy.on_trainer_step(policy.trainer_version, [s.prompt_id], now=0.0))
                continue
            check(policy.on_sample_done(s.request_id, now=0.0))
    assert policy.next_prompt_id > 100  # the walk went through many groups
