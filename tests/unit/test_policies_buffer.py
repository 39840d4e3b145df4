"""BufferPolicy: what it keeps, drops, hands out, and reports; time comes from a VirtualClock."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.policies import BufferConfig, BufferPolicy, Group
from miles_async.runtime.clock import VirtualClock
from miles_async.trajectory import Trajectory, VersionSpan


def sample(prompt_id, index=0, versions=(0,), reward=0.0, aborted=False, num_generated_tokens=0):
    """A finished sample's metadata (all the policy reads), one span per engine call's version."""
    return Trajectory(prompt_id=prompt_id, index=index, versions=tuple(VersionSpan(v, 0, 0) for v in versions),
                      reward=reward, finish_reason="abort" if aborted else "stop",
                      num_generated_tokens=num_generated_tokens)


def group(prompt_id, versions=(0,), rewards=(0.0, 1.0), aborted=False, attempt=0):
    samples = tuple(sample(prompt_id, i, versions, r, aborted=aborted and i == 0, num_generated_tokens=10)
                    for i, r in enumerate(rewards))
    return Group(prompt_id=prompt_id, samples=samples, attempt=attempt)


def test_aborted_groups_are_dropped_and_retried_or_discarded_per_config():
    retry = BufferPolicy(BufferConfig(on_abort="retry")).put(group(1, aborted=True), now=0.0)
    assert (retry.status, retry.reason, retry.retry) == ("dropped", "aborted", True)
    discard = BufferPolicy(BufferConfig(on_abort="discard")).put(group(1, aborted=True), now=0.0)
    assert (discard.status, discard.reason, discard.retry) == ("dropped", "aborted", False)


def test_groups_with_all_equal_rewards_are_filtered_and_never_retried():
    policy = BufferPolicy(BufferConfig(filter="nonzero_std", on_abort="retry", on_stale="retry"))
    decision = policy.put(group(1, rewards=(1.0, 1.0, 1.0)), now=0.0)
    assert (decision.status, decision.reason, decision.retry) == ("dropped", "filtered", False)
    assert policy.num_groups == 0
    assert BufferPolicy(BufferConfig(filter="none")).put(group(1, rewards=(1.0, 1.0)), now=0.0).status == "accepted"
    # unscored samples do not count: a group whose scored rewards are equal (or with one scored) is filtered
    import msgspec

    mixed = group(2, rewards=(1.0, 0.0, 1.0))
    mixed = Group(prompt_id=2, samples=(mixed.samples[0], msgspec.structs.replace(mixed.samples[1], scored=False),
                                        mixed.samples[2]), attempt=0)
    assert policy.put(mixed, now=0.0).reason == "filtered"


def test_a_full_buffer_takes_nothing_until_a_get_makes_room():
    policy = BufferPolicy(BufferConfig(capacity_groups=2))
    assert [policy.put(group(i), now=0.0).status for i in range(2)] == ["accepted", "accepted"]
    assert policy.full and policy.put(group(2), now=0.0).status == "full"
    assert policy.put(group(3, rewards=(1.0, 1.0)), now=0.0).reason == "filtered"  # drops never need room
    assert policy.num_groups == 2
    drawn = policy.get(1, trainer_version=0, now=0.0)
    assert drawn.metrics.num_full_refusals == 1
    assert policy.put(group(2), now=0.0).status == "accepted"


@pytest.mark.parametrize("on_stale", ["retry", "discard"])
def test_stale_groups_are_rejected_at_get(on_stale):
    policy = BufferPolicy(BufferConfig(max_staleness=1, on_stale=on_stale))
    policy.put(group(1, versions=(2,)), now=0.0)
    policy.put(group(2, versions=(1, 3)), now=0.0)  # spans an update: its oldest call (1) counts
    policy.put(group(3, versions=(3,)), now=0.0)
    drawn = policy.get(1, trainer_version=3, now=0.0)
    assert [g.prompt_id for g in drawn.groups] == [1]
    assert (drawn.retry, drawn.discarded) == (([2], []) if on_stale == "retry" else ([], [2]))
    assert [g.prompt_id for g in drawn.stale] == [2]  # the groups themselves, for the actor to free
    assert drawn.metrics.num_dropped == {"aborted": 0, "filtered": 0, "stale": 1}
    assert policy.num_groups == 1


def test_sync_mode_keeps_only_groups_of_the_trainers_version():
    policy = BufferPolicy(BufferConfig(max_staleness=0))
    policy.put(group(1, versions=(4,)), now=0.0)
    policy.put(group(2, versions=(5,)), now=0.0)
    drawn = policy.get(2, trainer_version=5, now=0.0, allow_partial=True)
    assert [g.prompt_id for g in drawn.groups] == [2] and drawn.retry == [1]


def test_get_draws_the_oldest_full_batch_or_nothing():
    policy = BufferPolicy(BufferConfig(capacity_groups=8, max_staleness=2))
    for prompt_id, version in [(10, 3), (11, 2), (12, 3), (13, 2)]:
        policy.put(group(prompt_id, versions=(version,)), now=0.0)
    assert policy.get(5, trainer_version=3, now=0.0).groups == []  # four held, five asked: wait
    assert policy.num_groups == 4
    assert [g.prompt_id for g in policy.get(3, trainer_version=3, now=0.0).groups] == [11, 13, 10]
    assert [g.prompt_id for g in policy.get(3, trainer_version=3, now=0.0, allow_partial=True).groups] == [12]


def test_per_step_metrics_report_staleness_waiting_time_drops_and_occupancy():
    async def scenario():
        clock = VirtualClock()
        policy = BufferPolicy(BufferConfig(capacity_groups=4, max_staleness=2))
        policy.put(group(1, versions=(1,)), now=clock.now())
        await clock.advance(2.0)
        policy.put(group(2, versions=(2,)), now=clock.now())
        policy.put(group(3, versions=(3,)), now=clock.now())
        policy.put(group(4, aborted=True), now=clock.now())
        policy.put(group(5, rewards=(0.5, 0.5)), now=clock.now())
        await clock.advance(3.0)
        return policy.get(2, trainer_version=3, now=clock.now()), policy.get(1, trainer_version=4, now=clock.now())

    first, second = asyncio.run(scenario())
    m = first.metrics
    assert (m.num_drawn, m.drawn_staleness_max, m.drawn_staleness_mean) == (2, 2, 1.5)
    assert (m.drawn_wait_s_max, m.drawn_wait_s_mean) == (5.0, 4.0)
    assert (m.num_waiting, m.waiting_staleness_max, m.occupancy) == (1, 0, 0.25)
    assert m.num_dropped == {"aborted": 1, "filtered": 1, "stale": 0}
    assert second.metrics.num_dropped == {"aborted": 0, "filtered": 0, "stale": 0}  # counts are per step
    assert second.metrics.drawn_staleness_max == 1 and second.metrics.occupancy == 0.0


def test_bad_configs_and_groups_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="capacity_groups"):
        BufferConfig(capacity_groups=0)
    with pytest.raises(ValueError, match="on_stale"):
        BufferConfig(on_stale="keep")
    with pytest.raises(ValueError, match="filter"):
        BufferConfig(filter="top_k")
    with pytest.raises(ValueError, match="other prompts"):
        Group(prompt_id=1, samples=(sample(prompt_id=2),))
    with pytest.raises(ValueError, match="no samples"):
        Group(prompt_id=1, samples=())
