"""The one staleness formula and the admission rule built on it."""

from __future__ import annotations

import pytest

from miles_async.policies import (
    admissible,
    admission_capacity,
    group_staleness,
    is_stale,
    sample_staleness,
    trained_at_version,
)


def test_a_group_is_as_stale_as_its_oldest_engine_call():
    assert sample_staleness([3], trainer_version=5) == 2
    assert sample_staleness([3, 4, 5], trainer_version=5) == 2  # a partial rollout across two updates
    assert group_staleness([[5], [4, 5], [3, 5]], trainer_version=5) == 2
    assert group_staleness([[5], [5]], trainer_version=5) == 0
    assert is_stale(2, max_staleness=1) and not is_stale(1, max_staleness=1)


@pytest.mark.parametrize("versions, trainer_version", [([], 3), ([4], 3), ([-1], 3)])
def test_impossible_versions_are_refused(versions, trainer_version):
    with pytest.raises(ValueError, match="version"):
        sample_staleness(versions, trainer_version)


def test_an_empty_group_is_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        group_staleness([], trainer_version=0)


def count_admitted(trainer_version, policy_version, max_staleness, batch_groups, pending=0):
    while admissible(trainer_version, policy_version, max_staleness, batch_groups=batch_groups,
                     num_pending_groups=pending):
        pending += 1
        assert pending < 1000
    return pending


def test_sync_mode_admits_exactly_one_step_and_then_waits_for_the_new_version():
    b = 4
    assert count_admitted(0, 0, 0, b) == b
    # The trainer drew the batch and trains it at version 0: the B groups still pend, none more.
    assert not admissible(0, 0, 0, batch_groups=b, num_pending_groups=b)
    # Trained (v=1) but the engines still hold version 0: still nothing (it would be one step off).
    assert count_admitted(1, 0, 0, b) == 0
    assert count_admitted(1, 1, 0, b) == b


def test_one_step_off_and_fully_async_admit_k_plus_one_steps():
    assert count_admitted(0, 0, 1, 4) == 8
    assert count_admitted(0, 0, 2, 4) == 12
    assert count_admitted(7, 7, 2, 4, pending=5) == 12  # counted from the trainer's current step
    assert count_admitted(7, 6, 2, 4) == 8  # engines one version behind: one step less
    assert admission_capacity(7, 4, 2, batch_groups=4, num_pending_groups=0) == 0


def test_every_admitted_group_is_trained_within_max_staleness():
    b, k, v, e = 3, 2, 5, 4
    n = count_admitted(v, e, k, b)
    assert n == (e + k - v + 1) * b
    assert trained_at_version(v, batch_groups=b, position=n - 1) - e <= k
    assert trained_at_version(v, batch_groups=b, position=n) - e > k


def test_the_worked_example_of_the_docstring():
    assert count_admitted(3, 3, 1, 2) == 4
    assert not admissible(4, 3, 1, batch_groups=2, num_pending_groups=2)
    assert group_staleness([[3, 4]], trainer_version=5) == 2


@pytest.mark.parametrize("bad", [{"trainer_version": 1, "policy_version": 2}, {"max_staleness": -1},
                                 {"batch_groups": 0}, {"num_pending_groups": -1}])
def test_bad_admission_arguments_are_refused(bad):
    call = {"trainer_version": 1, "policy_version": 1, "max_staleness": 1, "batch_groups": 2,
            "num_pending_groups": 0} | bad
    with pytest.raises(ValueError):
        admissible(call.pop("trainer_version"), call.pop("policy_version"), call.pop("max_staleness"), **call)
