"""Order statistics shared by the benchmarks in `miles_async/bench/`: median and percentiles.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, "linear"),
so `percentile(xs, 50)` equals `median(xs)` and the figures match what numpy would print.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Return the `q`-th percentile (0 <= q <= 100) of `values`, linearly interpolated."""
    if not values:
        raise ValueError("percentile of an empty sequence is undefined; pass at least one value")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q!r} is out of range; pass a value in [0, 100]")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lower = math.floor(rank)
    upper = math.ceil(rank)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def median(values: Sequence[float]) -> float:
    """Return the median of `values` (the mean of the middle two when their count is even)."""
    return percentile(values, 50.0)
