"""One trainer rank in this process (world size 1 over gloo): step, weight export, checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from _support_memory import peak_allocated_bytes
from safetensors.torch import load_file

from miles_async.actors.trainer import TrainerRank
from miles_async.models import init_model, load_pretrained
from miles_async.rl import AdvantageConfig, PolicyLossConfig
from miles_async.runtime import BlobRef
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import RankEnv, single_process_group
from miles_async.trainer.packing import group_advantages, plan_step
from miles_async.trainer.step import StepMetrics, Trainer
from miles_async.trajectory import TokenData, Trajectory


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    folder = init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny")
    with single_process_group("gloo", timeout_s=30) as device:
        yield Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16), device)


def sample(tokens: list[int], mask: list[int], logprobs: list[float], *, reward: float = 0.0, prompt_id: int = -1,
           attempt: int = 0, ref_logprobs: list[float] | None = None,
           routed_experts: torch.Tensor | None = None) -> Trajectory:
    """A trajectory with its arrays inline, its metadata (what the planner reads) from the mask."""
    data = TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs, ref_logprobs=ref_logprobs,
                           routed_experts=None if routed_experts is None else routed_experts.numpy())
    num_generated = sum(1 for m in mask if m)
    return Trajectory(prompt_id=prompt_id, attempt=attempt, reward=reward, num_tokens=len(tokens),
                      num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated, data=data)


def arrays(s: Trajectory) -> TokenData:
    assert isinstance(s.data, TokenData)
    return s.data


def step(trainer: Trainer, samples: list[Trajectory], advantage: float | None = 1.0, *,
         data_cursor: int | None = None) -> StepMetrics:
    """Plan the step for this one rank and run it: every sample at `advantage`, or (None) the
    group-relative advantages of the trainer's `config.advantage`, as `TrainerGroup.train` gives for RL."""
    config = trainer.config
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation,
                     config.advantage if advantage is None else None)
    advantages = plan.advantages if advantage is None else [advantage] * len(samples)
    return trainer.train_step(samples, advantages, num_micro_batches=plan.num_micro_batches,
                              denominator=plan.denominator, data_cursor=data_cursor)


def batch() -> list[Trajectory]:
    gen = torch.Generator().manual_seed(0)
    return [sample(torch.randint(1, 250, (n,), generator=gen).tolist(), [0, 0] + [1] * (n - 2), [-5.0] * n,
                   reward=float(n)) for n in (10, 7, 12)]


def test_rank_env_needs_all_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT"):
        RankEnv.from_environ()
    with pytest.raises(ValueError, match="outside world_size"):
        RankEnv("h", 1, 2, 2, 0)


def test_actor_declares_its_handlers() -> None:
    assert TrainerRank.handler_table().names == ["EvalLoss", "ExportWeights", "LoadCheckpoint", "SaveCheckpoint",
                                                 "TrainStep"]


def test_steps_lower_the_loss_and_report_metrics(trainer: Trainer) -> None:
    metrics = [step(trainer, batch(), data_cursor=i) for i in range(3)]
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


