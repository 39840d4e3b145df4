"""TrainerConfig.compute_dtype = "bfloat16": bf16 matmuls under autocast over fp32 master weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_trainer_step import batch, step

from miles_async.models import init_model
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.step import Trainer


@pytest.fixture
def trainers(tmp_path: Path) -> Iterator[dict[str, Trainer]]:
    """Two trainers of one model, fresh for each test (their weights part after a step)."""
    folder = init_model("qwen3", "tiny", tmp_path / "tiny")
    with single_process_group("gloo", timeout_s=30) as device:
        yield {dtype: Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16,
                                            compute_dtype=dtype), device)
               for dtype in ("float32", "bfloat16")}


def test_compute_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="compute_dtype must be"):
        TrainerConfig(compute_dtype="float16")
    with pytest.raises(ValueError, match="needs dtype = 'float32'"):
        TrainerConfig(dtype="bfloat16", compute_dtype="bfloat16")
    with pytest.raises(ValueError, match="batch_invariant = false"):
        TrainerConfig(compute_dtype="bfloat16", batch_invariant=True)


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor (FSDP2 holds DTensors)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _linear_output_dtypes(trainer: Trainer) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for m in trainer.model.modules() if isinstance(m, torch.nn.Linear) and m is not trainer.model.lm_head]
    try:
        step(trainer, batch())
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_bf16_runs_the_matmuls_in_bf16_and_keeps_fp32_weights_and_optimizer_state(trainers: dict[str, Trainer]) -> None:
    assert _linear_output_dtypes(trainers["float32"]) == {torch.float32}
    assert _linear_output_dtypes(trainers["bfloat16"]) == {torch.bfloat16}
    mixed = trainers["bfloat16"]
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    states = [s for s in mixed.optimizer.state.values() if "exp_avg" in s]
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}


def test_bf16_steps_track_the_fp32_steps(trainers: dict[str, Trainer]) -> None:
    """Same model, same batches: losses within 2% and both falling; the weights end within bf16 noise."""
    fp32, mixed = trainers["float32"], trainers["bfloat16"]
    before = {n: _full(p).clone() for n, p in fp32.model.named_parameters()}
    assert all(torch.equal(before[n], _full(p)) for n, p in mixed.model.named_parameters())
    losses = {name: [step(t, batch()).loss for _ in range(3)] for name, t in trainers.items()}
    for name, values in losses.items():
        assert values[0] > values[1] > values[2], (name, values)
    for a, b in zip(losses["float32"], losses["bfloat16"]):
        assert b == pytest.approx(a, rel=2e-2)
    moved = {n: _full(p) - before[n] for n, p in fp32.model.named_parameters()}
    for n, p in mixed.model.named_parameters():
        delta = _full(p) - before[n]
        if moved[n].norm() > 0:
            cosine = torch.nn.functional.cosine_similarity(delta.flatten(), moved[n].flatten(), dim=0)
            assert cosine > 0.9, (n, float(cosine))
