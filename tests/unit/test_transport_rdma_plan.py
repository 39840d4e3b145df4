"""The RDMA write schedule planner and the pyverbs import guard (miles_async.transport.rdma*)."""

from __future__ import annotations

import importlib.util

import pytest

from miles_async.transport.buckets import split_sizes
from miles_async.transport.rdma import require_pyverbs
from miles_async.transport.rdma_plan import RdmaWrite, plan_writes

SIZES = [("a", 100), ("b", 50), ("c", 200), ("d", 30)]


def _regions() -> dict[str, tuple[int, int, int]]:
    # a and b contiguous in region 0; c in region 1; d in region 0 after a gap
    return {"a": (0, 0, 100), "b": (0, 100, 50), "c": (1, 64, 200), "d": (0, 512, 30)}


def test_every_tensor_is_written_exactly_once() -> None:
    buckets = split_sizes(SIZES, 160)  # [a, b], [c], [d]
    writes = plan_writes(buckets, _regions(), merge=False)
    assert [w.names for w in writes] == [("a",), ("b",), ("c",), ("d",)]
    assert writes[1] == RdmaWrite(0, 100, 0, 100, 50, ("b",))
    assert writes[3] == RdmaWrite(2, 0, 0, 512, 30, ("d",))
    assert sum(w.nbytes for w in writes) == sum(n for _, n in SIZES)


def test_contiguous_neighbours_merge_into_one_write() -> None:
    writes = plan_writes(split_sizes(SIZES, 1000), _regions())  # one bucket
    assert writes == [RdmaWrite(0, 0, 0, 0, 150, ("a", "b")), RdmaWrite(0, 150, 1, 64, 200, ("c",)),
                      RdmaWrite(0, 350, 0, 512, 30, ("d",))]


def test_mismatches_are_named() -> None:
    buckets = split_sizes(SIZES, 160)
    with pytest.raises(ValueError, match="'c' is 200 bytes .* 199"):
        plan_writes(buckets, {**_regions(), "c": (1, 64, 199)})
    with pytest.raises(ValueError, match="'e' has no registered engine region"):
        plan_writes([*buckets, [("e", 1)]], _regions())
    with pytest.raises(ValueError, match="in no trainer bucket, e.g. \\['d'\\]"):
        plan_writes(buckets[:2], _regions())
    with pytest.raises(ValueError, match="more than one bucket slot"):
        plan_writes([*buckets, [("a", 100)]], _regions())
    with pytest.raises(ValueError, match="overlap in region 0"):
        plan_writes(buckets, {**_regions(), "d": (0, 120, 30)})


@pytest.mark.skipif(importlib.util.find_spec("pyverbs") is not None, reason="pyverbs is installed here")
def test_without_pyverbs_the_error_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"miles-async\[rdma\]"):
        require_pyverbs()
