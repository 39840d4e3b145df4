"""The RDMA write schedule: which bytes of which trainer bucket go to which engine memory region.

Pure planning, no verbs: the trainer packs each bucket's tensors back to back in order (bucket
layout from `buckets.split_sizes`); the engine registered memory regions and reports where each
of its tensors lives, name -> (region id, offset, nbytes). `plan_writes` matches the two and
returns one `RdmaWrite` per tensor, merged where consecutive tensors are contiguous on both sides
(fewer work requests), and fails with a named error on an unknown, missing or duplicated tensor, a
size mismatch or overlapping destinations. The wire (`rdma.py`) only executes such a plan.

Try it: `pytest tests/unit/test_transport_rdma_plan.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RdmaWrite:
    """One one-sided write: `nbytes` from bucket `src_bucket` at `src_offset` to region `dst_region` at `dst_offset`."""

    src_bucket: int
    src_offset: int
    dst_region: int
    dst_offset: int
    nbytes: int
    names: tuple[str, ...]


def _check_regions(regions: Mapping[str, tuple[int, int, int]]) -> None:
    spans = sorted((region, offset, nbytes, name) for name, (region, offset, nbytes) in regions.items())
    for region, offset, nbytes, name in spans:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"engine region entry {name!r} has offset {offset}, nbytes {nbytes}: must be >= 0")
    for (r1, o1, n1, a), (r2, o2, _, b) in itertools.pairwise(spans):
        if r1 == r2 and o1 + n1 > o2:
            raise ValueError(f"engine tensors {a!r} and {b!r} overlap in region {r1} "
                             f"([{o1}, {o1 + n1}) and [{o2}, ...))")


def plan_writes(buckets: Sequence[Sequence[tuple[str, int]]], regions: Mapping[str, tuple[int, int, int]],
                merge: bool = True) -> list[RdmaWrite]:
    """Writes covering every engine tensor exactly once, in bucket order (see the module docstring)."""
    _check_regions(regions)
    writes: list[RdmaWrite] = []
    seen: set[str] = set()
    for bucket_index, bucket in enumerate(buckets):
        src_offset = 0
        for name, nbytes in bucket:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears in more than one bucket slot")
            seen.add(name)
            if name not in regions:
                raise ValueError(f"trainer tensor {name!r} has no registered engine region "
                                 "(is the name converted for the engine's family?)")
            region, dst_offset, dst_nbytes = regions[name]
            if nbytes != dst_nbytes:
                raise ValueError(f"tensor {name!r} is {nbytes} bytes in the trainer's bucket but "
                                 f"{dst_nbytes} in the engine's region {region}: dtype or shape differ")
            last = writes[-1] if writes else None
            if (merge and last is not None and last.src_bucket == bucket_index and last.dst_region == region
                    and last.src_offset + last.nbytes == src_offset and last.dst_offset + last.nbytes == dst_offset):
                writes[-1] = RdmaWrite(bucket_index, last.src_offset, region, last.dst_offset,
                                       last.nbytes + nbytes, (*last.names, name))
            else:
                writes.append(RdmaWrite(bucket_index, src_offset, region, dst_offset, nbytes, (name,)))
            src_offset += nbytes
    missing = sorted(set(regions) - seen)
    if missing:
        raise ValueError(f"{len(missing)} engine tensors are in no trainer bucket, e.g. {missing[:4]}")
    return writes
