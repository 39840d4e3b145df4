"""One trainer rank in this process (world size 1 over gloo): step, weight export, checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from torch.profiler import ProfilerActivity, profile

from miles_async.actors.trainer import TrainerRank
from miles_async.models import init_model, load_pretrained
from miles_async.rl import AdvantageConfig, PolicyLossConfig
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import RankEnv, single_process_group
from miles_async.trainer.packing import TrainSample, experts_bytes, with_group_advantages
from miles_async.trainer.step import Trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    folder = init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny")
    with single_process_group("gloo", timeout_s=30) as device:
        yield Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16), device)


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
    assert first.logprob_abs_diff > 0 and first.rollout_kl_k3 > 0
    assert first.entropy > 5.0  # a random init is close to uniform over the 512 tokens (ln 512 = 6.24)
    # ratio 1 at the step's own weights: nothing clipped; TIS reweights (loss = -mean weight)
    assert first.clip_fraction == first.dual_clip_fraction == 0.0 and first.kl == 0.0
    assert first.loss == first.pg_loss < 0
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


def test_loss_modes_sft_rollout_anchor_kl_and_tis_metrics(trainer: Trainer) -> None:
    folder = trainer.config.model_dir
    samples = batch()

    def fresh(**overrides: object) -> Trainer:
        return Trainer(TrainerConfig(model_dir=folder, lr=1e-3, micro_batch_tokens=16, **overrides), trainer.device)

    # SFT: mean cross-entropy of the trained tokens, which training lowers; the rollouts are not read.
    sft = fresh(objective="sft")
    model = load_pretrained(folder)
    with torch.no_grad():
        nll = torch.cat([-torch.log_softmax(model(torch.tensor([s.tokens]))[0, :-1], -1)
                         .gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0][torch.tensor(s.loss_mask[1:]) > 0]
                         for s in samples])
    first = sft.train_step(samples)
    assert first.loss == pytest.approx(float(nll.mean()), rel=1e-5)
    assert sft.train_step(samples).loss < first.loss

    # The rollout's log-probs as the PPO anchor: a rollout 1.0 nat below the trainer's makes
    # every ratio e > 1 + eps, so positive advantages are clipped everywhere.
    with torch.no_grad():
        scored = []
        for s in samples:
            logp_T = torch.log_softmax(model(torch.tensor([s.tokens]))[0, :-1], -1).gather(
                -1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            scored.append(msgspec.structs.replace(s, rollout_logprobs=[0.0, *(logp_T - 1.0).tolist()],
                                                  ref_logprobs=[0.0, *(logp_T - 0.5).tolist()]))
    anchored = fresh(old_logprobs="rollout").train_step(scored)
    assert anchored.clip_fraction == 1.0 and anchored.tis_truncated_fraction == 0.0
    assert anchored.logprob_abs_diff == pytest.approx(1.0, rel=1e-4)
    assert anchored.rollout_kl_k3 == pytest.approx(math.e - 2.0, rel=1e-3)  # r - 1 - log r at log r = 1

    # The default anchor with a TIS cap below e: every weight truncated; KL to the reference.
    tis = fresh(policy_loss=PolicyLossConfig(tis_cap=2.0, kl_coef=0.1)).train_step(scored)
    assert tis.tis_truncated_fraction == 1.0 and tis.clip_fraction == 0.0
    assert tis.kl == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-3)  # k3 = r - 1 - log r at log r = -0.5
    assert tis.pg_loss == pytest.approx(-2.0, rel=1e-5)  # advantage 1 x capped weight 2
    assert tis.loss == pytest.approx(tis.pg_loss + 0.1 * tis.kl, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        fresh(policy_loss=PolicyLossConfig(kl_coef=0.1)).train_step(samples)
    # The entropy bonus (token aggregation: its part is the reported mean entropy).
    bonus = fresh(policy_loss=PolicyLossConfig(entropy_coef=0.01)).train_step(samples)
    assert bonus.loss == pytest.approx(bonus.pg_loss - 0.01 * bonus.entropy, rel=1e-6) and bonus.grad_norm > 0


def test_the_step_holds_log_prob_chunks_not_full_logits(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(3)
    samples = [TrainSample(tokens=torch.randint(1, 500, (256,), generator=gen).tolist(), loss_mask=[0] + [1] * 255,
                           rollout_logprobs=[-6.0] * 256, advantage=1.0) for _ in range(2)]
    num_tokens, vocab = 512, 512

    def peak_bytes(chunk_tokens: int) -> int:
        step = Trainer(TrainerConfig(model_dir=trainer.config.model_dir, micro_batch_tokens=num_tokens,
                                     logprob_chunk_tokens=chunk_tokens), trainer.device)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step.train_step(samples)
        # the allocator's running total at each allocation event (private API, as in test_kernels_logprobs)
        totals, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if isinstance(node.extra_fields, torch._C._profiler._ExtraFields_Allocation):
                totals.append(node.extra_fields.total_allocated)
            stack.extend(node.children)
        return max(totals)

    logits_bytes = num_tokens * vocab * 4
    chunked, whole = peak_bytes(64), peak_bytes(num_tokens)
    print(f"\ntrain step peak: chunks of 64 tokens {chunked / 1e6:.1f} MB, one chunk of {num_tokens} "
          f"{whole / 1e6:.1f} MB; one fp32 [T, V] logits {logits_bytes / 1e6:.1f} MB")
    # one chunk of every token holds two full [T, V] float32 buffers at its peak; chunks of 64 do not
    assert chunked < whole - logits_bytes


def test_group_relative_advantages_come_from_the_rewards(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(3)

    def sample(group: int, reward: float) -> TrainSample:
        tokens = torch.randint(1, 250, (8,), generator=gen).tolist()
        return TrainSample(tokens=tokens, loss_mask=[0, 0] + [1] * 6, rollout_logprobs=[-5.0] * 8,
                           reward=reward, group=group)

    samples = [sample(0, 1.0), sample(1, 0.5), sample(0, 0.0), sample(1, 0.5)]
    grpo = AdvantageConfig(estimator="grpo", normalize_std=False)
    assert [s.advantage for s in with_group_advantages(samples, grpo)] == [0.5, 0.0, -0.5, 0.0]
    with pytest.raises(ValueError, match="same number of samples"):
        with_group_advantages(samples[:3], grpo)
    with pytest.raises(ValueError, match="has no group"):
        with_group_advantages([*samples, sample(-1, 1.0)], grpo)
    # In a step: a group whose rewards are all equal teaches nothing, so only its loss is zero.
    config = TrainerConfig(model_dir=trainer.config.model_dir, lr=1e-3, micro_batch_tokens=16, advantage=grpo)
    flat = Trainer(config, trainer.device).train_step([samples[1], samples[3]])
    assert flat.pg_loss == 0.0 and flat.grad_norm == 0.0
    assert Trainer(config, trainer.device).train_step(samples).grad_norm > 0.0
