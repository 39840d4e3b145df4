"""StreamingAdamW (trainer/offload.py): torch AdamW's update with its state streamed from a file."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import torch
from _support_memory import allocation_totals

from miles_async.models import init_model
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.offload import StreamingAdamW
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import Trainer
from miles_async.trajectory import TokenData, Trajectory

# sizes that split across buckets off the 64-element grid and leave odd tails
SHAPES = [(300, 70), (1000,), (17, 3, 5), (5000,), (64,)]
BUCKET_MIB = 0.01  # 10 KiB: 1280 fp32 elements with two moments, 873 with a master too


def params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SHAPES]


def grads(step: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def set_grads(ps: list[torch.nn.Parameter], gs: list[torch.Tensor], skip: int | None = None) -> None:
    for i, (p, g) in enumerate(zip(ps, gs)):
        p.grad = None if i == skip else g.clone()


@pytest.mark.parametrize("drop_page_cache", [False, True])
def test_float32_steps_equal_torch_fused_adamw_bit_for_bit(tmp_path: Path, drop_page_cache: bool) -> None:
    ours_p, torch_p = params(), params()
    ours = StreamingAdamW(ours_p, lr=1e-2, weight_decay=0.1, folder=tmp_path, bucket_mib=BUCKET_MIB,
                          drop_page_cache=drop_page_cache)
    ref = torch.optim.AdamW(torch_p, lr=1e-2, weight_decay=0.1, fused=True)
    assert ours.num_buckets >= 20 and ours.kinds == ("exp_avg", "exp_avg_sq")
    for step, lr in enumerate([1e-2, 1e-2, 3e-3, 5e-2]):  # lr changes between steps, as the trainer sets it
        for opt in (ours, ref):
            for group in opt.param_groups:
                group["lr"] = lr
        gs = grads(step)
        skip = 1 if step == 2 else None  # a parameter without a gradient is left alone, state and all
        set_grads(ours_p, gs, skip)
        set_grads(torch_p, gs, skip)
        ours.step()
        ref.step()
        assert all(torch.equal(a, b) for a, b in zip(ours_p, torch_p)), f"step {step}"
    state, ref_state = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in range(len(SHAPES)):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][key], ref_state[i][key]), (i, key)
    assert list(tmp_path.iterdir()) == []  # the state file has no name: nothing to clean up
    ours.close()


def test_bf16_parameters_are_an_fp32_master_rounded(tmp_path: Path) -> None:
    ours_p = params(torch.bfloat16)
    master_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]  # the reference: AdamW on fp32 masters
    ours = StreamingAdamW(ours_p, lr=1e-2, weight_decay=0.05, folder=tmp_path, bucket_mib=BUCKET_MIB)
    ref = torch.optim.AdamW(master_p, lr=1e-2, weight_decay=0.05, fused=True)
    assert ours.kinds == ("exp_avg", "exp_avg_sq", "master")
    for step in range(3):
        gs = grads(step, torch.bfloat16)
        set_grads(ours_p, gs)
        set_grads(master_p, [g.float() for g in gs])
        ours.step()
        ref.step()
        assert all(torch.equal(p, m.detach().bfloat16()) for p, m in zip(ours_p, master_p)), f"step {step}"
    state = ours.state_dict()["state"]
    assert all(torch.equal(state[i]["master"], m) for i, m in enumerate(master_p))
    assert ours.peak_scratch_bytes > 0  # the bf16 gradients of one bucket, as fp32
    ours.close()


def test_at_most_two_buckets_of_state_are_in_memory(tmp_path: Path) -> None:
    ps = [torch.nn.Parameter(torch.zeros(1 << 18)) for _ in range(8)]  # 2 MiB of state each
    opt = StreamingAdamW(ps, lr=1e-3, folder=tmp_path, bucket_mib=1.0)
    assert opt.num_buckets == 16 and opt.bucket_bytes == 1 << 20
    set_grads(ps, [torch.ones(1 << 18)] * 8)
    opt.step()  # the first step writes the zero state; the second reads it back
    set_grads(ps, [torch.ones(1 << 18)] * 8)
    totals = allocation_totals(opt.step)
    allocated = max(totals) - min(totals)
    print(f"\nstep allocated {allocated / 2**20:.2f} MiB for {opt.state_bytes / 2**20:.0f} MiB of state "
          f"in {opt.num_buckets} buckets of {opt.bucket_bytes / 2**20:.0f} MiB")
    assert opt.peak_state_bytes == 2 * opt.bucket_bytes
    assert 2 * opt.bucket_bytes <= allocated < 2 * opt.bucket_bytes + (64 << 10)
    assert opt.bytes_read == opt.bytes_written - opt.state_bytes == opt.state_bytes
    opt.close()


def test_a_state_dict_round_trip_resumes_identically(tmp_path: Path) -> None:
    first_p, resumed_p = params(torch.bfloat16), params(torch.bfloat16)
    first = StreamingAdamW(first_p, lr=1e-2, folder=tmp_path, bucket_mib=BUCKET_MIB)
    for step in range(2):
        set_grads(first_p, grads(step, torch.bfloat16))
        first.step()
    saved = {"state": {i: {k: v.clone() for k, v in entry.items()} for i, entry in first.state_dict()["state"].items()},
             "param_groups": first.state_dict()["param_groups"]}
    with torch.no_grad():
        for a, b in zip(resumed_p, first_p):
            a.copy_(b)
    resumed = StreamingAdamW(resumed_p, lr=5.0, folder=tmp_path, bucket_mib=BUCKET_MIB / 2)  # other buckets
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 1e-2
    for step in range(2, 4):
        for ps, opt in ((first_p, first), (resumed_p, resumed)):
            set_grads(ps, grads(step, torch.bfloat16))
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(first_p, resumed_p))
    first.close()
    resumed.close()


def test_it_takes_over_torch_adamw_state(tmp_path: Path) -> None:
    torch_p, ours_p = params(), params()
    ref = torch.optim.AdamW(torch_p, lr=1e-2, fused=True)
    set_grads(torch_p, grads(0))
    ref.step()
    with torch.no_grad():
        for a, b in zip(ours_p, torch_p):
            a.copy_(b)
    ours = StreamingAdamW(ours_p, lr=1e-2, folder=tmp_path, bucket_mib=BUCKET_MIB)
    ours.load_state_dict(ref.state_dict())
    for ps, opt in ((torch_p, ref), (ours_p, ours)):
        set_grads(ps, grads(1))
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_p, torch_p))
    ours.close()


def test_bad_settings_and_use_after_close_are_refused(tmp_path: Path) -> None:
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_mib"):
            StreamingAdamW(params(), folder=tmp_path, bucket_mib=bad)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="writable folder"):
        StreamingAdamW(params(), folder=tmp_path / "a_file" / "state")
    with pytest.raises(TypeError, match="float64"):
        StreamingAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], folder=tmp_path)
    with pytest.raises(ValueError, match="betas"):
        StreamingAdamW(params(), betas=(0.9, 1.0), folder=tmp_path)
    with pytest.raises(ValueError, match="optimizer_offload"):
        TrainerConfig(optimizer_offload="ram")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer_bucket_mib"):
        TrainerConfig(optimizer_offload="disk", optimizer_bucket_mib=0)
    opt = StreamingAdamW(params(), folder=tmp_path)
    with pytest.raises(RuntimeError, match="param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    fd = opt._fd
    opt.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the file (nameless) went with its descriptor
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def _sample(tokens: list[int]) -> Trajectory:
    n = len(tokens)
    data = TokenData.build(tokens=tokens, loss_mask=[0, 0] + [1] * (n - 2), logprobs=[-5.0] * n)
    return Trajectory(prompt_id=-1, attempt=0, reward=float(n), num_tokens=n, num_prompt_tokens=2,
                      num_generated_tokens=n - 2, data=data)


def _train(trainer: Trainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    samples = [_sample(torch.randint(1, 250, (n,), generator=gen).tolist()) for n in (10, 7, 12)]
    config = trainer.config
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    trainer.train_step(samples, [1.0] * len(samples), num_micro_batches=plan.num_micro_batches,
                       denominator=plan.denominator)


def test_the_trainer_on_disk_trains_as_in_memory_and_resumes(tmp_path: Path) -> None:
    folder = init_model("qwen3", "tiny", tmp_path / "tiny")
    base = TrainerConfig(model_dir=str(folder), lr=1e-3, weight_decay=0.01, micro_batch_tokens=16)
    disk = msgspec.structs.replace(base, optimizer_offload="disk", optimizer_dir=str(tmp_path / "state"),
                                   optimizer_bucket_mib=0.05)
    with single_process_group("gloo", timeout_s=30) as device:
        in_memory, on_disk = Trainer(base, device), Trainer(disk, device)
        assert isinstance(on_disk.optimizer, StreamingAdamW) and on_disk.optimizer.num_buckets > 10
        for seed in range(3):
            _train(in_memory, seed)
            _train(on_disk, seed)
        expected = in_memory.full_state()
        assert all(torch.equal(expected[n], t) for n, t in on_disk.full_state().items())
        saved = on_disk.save_checkpoint(tmp_path / "checkpoints")
        resumed = Trainer(disk, device)
        resumed.load_checkpoint(saved)
        switched = Trainer(base, device)  # float32: the checkpoint loads into the in-memory optimizer too
        switched.load_checkpoint(saved)
        for trainer in (in_memory, resumed, switched):
            _train(trainer, 3)
        expected = in_memory.full_state()
        for trainer in (resumed, switched):
            assert all(torch.equal(expected[n], t) for n, t in trainer.full_state().items())


def test_fsdp2_sharded_parameters_step_and_checkpoint(tmp_path: Path) -> None:
    """DTensor parameters (FSDP2 on a mesh of one rank): local shards stepped, state saved as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from miles_async.trainer import checkpoint

    def sharded(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 4))
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with single_process_group("gloo", timeout_s=30):
        ours_m, ref_m, resumed_m = sharded(0), sharded(0), sharded(1)
        assert all(isinstance(p, DTensor) for p in ours_m.parameters())
        ours = StreamingAdamW(ours_m.parameters(), lr=1e-2, folder=tmp_path, bucket_mib=BUCKET_MIB)
        ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
        for step in range(2):
            train(ours_m, ours, step)
            train(ref_m, ref, step)
        assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
        saved = checkpoint.save(tmp_path / "checkpoints", ours_m, ours, {"step": 2, "weight_version": 2,
                                                                          "data_cursor": 0})
        resumed = StreamingAdamW(resumed_m.parameters(), lr=1.0, folder=tmp_path, bucket_mib=BUCKET_MIB)
        checkpoint.load(saved, resumed_m, resumed)
        for model, opt in ((ref_m, ref), (resumed_m, resumed)):
            train(model, opt, 2)
        assert all(torch.equal(a.to_local(), b.to_local())
                   for a, b in zip(resumed_m.parameters(), ref_m.parameters()))
        ours.close()
        resumed.close()
