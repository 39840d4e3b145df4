"""Which dtype "auto" means on a device: bfloat16 where the device computes it natively, else float32.

A CUDA GPU computes bf16 natively from Ampere on (`torch.cuda.is_bf16_supported()`); a CPU does
with AVX512-BF16 or AMX (what oneDNN reports). Elsewhere (an AVX2-only CPU) every bf16 product is
emulated and runs slower than float32, so "auto" keeps float32 there.
"""

from __future__ import annotations

import torch

__all__ = ["auto_dtype", "native_bf16"]


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matmuls in hardware (module docstring)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def auto_dtype(name: str, device: torch.device) -> str:
    """`name` itself, or for "auto" "bfloat16" when `device` computes bf16 natively, else "float32"."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"
