"""The trainer on CUDA over NCCL: one rank, FSDP2, a few steps and a weight export.

GPU only: skipped, with the reason, where no CUDA GPU (or no NCCL) is available.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _support_gpu import cuda_nccl_skip_reason

from miles_async.models import init_model
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import Trainer
from miles_async.trajectory import TokenData, Trajectory

pytestmark = pytest.mark.skipif(cuda_nccl_skip_reason() is not None, reason=str(cuda_nccl_skip_reason()))


def sample(tokens: list[int], mask: list[int], logprobs: list[float]) -> Trajectory:
    """A trajectory with its arrays inline, its metadata from the mask."""
    num_generated = sum(mask)
    return Trajectory(num_tokens=len(tokens), num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated,
                      data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs))


@pytest.fixture
def nccl_rank() -> Iterator[torch.device]:
    with single_process_group("nccl", timeout_s=60) as device:
        yield device


def test_nccl_rank_trains_and_exports(nccl_rank: torch.device, tmp_path: Path) -> None:
    assert nccl_rank.type == "cuda"
    folder = init_model("qwen3", "tiny", tmp_path / "tiny")
    config = TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=32, backend="nccl")
    trainer = Trainer(config, nccl_rank)
    gen = torch.Generator().manual_seed(0)
    samples = [sample(torch.randint(1, 250, (n,), generator=gen).tolist(), [0, 0] + [1] * (n - 2), [-5.0] * n)
               for n in (12, 9, 20)]
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    metrics = [trainer.train_step(samples, [1.0] * len(samples), num_micro_batches=plan.num_micro_batches,
                                  denominator=plan.denominator) for _ in range(3)]
    losses = [m.loss for m in metrics]
    assert losses[2] < losses[0]
    # one rank's share is the whole batch
    assert (metrics[0].num_samples, metrics[0].num_tokens, metrics[0].num_trained_tokens) == (3, 41, 35)
    assert metrics[0].num_micro_batches == plan.num_micro_batches == 2  # 32-token budget: 12 + 9 | 20
    buckets = trainer.export_weights(tmp_path / "weights", 64 << 10)
    assert buckets and all(Path(b.path).exists() for b in buckets)
