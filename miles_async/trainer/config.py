"""`TrainerConfig`: what one trainer rank needs to know, with defaults that run the tiny model on CPU."""

from __future__ import annotations

import msgspec


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of the trainer ranks (one value for every rank of a run).

    `micro_batch_tokens` bounds the packed tokens of one forward/backward; a sample longer than it
    gets a micro-batch of its own. `backend` "auto" picks NCCL when CUDA is there, else gloo.
    """

    model_dir: str
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    dtype: str = "float32"
    backend: str = "auto"
    num_threads: int = 0  # torch intra-op threads per rank; 0 leaves torch's default
    seed: int = 0
    checkpoint_dir: str = ""  # "" means no checkpoints; otherwise the folder of step_<N> checkpoints
    # where full-weight buckets are written for the pusher ("" = a temporary folder of the run;
    # a folder on /dev/shm makes the hand-off a shared-memory one on one node)
    weights_dir: str = ""
    weight_bucket_bytes: int = 64 << 20
    process_group_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"lr and grad_clip must be positive, got lr={self.lr}, grad_clip={self.grad_clip}")
        if self.weight_bucket_bytes < 1:
            raise ValueError(f"weight_bucket_bytes must be >= 1, got {self.weight_bucket_bytes}")