def test_a_share_that_does_not_fit_its_plan_is_refused(trainer: Trainer) -> None:
    config = trainer.config
    with pytest.raises(ValueError, match="at least one sample"):
        plan_step([], 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    samples = batch()
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    version = trainer.weight_version
    with pytest.raises(ValueError, match="2 advantages for 3 samples"):
        trainer.train_step(samples, [1.0, 1.0], num_micro_batches=plan.num_micro_batches, denominator=plan.denominator)
    with pytest.raises(ValueError, match="plan says 2"):  # planned with another micro-batch budget
        trainer.train_step(samples, [1.0] * 3, num_micro_batches=2, denominator=plan.denominator)
    # A rank reads its share from the data plane before the step: a reference is refused, naming the sample.
    ref = BlobRef(owner="tcp://127.0.0.1:1", segment="miles-dp-0-0-0", token=1, offset=0, size=8)
    remote = [samples[0], msgspec.structs.replace(samples[1], prompt_id=5, data=ref)]
    with pytest.raises(TypeError, match=r"sample 1 \(prompt 5\) has no token data inline \(BlobRef\)"):
        trainer.train_step(remote, [1.0, 1.0], num_micro_batches=3, denominator=plan.denominator)
    assert trainer.weight_version == version


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
    step(trainer, batch(), data_cursor=7)
    saved = trainer.save_checkpoint(tmp_path)
    assert checkpoint.latest(tmp_path) == saved
    assert json.loads((saved / "meta.json").read_text())["data_cursor"] == 7
    before = trainer.full_state()
    saved_step = trainer.step

    def crash(tmp_folder: Path) -> None:
        raise OSError("disk gone")

    step(trainer, batch(), data_cursor=8)
    with pytest.raises(OSError, match="disk gone"):
        trainer.save_checkpoint(tmp_path, after_write=crash)
    assert checkpoint.latest(tmp_path) == saved  # the partial one is not picked up
    meta = trainer.load_checkpoint(saved)
    assert (meta["step"], trainer.step, trainer.data_cursor) == (saved_step, saved_step, 7)
    after = trainer.full_state()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(ValueError, match="not a finished checkpoint"):
        trainer.load_checkpoint(tmp_path / f".tmp-{checkpoint.step_folder(tmp_path, saved_step + 1).name}")


def test_a_staged_checkpoint_is_the_state_at_staging_even_if_training_goes_on(trainer: Trainer,
                                                                              tmp_path: Path) -> None:
    step(trainer, batch(), data_cursor=3)
    before = trainer.full_state()
    staged, meta = trainer.stage_checkpoint()
    step(trainer, batch(), data_cursor=4)  # what a background write runs beside
    assert not all(torch.equal(before[n], t) for n, t in trainer.full_state().items())
    folder = checkpoint.write(tmp_path, staged, meta, files={"run_state.json": b'{"rl_step": 1}'})
    assert json.loads((folder / "run_state.json").read_text()) == {"rl_step": 1}
    trainer.load_checkpoint(folder)
    assert trainer.data_cursor == 3 and all(torch.equal(before[n], t) for n, t in trainer.full_state().items())


def test_prune_keeps_the_newest_finished_checkpoints(tmp_path: Path) -> None:
    for n in (2, 4, 6, 8):
        (checkpoint.step_folder(tmp_path, n) / "x").parent.mkdir()
        (checkpoint.step_folder(tmp_path, n) / checkpoint.META).write_text("{}")
    (tmp_path / ".tmp-step_00000003").mkdir()  # a crashed save older than what is kept
    (tmp_path / ".tmp-step_00000009").mkdir()  # a save in progress
    gone = checkpoint.prune(tmp_path, 2)
    assert sorted(p.name for p in gone) == [".tmp-step_00000003", "step_00000002", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_00000009", "step_00000006", "step_00000008"]
    assert checkpoint.latest(tmp_path) == checkpoint.step_folder(tmp_path, 8)
    with pytest.raises(ValueError, match="keep"):
        checkpoint.prune(tmp_path, 0)


def test_moe_step_replays_the_recorded_experts(trainer: Trainer, tmp_path: Path) -> None:
    folder = init_model("qwen3_moe", "tiny", tmp_path / "moe")
    moe = Trainer(TrainerConfig(model_dir=str(folder), lr=1e-3, micro_batch_tokens=16), trainer.device)
    assert moe.moe_shape == (2, 2)
    reference = load_pretrained(folder)
    samples = []
    with torch.no_grad():
        for s in batch():
            tokens_T = torch.from_numpy(arrays(s).token_ids().astype("int64"))
            logits_1TV, experts_L1Tk = reference(tokens_T[None], return_routed_experts=True)
            logp_T = torch.log_softmax(logits_1TV[0, :-1], -1).gather(-1, tokens_T[1:, None])
            samples.append(sample(tokens_T.tolist(), arrays(s).mask().tolist(), [0.0, *logp_T[:, 0].tolist()],
                                  routed_experts=experts_L1Tk[:, 0].transpose(0, 1)))
    assert arrays(samples[0]).experts_dtype == "uint8"  # 8 experts: one byte per expert id
    first = step(moe, samples)
    # before any update, with the recorded experts, the trainer scores the rollout's tokens as it did
    assert first.logprob_abs_diff < 1e-5
    assert step(moe, samples).loss < first.loss


def test_a_non_finite_gradient_skips_the_update(trainer: Trainer) -> None:
    before, version = trainer.full_state(), trainer.weight_version
    bad = [sample([1, 2, 3], [0, 1, 1], [0.0] * 3)]
    metrics = step(trainer, bad, advantage=float("inf"))
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
    tokens = [torch.from_numpy(arrays(s).token_ids().astype("int64")) for s in samples]
    masks = [torch.from_numpy(arrays(s).mask().copy()) for s in samples]
    with torch.no_grad():
        nll = torch.cat([-torch.log_softmax(model(t[None])[0, :-1], -1).gather(-1, t[1:, None])[:, 0][m[1:] > 0]
                         for t, m in zip(tokens, masks)])
    first = step(sft, samples, advantage=0.0)  # SFT: no advantages (TrainerGroup.train plans none)
    assert first.loss == pytest.approx(float(nll.mean()), rel=1e-5)
    assert step(sft, samples, advantage=0.0).loss < first.loss

    # The rollout's log-probs as the PPO anchor: a rollout 1.0 nat below the trainer's makes
    # every ratio e > 1 + eps, so positive advantages are clipped everywhere.
    with torch.no_grad():
        scored = []
        for t, m in zip(tokens, masks):
            logp_T = torch.log_softmax(model(t[None])[0, :-1], -1).gather(-1, t[1:, None])[:, 0]
            scored.append(sample(t.tolist(), m.tolist(), [0.0, *(logp_T - 1.0).tolist()],
                                 ref_logprobs=[0.0, *(logp_T - 0.5).tolist()]))
    anchored = step(fresh(old_logprobs="rollout"), scored)
    assert anchored.clip_fraction == 1.0 and anchored.tis_truncated_fraction == 0.0
    assert anchored.logprob_abs_diff == pytest.approx(1.0, rel=1e-4)
    assert anchored.rollout_kl_k3 == pytest.approx(math.e - 2.0, rel=1e-3)  # r - 1 - log r at log r = 1

    # The default anchor with a TIS cap below e: every weight truncated; KL to the reference.
    tis = step(fresh(policy_loss=PolicyLossConfig(tis_cap=2.0, kl_coef=0.1)), scored)
    assert tis.tis_truncated_fraction == 1.0 and tis.clip_fraction == 0.0
    assert tis.kl == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-3)  # k3 = r - 1 - log r at log r = -0.5
    assert tis.pg_loss == pytest.approx(-2.0, rel=1e-5)  # advantage 1 x capped weight 2
    assert tis.loss == pytest.approx(tis.pg_loss + 0.1 * tis.kl, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        step(fresh(policy_loss=PolicyLossConfig(kl_coef=0.1)), samples)
    # The entropy bonus (token aggregation: its part is the reported mean entropy).
    bonus = step(fresh(policy_loss=PolicyLossConfig(entropy_coef=0.01)), samples)
    assert bonus.loss == pytest.approx(bonus.pg_loss - 0.01 * bonus.entropy, rel=1e-6) and bonus.grad_norm > 0


def test_the_step_holds_log_prob_chunks_not_full_logits(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(3)
    samples = [sample(torch.randint(1, 500, (256,), generator=gen).tolist(), [0] + [1] * 255, [-6.0] * 256)
               for _ in range(2)]
    num_tokens, vocab = 512, 512

    def peak_bytes(chunk_tokens: int) -> int:
        chunked = Trainer(TrainerConfig(model_dir=trainer.config.model_dir, micro_batch_tokens=num_tokens,
                                        logprob_chunk_tokens=chunk_tokens), trainer.device)
        return peak_allocated_bytes(lambda: step(chunked, samples))

    logits_bytes = num_tokens * vocab * 4
    chunked, whole = peak_bytes(64), peak_bytes(num_tokens)
    print(f"\ntrain step peak: chunks of 64 tokens {chunked / 1e6:.1f} MB, one chunk of {num_tokens} "
          f"{whole / 1e6:.1f} MB; one fp32 [T, V] logits {logits_bytes / 1e6:.1f} MB")
    # one chunk of every token holds two full [T, V] float32 buffers at its peak; chunks of 64 do not
    assert chunked < whole - logits_bytes


def test_group_relative_advantages_come_from_the_rewards(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(3)

    def member(prompt_id: int, reward: float, attempt: int = 0) -> Trajectory:
        return sample(torch.randint(1, 250, (8,), generator=gen).tolist(), [0, 0] + [1] * 6, [-5.0] * 8,
                      reward=reward, prompt_id=prompt_id, attempt=attempt)

    samples = [member(0, 1.0), member(1, 0.5), member(0, 0.0), member(1, 0.5)]
    grpo = AdvantageConfig(estimator="grpo", normalize_std=False)
    assert group_advantages(samples, grpo) == [0.5, 0.0, -0.5, 0.0]
    assert plan_step(samples, 2, 16, "token", grpo).advantages == [0.5, 0.0, -0.5, 0.0]  # whatever the ranks
    assert plan_step(samples, 1, 16, "token", None).advantages == [0.0] * 4  # SFT: none
    with pytest.raises(ValueError, match="same number of samples"):
        group_advantages(samples[:3], grpo)
    # A group is one attempt at a prompt: a prompt generated again is a group of its own. (The old
    # "has no group" refusal is gone: every trajectory has a prompt id and an attempt.)
    retried = [member(0, 1.0), member(0, 0.0), member(0, 0.5, attempt=1), member(0, 0.5, attempt=1)]
    assert group_advantages(retried, grpo) == [0.5, -0.5, 0.0, 0.0]
    # In a step: a group whose rewards are all equal teaches nothing, so only its loss is zero.
    config = TrainerConfig(model_dir=trainer.config.model_dir, lr=1e-3, micro_batch_tokens=16, advantage=grpo)
    flat = step(Trainer(config, trainer.device), [samples[1], samples[3]], advantage=None)
    assert flat.pg_loss == 0.0 and flat.grad_norm == 0.0
    assert step(Trainer(config, trainer.device), samples, advantage=None).grad_norm > 0.0


def test_a_collective_failure_names_the_rank_that_died_not_the_peer_it_broke() -> None:
    """`every_rank`: a peer's error (gloo's connection reset) may arrive before the death that
    caused it; the dead rank is what is raised. Without a death, the first error; without errors,
    the replies in rank order."""
    import asyncio

    from miles_async.actors.trainer import every_rank
    from miles_async.runtime import ActorDeadError, Failure

    async def reply(value: int, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        return value

    async def fail(error: BaseException, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        raise error

    dead = ActorDeadError("trainer-0", Failure(type="ProcessExited", message="killed by signal SIGKILL"))
    reset = RuntimeError("Read error: Connection reset by peer")
    with pytest.raises(ActorDeadError, match="trainer-0"):
        asyncio.run(every_rank([fail(dead, 0.2), fail(reset, 0.0)]))
    with pytest.raises(RuntimeError, match="Connection reset"):
        asyncio.run(every_rank([reply(0, 0.0), fail(reset, 0.0)]))
    assert asyncio.run(every_rank([reply(0, 0.05), reply(1, 0.0)])) == [0, 1]


def test_a_groups_shared_prompt_runs_once_and_trains_the_same(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 250, (9,), generator=gen).tolist() for _ in range(2)]
    samples = [sample(prompt + torch.randint(1, 250, (2 + i,), generator=gen).tolist(), [0] * 9 + [1] * (2 + i),
                      [-5.0] * (11 + i), reward=float(i % 2), prompt_id=p) for p, prompt in enumerate(prompts)
               for i in range(4)]
    results = []
    for share in (True, False):
        config = TrainerConfig(model_dir=trainer.config.model_dir, lr=1e-3, micro_batch_tokens=512,
                               share_prefixes=share)
        ranked = Trainer(config, trainer.device)
        results.append([step(ranked, samples, advantage=None) for _ in range(2)])
    (shared, shared_next), (plain, plain_next) = results
    assert plain.num_forward_tokens == plain.num_tokens == sum(11 + i for i in range(4)) * 2
    assert shared.num_forward_tokens == plain.num_tokens - 2 * 3 * 9  # each prompt once, not 4 times
    assert shared.loss == pytest.approx(plain.loss, rel=1e-5) and shared.grad_norm == pytest.approx(plain.grad_norm, rel=1e-4)
    # (not the weights element by element: Adam's first update is about lr * sign(gradient), which
    # a float-rounding difference flips where a gradient is ~0; the next step's loss sees the whole)
    assert shared_next.loss == pytest.approx(plain_next.loss, rel=1e-3)


def test_eval_loss_is_the_steps_sft_loss_without_an_update(trainer: Trainer) -> None:
    samples = batch()
    config = trainer.config
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    before = trainer.full_state()
    version = trainer.weight_version
    held_out = trainer.eval_loss(samples, num_micro_batches=plan.num_micro_batches, denominator=plan.denominator)
    assert trainer.weight_version == version
    assert all(torch.equal(before[k], v) for k, v in trainer.full_state().items())  # nothing moved
    stepped = trainer.train_step(samples, [0.0] * len(samples), num_micro_batches=plan.num_micro_batches,
                                 denominator=plan.denominator, objective="sft")
    assert held_out == pytest.approx(stepped.loss, rel=1e-6) and held_out > 0
