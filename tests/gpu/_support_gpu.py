"""What the GPU tests share: why they cannot run here (no CUDA GPU, or a torch without NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_nccl_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU and none is visible"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None
