"""`PrefixAffinity` (where RoutedBackend sends R3 requests) and `SGLangRouter`'s command line.

The router itself, in front of real engines, is tests/e2e/test_sglang_router.py.
"""

from __future__ import annotations

import pytest

from miles_async.engine.router import PrefixAffinity, SGLangRouter


def ids(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def test_a_sessions_later_turns_follow_its_first():
    affinity = PrefixAffinity(2, block_tokens=4)
    for s in range(4):
        affinity.record(ids(s, 12), s % 2)
    for s in range(4):
        later_turn = ids(s, 12) + [7] * 8  # the previous prompt and more: 12 of 20 tokens known
        assert affinity.choose(later_turn, [5, 0]) == s % 2  # even against the load


def test_a_short_shared_prefix_does_not_pull_everything_to_one_engine():
    affinity = PrefixAffinity(2, block_tokens=4, min_match_fraction=0.5)
    system = [1, 2, 3, 4]
    chosen = []
    for s in range(4):
        prompt = system + ids(s + 1, 12)
        engine = affinity.choose(prompt, [0, 0])
        affinity.record(prompt, engine)
        chosen.append(engine)
    assert chosen == [0, 1, 0, 1]  # 4 of 16 tokens match: below half, so the emptier engine


def test_capacity_bounds_what_is_remembered_and_clear_forgets():
    affinity = PrefixAffinity(2, block_tokens=4, capacity=3)
    affinity.record(ids(1, 4), 1)
    assert affinity.choose(ids(1, 4), [0, 1]) == 1  # remembered: against the load
    affinity.record(ids(2, 12), 0)  # three more blocks: the least recently used one goes
    assert affinity.choose(ids(1, 4), [0, 1]) == 0  # forgotten: the one with fewer in flight
    assert affinity.choose(ids(2, 12), [1, 0]) == 0
    affinity.clear()
    assert affinity.choose(ids(2, 12), [1, 0]) == 1


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        PrefixAffinity(0)
    with pytest.raises(ValueError, match="min_match_fraction"):
        PrefixAffinity(2, min_match_fraction=1.5)
    with pytest.raises(ValueError, match="policy"):
        SGLangRouter(["http://127.0.0.1:1"], policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker URL"):
        SGLangRouter([])


def test_router_command_line():
    router = SGLangRouter(["http://127.0.0.1:1/", "http://127.0.0.1:2"], port=30001, policy="round_robin",
                          prometheus_port=29001, extra_args=["--cache-threshold", "0.5"])
    argv = router.argv()
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--prometheus-port") + 1] == "29001"
    assert argv[-2:] == ["--cache-threshold", "0.5"] and router.url == "http://127.0.0.1:30001"
