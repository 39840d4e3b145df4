"""Per-tensor checksums and the random-fill check that catches a transport skipping a tensor.

The check (docs/design.md, "Weight transports"): overwrite the engine's weights with `random_fill`,
run the update, then `compare(checksums(trainer_side), checksums(engine_side))` must be empty.
A checksum is exact: blake2b of the raw bytes plus dtype and shape, so a bf16 value that differs
in one bit, a transposed layout or a dtype change all count as differences.

Try it:
    python -c "import torch; from miles_async.transport.verify import checksum; print(checksum(torch.ones(2)))"
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from miles_async.transport.buckets import NamedTensors, as_items


def checksum(tensor: torch.Tensor) -> str:
    """`dtype:shape:blake2b-hex` of the tensor's elements in row-major order."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    shape = "x".join(str(d) for d in tensor.shape)
    return f"{str(tensor.dtype).removeprefix('torch.')}:{shape}:{digest}"


def checksums(named: NamedTensors) -> dict[str, str]:
    """name -> `checksum`, in the input's order."""
    return {name: checksum(t) for name, t in as_items(named)}


def compare(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Names whose checksum differs, is missing from `actual`, or is in `actual` only; [] if equal."""
    bad = [name for name, value in expected.items() if actual.get(name) != value]
    return bad + [name for name in actual if name not in expected]


@torch.no_grad()
def random_fill(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor], seed: int) -> None:
    """Overwrite every tensor in place with seeded random values (uniform integers for int dtypes)."""
    generator = torch.Generator().manual_seed(seed)
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    for tensor in values:
        if tensor.dtype.is_floating_point:
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        else:
            noise = torch.randint(0, 127, tensor.shape, generator=generator)
        tensor.copy_(noise.to(tensor.dtype))
