"""RestartPolicy decisions are pure: the same inputs give the same backoff or refusal."""

from __future__ import annotations

import pytest

from miles_async.runtime import RestartPolicy


def test_never_never_restarts():
    assert RestartPolicy().next_delay([], now=0.0) is None


def test_backoff_grows_and_the_limit_counts_only_recent_restarts():
    policy = RestartPolicy(mode="on_failure", max_restarts=3, within_s=10.0, backoff_s=0.5, backoff_factor=2.0,
                           max_backoff_s=1.5)
    assert policy.next_delay([], now=0.0) == 0.5
    assert policy.next_delay([0.0], now=1.0) == 1.0
    assert policy.next_delay([0.0, 1.0], now=2.0) == 1.5  # capped
    assert policy.next_delay([0.0, 1.0, 2.0], now=3.0) is None  # limit reached
    assert policy.next_delay([0.0, 1.0, 2.0], now=10.5) == 1.5  # the first one aged out: 2 recent


@pytest.mark.parametrize("bad", [{"max_restarts": -1}, {"within_s": 0}, {"backoff_factor": 0.5},
                                 {"backoff_s": -1}])
def test_bad_policies_are_refused_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="RestartPolicy"):
        RestartPolicy(mode="on_failure", **bad)
