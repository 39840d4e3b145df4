"""The colocated handoff: trainer and engine in one process, tensors handed over without a copy.

An engine in this process registers itself under its name (`register`); a pusher in the same
process looks it up (`lookup`) and hands it the converted tensors (`handoff`). The engine takes
each tensor as its new weight when dtype, device and shape match (no copy: its parameters then
point at the trainer's exported tensors), and copies with a cast otherwise (fp32 trainer, bf16
engine). The exported tensors must not be written afterwards: the trainer's export gathers
fresh full tensors, which is why this is safe for FSDP shards.

Try it: `pytest tests/unit/test_engine_weights.py -k colocated -s`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class ColocatedEngine(Protocol):
    async def adopt_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int,
                            expected_checksums: Mapping[str, str] | None = None) -> int: ...


_engines: dict[str, ColocatedEngine] = {}


def register(name: str, engine: ColocatedEngine) -> None:
    if name in _engines and _engines[name] is not engine:
        raise ValueError(f"an engine named {name!r} is already registered in this process")
    _engines[name] = engine


def unregister(name: str) -> None:
    _engines.pop(name, None)


def lookup(name: str) -> ColocatedEngine:
    engine = _engines.get(name)
    if engine is None:
        raise ValueError(f"no engine named {name!r} in this process (have: {', '.join(_engines) or 'none'}); "
                         "the colocated transport needs trainer and engine in one process")
    return engine


async def handoff(name: str, named_tensors: Mapping[str, torch.Tensor], version: int,
                  expected_checksums: Mapping[str, str] | None = None) -> int:
    """Hand `named_tensors` to the engine `name` as `version`; return how many were taken without a copy."""
    return await lookup(name).adopt_weights(named_tensors, version, expected_checksums)
