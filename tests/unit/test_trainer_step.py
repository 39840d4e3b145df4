"""One trainer rank in this process (world size 1 over gloo): step, weight export, checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from miles_async.actors.trainer import TrainerRank
from miles_async.models import init_model, load_pretrained
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import ENV_KEYS, RankEnv, free_port, init_distributed
from miles_async.trainer.packing import TrainSample, experts_bytes
from miles_async.trainer.step import Trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    folder = init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny")
    assert not dist.is_initialized()
    with pytest.MonkeyPatch.context() as env:  # the torchrun variables live only as long as the group
        for key in ENV_KEYS:
            env.setenv(key, "")
        RankEnv("127.0.0.1", free_port(), 0, 1, 0).export()
        device = init_distributed("gloo", timeout_s=30)
        try:
            yield Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16), device)
        finally:
            dist.destroy_process_group()


def batch() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    return [TrainSample(tokens=torch.randint(1, 250, (n,), generator=gen).tolist(), loss_mask=[0, 0] + [1] * (n - 2),
                        rollout_logprobs=[-5.0] * n, advantage=1.0, reward=float(n)) for n in (10, 7, 12)]


def test_rank_env_needs_all_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT"):
        RankEnv.from_environ()
    with pytest.raises(ValueError, match="outside world_size"):
        RankEnv("h", 1, 2, 2, 0)


def test_actor_declares_its_handlers() -> None:
    assert TrainerRank.handler_table().names == ["ExportWeights", "LoadCheckpoint", "SaveCheckpoint", "TrainStep"]


def test_steps_lower_the_loss_and_report_metrics(trainer: Trainer) -> None:
    metrics = [trainer.train_step(batch(), data_cursor=i) for i in range(3)]
    assert metrics[0].loss > metrics[1].loss > metrics[2].loss
    first = metrics[0]
    assert (first.num_samples, first.num_tokens, first.num_trained_tokens) == (3, 29, 23)
    assert first.num_micro_batches == 3  # 16-token budget: 10 | 7 | 12
    assert first.grad_norm > 0 and first.tokens_per_s > 0 and first.mean_reward == pytest.approx(29 / 3)
    # the trainer's log-probs are far from the fake rollout's -5.0: the gap is reported
    assert first.logprob_abs_diff > 0
    assert trainer.weight_version == metrics[-1].weight_version and trainer.data_cursor == 2
    with pytest.raises(ValueError, match="at least one sample"):
        trainer.train_step([])


def test_exported_buckets_load_into_a_model(trainer: Trainer, tmp_path: Path) -> None:
    buckets = trainer.export_weights(tmp_path / "v1", bucket_bytes=32 << 10)
    assert len(buckets) > 1 and not (tmp_path / ".tmp-v1").exists()
    tensors: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        tensors.update(load_file(bucket.path))
    state = trainer.full_state()
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[name], state[name]) for name in state)
    model = load_pretrained(trainer.config.model_dir)
    model.load_state_dict(tensors, strict=False)  # tied lm_head comes with the embedding
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_checkpoint_round_trip_and_a_failed_save_keeps_the_previous(trainer: Trainer, tmp_path: Path) -> None:
    trainer.train_step(batch(), data_cursor=7)
    saved = trainer.save_checkpoint(tmp_path)
    assert checkpoint.latest(tmp_path) == saved
    assert json.loads((saved / "meta.json").read_text())["data_cursor"] == 7
    before = trainer.full_state()
    step = trainer.step

    def crash(tmp_folder: Path) -> None:
        raise OSError("disk gone")

    trainer.train_step(batch(), data_cursor=8)
    with pytest.raises(OSError, match="disk gone"):
        trainer.save_checkpoint(tmp_path, after_write=crash)
    assert checkpoint.latest(tmp_path) == saved  # the partial one is not picked up
    meta = trainer.load_checkpoint(saved)
    assert (meta["step"], trainer.step, trainer.data_cursor) == (step, step, 7)
    after = trainer.full_state()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(ValueError, match="not a finished checkpoint"):
        trainer.load_checkpoint(tmp_path / f".tmp-{checkpoint.step_folder(tmp_path, step + 1).name}")


def test_moe_step_replays_the_recorded_experts(trainer: Trainer, tmp_path: Path) -> None:
    folder = init_model("qwen3_moe", "tiny", tmp_path / "moe")
    moe = Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16), trainer.device)
    assert moe.moe_shape == (2, 2)
    reference = load_pretrained(folder)
    samples = []
    with torch.no_grad():
        for sample in batch():
            logits_1TV, experts_L1Tk = reference(torch.tensor([sample.tokens]), return_routed_experts=True)
            logp_T = torch.log_softmax(logits_1TV[0, :-1], -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])
            samples.append(TrainSample(
                tokens=sample.tokens, loss_mask=sample.loss_mask, rollout_logprobs=[0.0, *logp_T[:, 0].tolist()],
                advantage=1.0, routed_experts=experts_bytes(experts_L1Tk[:, 0].transpose(0, 1))))
    first = moe.train_step(samples)
    # before any update, with the recorded experts, the trainer scores the rollout's tokens as it did
    assert first.logprob_abs_diff < 1e-5
    assert moe.train_step(samples).loss < first.loss


def test_a_non_finite_gradient_skips_the_update(trainer: Trainer) -> None:
    before, version = trainer.full_state(), trainer.weight_version
    bad = [TrainSample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3, advantage=float("inf"))]
    metrics = trainer.train_step(bad)
    assert metrics.skipped and trainer.weight_version == version == metrics.weight_version
    after = trainer.full_state()
    assert all(torch.equal(before[name], after[name]) for name in before)
