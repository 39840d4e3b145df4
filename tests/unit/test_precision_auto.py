"""dtype "auto" (miles_async/kernels/precision.py): bfloat16 where the device computes bf16 natively, else
float32, for the engine (`EngineConfig.dtype`) and the trainer (`TrainerConfig.compute_dtype`).

Which answer the CPU gives is the CPU's own (oneDNN's report of AVX512-BF16/AMX): the tests
compare against that report, so they hold on a CPU with native bf16 and on one without.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

from miles_async.engine import Engine, EngineConfig
from miles_async.kernels.precision import auto_dtype, native_bf16
from miles_async.models import init_model
from miles_async.trainer.config import TrainerConfig

CPU = torch.device("cpu")
NATIVE = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def test_auto_is_bf16_only_where_the_cpu_has_it_and_a_named_dtype_is_kept() -> None:
    assert native_bf16(CPU) == (NATIVE == "bfloat16")
    assert auto_dtype("auto", CPU) == NATIVE
    assert native_bf16(torch.device("meta")) is False and auto_dtype("auto", torch.device("meta")) == "float32"
    assert [auto_dtype(d, CPU) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float16"]


def test_the_trainer_makes_auto_concrete_and_never_picks_a_mode_it_would_refuse() -> None:
    auto = TrainerConfig(compute_dtype="auto")
    assert auto.on_device(CPU).compute_dtype == NATIVE
    # bf16 autocast needs fp32 master weights and no batch-invariant kernels: auto falls back
    assert TrainerConfig(compute_dtype="auto", batch_invariant=True).on_device(CPU).compute_dtype == "float32"
    assert TrainerConfig(compute_dtype="auto", dtype="bfloat16").on_device(CPU).compute_dtype == "float32"
    named = TrainerConfig(compute_dtype="bfloat16")
    assert named.on_device(CPU) is named
    with pytest.raises(ValueError, match="'float32', 'bfloat16' or 'auto', got 'fp8'"):
        TrainerConfig(compute_dtype="fp8")


def test_an_engine_on_auto_loads_the_model_in_the_devices_dtype(tmp_path: Path) -> None:
    folder = init_model("qwen3", "tiny", tmp_path / "tiny", seed=0)
    engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=4, dtype="auto"))
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, NATIVE)}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"dtype": "fp8"}, EngineConfig)

    async def close() -> None:
        async with engine:
            pass

    asyncio.run(close())
