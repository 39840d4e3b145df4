"""Linear layers on weights prepacked for oneDNN: the embedded engine's matmuls on a CPU.

`F.linear` on a CPU re-lays the weight out for its kernel on every call (bf16: oneDNN) or runs
MKL's sgemm (fp32), which on AMD CPUs takes a generic path. A weight reordered once into oneDNN's
blocked layout (`prepack`) and multiplied with `linear` streams at close to the memory bandwidth
instead. Measured here (one core of an AMD EPYC with avx512_bf16, torch 2.13, weights not in
cache): SmolLM2's [576 -> 1536] projection at 1-4 tokens, 118 us -> 57-63 us in bf16 and
210-300 us -> 120-140 us in fp32; at 64 tokens 318 -> 269 us (bf16) and 1,194 -> 514 us (fp32);
its vocabulary projection at 1 token 3.3 ms -> 1.4 ms (bf16). This is what inductor's CPU
"freezing" does to a compiled model's linears, without compiling anything.

Results equal `F.linear`'s up to the order of the float sums (bit for bit on the bf16 shapes
tried; fp32 within ~1e-6 relative), so the engine keeps them out of true on-policy mode, whose
log-probs must equal the trainer's bit for bit.

- `supported(dtype, device)`: whether this torch build has the ops for that dtype there (x86 CPU
  builds have; the packed copy is then `prepack(weight)`).
- `linear(x, packed, bias)`: `x @ weight.T + bias` through the packed copy.

The packed copy is a second copy of the weight (opaque, oneDNN's layout): it must be made again
whenever the weight changes (the engine repacks after every weight update).
"""

from __future__ import annotations

import functools

import torch

# The batch size oneDNN is told to expect: any size works; this one suits decoding batches and
# measured as fast as a hint of 1 or 1024 at 1 to 1024 rows.
BATCH_HINT = 64


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    try:
        weight = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        out = linear(x, prepack(weight), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out.float(), torch.nn.functional.linear(x, weight).float(), rtol=1e-2, atol=1e-2))


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` can be prepacked here (CPU, oneDNN built in, dtype
    fp32 or bf16, and a probe multiply agrees with `F.linear`)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return _probe(dtype)


def prepack(weight_ND: torch.Tensor) -> torch.Tensor:
    """The weight ([out, in], as `nn.Linear` holds it) reordered into oneDNN's layout (a new tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight_ND.detach(), BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the weight given as `prepack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
