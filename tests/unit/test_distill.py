"""On-policy distillation's signal: the teacher's reverse KL folded into the advantage, checked
on a hand-computed example, through the metrics, the packing and a trainer step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_async.models import init_model, load_pretrained
from miles_async.rl import PolicyLossConfig, RLMetrics, distill_advantages, metric_sums, policy_loss
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.packing import pack, plan_step
from miles_async.trainer.step import Trainer
from miles_async.trajectory import TokenData, Trajectory

ROLLOUT = [-1.0, -0.5, -2.0, -0.3]  # the student's log-probs of the tokens it sampled
TEACHER = [-1.5, -0.5, -0.2, -0.3]  # the teacher's log-probs of the same tokens


def test_the_reverse_kl_is_folded_into_the_advantage_by_hand() -> None:
    rollout, teacher = torch.tensor(ROLLOUT), torch.tensor(TEACHER)
    # student - teacher: 0.5, 0.0, -1.8, 0.0; times 0.5 off each advantage
    assert distill_advantages(torch.ones(4), rollout, teacher, 0.5).tolist() == pytest.approx([0.75, 1.0, 1.9, 1.0])
    # task reward zero: the signal alone (the over-favoured token is pushed down, the under-favoured up)
    assert distill_advantages(torch.zeros(4), rollout, teacher, 0.5).tolist() == pytest.approx([-0.25, 0.0, 0.9, 0.0])
    logp = rollout.clone().requires_grad_()
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    config = PolicyLossConfig(distill_coef=0.5, tis_cap=None)
    out = policy_loss(logp, torch.ones(4), mask, None, config, rollout_logp_T=rollout, teacher_logp_T=teacher)
    # at ratio 1 (the old log-probs are these) the loss is minus the mean folded advantage over the
    # three trained tokens, and its gradient -A_t / 3 on each
    assert float(out.loss.detach()) == pytest.approx(-(0.75 + 1.0 + 1.9) / 3)
    out.loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([-0.75 / 3, -1.0 / 3, -1.9 / 3, 0.0])
    sums = metric_sums(trainer_logp_T=rollout, rollout_logp_T=rollout, loss_mask_T=mask, teacher_logp_T=teacher)
    assert RLMetrics.from_sums(sums).teacher_kl == pytest.approx((0.5 + 0.0 - 1.8) / 3)
    assert RLMetrics.from_sums(metric_sums(trainer_logp_T=rollout, rollout_logp_T=rollout,
                                           loss_mask_T=mask)).teacher_kl == 0.0
    with pytest.raises(ValueError, match="distill_coef > 0 needs teacher_logp_T"):
        policy_loss(logp, torch.ones(4), mask, None, config, rollout_logp_T=rollout)
    with pytest.raises(ValueError, match="distill_coef must be >= 0"):
        PolicyLossConfig(distill_coef=-1.0)


def test_the_plain_reverse_kl_loss_by_hand() -> None:
    rollout, teacher = torch.tensor(ROLLOUT), torch.tensor(TEACHER)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    config = PolicyLossConfig(distill_coef=0.5, distill_mode="kl", tis_cap=None)
    logp = rollout.clone().requires_grad_()
    # zero advantages: the loss is 0.5 x mean over the trained tokens of (logp - teacher)^2 / 2
    out = policy_loss(logp, torch.zeros(4), mask, None, config, teacher_logp_T=teacher)
    assert float(out.loss.detach()) == pytest.approx(0.5 * (0.5**2 + 0.0 + 1.8**2) / 2 / 3)
    out.loss.backward()
    # the reverse KL's on-policy gradient: coef x (logp - teacher) / 3 on each trained token
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([0.5 * 0.5 / 3, 0.0, 0.5 * -1.8 / 3, 0.0])
    # the advantage is left alone (no rollout log-probs needed): with advantage 1 the policy term adds -1
    both = policy_loss(rollout.clone().requires_grad_(), torch.ones(4), mask, None, config, teacher_logp_T=teacher)
    assert float(both.loss.detach()) == pytest.approx(float(out.loss.detach()) - 1.0)
    assert float(both.pg_loss) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="distill_mode must be one of"):
        PolicyLossConfig(distill_mode="forward")  # type: ignore[arg-type]


def test_teacher_logprobs_pack_like_the_rollouts() -> None:
    scored = TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0.0] + ROLLOUT[:3],
                             teacher_logprobs=[0.0] + TEACHER[:3])
    packed = pack([scored, scored], [0.0, 0.0])
    assert packed.teacher_logprobs_T is not None
    assert packed.teacher_logprobs_T.tolist() == pytest.approx([*TEACHER[:3], 0.0] * 2)
    with pytest.raises(ValueError, match="1 of 2 samples carry teacher_logprobs; distillation needs all or none"):
        pack([scored, TokenData.build(tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])], [0.0, 0.0])
    with pytest.raises(ValueError, match="teacher_logprobs has 2 entries for 4 tokens"):
        TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0.0] * 4, teacher_logprobs=[0.0, 1.0])


def test_a_trainer_step_with_task_reward_zero_learns_from_the_teacher_alone(tmp_path: Path) -> None:
    folder = init_model("qwen3", "tiny", tmp_path / "tiny")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 250, (6,), generator=gen).tolist()
    samples = []
    for i in range(4):  # one group, every reward 0: GRPO's advantages are all zero
        answer = torch.randint(1, 250, (4,), generator=gen).tolist()
        rollout = [0.0] * 6 + torch.empty(4).uniform_(-3, -0.5, generator=gen).tolist()
        teacher = [0.0] * 6 + torch.empty(4).uniform_(-3, -0.5, generator=gen).tolist()
        samples.append(Trajectory(prompt_id=0, reward=0.0, num_tokens=10, num_prompt_tokens=6, num_generated_tokens=4,
                                  data=TokenData.build(tokens=prompt + answer, loss_mask=[0] * 6 + [1] * 4,
                                                       logprobs=rollout, teacher_logprobs=teacher)))
    model = load_pretrained(folder)
    expected_kl = 0.0  # the student's log-probs now (the trainer's), minus the teacher's, over the 16 answer tokens
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor(s.data.token_ids().astype("int64"))
            logp_TV = torch.log_softmax(model(tokens[None], torch.arange(10)[None])[0].float(), dim=-1)
            student = logp_TV[5:9].gather(1, tokens[6:, None]).squeeze(1)
            expected_kl += float((student - torch.tensor(s.data.teacher_logprob_array()[6:])).sum()) / 16

    def step(distill_coef: float):
        config = TrainerConfig(model_dir=str(folder), lr=1e-3, policy_loss=PolicyLossConfig(distill_coef=distill_coef))
        trainer = Trainer(config, torch.device("cpu"))
        plan = plan_step(samples, 1, config.micro_batch_tokens, "token", config.advantage)
        assert plan.advantages == [0.0] * 4
        return trainer.train_step(samples, plan.advantages, num_micro_batches=plan.num_micro_batches,
                                  denominator=plan.denominator)

    with single_process_group("gloo", timeout_s=30):
        plain, distilled = step(0.0), step(1.0)
        assert plain.grad_norm == 0.0 and distilled.grad_norm > 0.0  # the teacher's signal is the only one
        assert distilled.teacher_kl == pytest.approx(expected_kl, rel=1e-5) and plain.teacher_kl == distilled.teacher_kl
        bare = [Trajectory(prompt_id=0, num_tokens=2, num_prompt_tokens=1, num_generated_tokens=1,
                           data=TokenData.build(tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0]))] * 2
        trainer = Trainer(TrainerConfig(model_dir=str(folder), policy_loss=PolicyLossConfig(distill_coef=1.0)),
                          torch.device("cpu"))
        with pytest.raises(ValueError, match="carry no teacher_logprobs"):
            trainer.train_step(bare, [0.0, 0.0], num_micro_batches=1, denominator=2.0)
