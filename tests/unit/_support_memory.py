"""What the memory tests share: the CPU allocator's running totals while a function runs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def allocation_totals(fn: Callable[[], object]) -> list[int]:
    """The CPU allocator's running total of live bytes at each allocation event while `fn` runs.

    Each allocation event carries the total (counted from the profiler's start), so the maximum is
    the peak of every tensor allocated inside `fn`, intermediates and autograd's saved tensors
    included, and max - min what `fn` added at its worst. (`experimental_event_tree` is a private
    profiler API; only these test helpers rely on it.)
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    totals: list[int] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if isinstance(node.extra_fields, torch._C._profiler._ExtraFields_Allocation):
            totals.append(node.extra_fields.total_allocated)
        stack.extend(node.children)
    assert totals, "the profiler recorded no allocation"
    return totals


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's live bytes while `fn` runs (`allocation_totals`)."""
    return max(allocation_totals(fn))
