"""Planning a step, packing without padding, rank assignment and micro-batches by a token budget."""

from __future__ import annotations

import msgspec
import pytest
import torch

from miles_async.models import CausalLM, ModelConfig
from miles_async.rl import AdvantageConfig, PolicyLossConfig
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.loss import StepSums, attach_logprobs, micro_batch_loss
from miles_async.trainer.packing import (
    assign_to_ranks,
    group_advantages,
    micro_batches,
    pack,
    plan_step,
    split_micro_batches,
    step_denominator,
    trained_tokens,
)
from miles_async.trajectory import TokenData, Trajectory


def sample(tokens: list[int], mask: list[int]) -> TokenData:
    return TokenData.build(tokens=tokens, loss_mask=mask, logprobs=[-float(t) for t in tokens])


def meta(tokens: list[int], mask: list[int], *, prompt_id: int = 0, reward: float = 0.0) -> Trajectory:
    """A sample's metadata as a planner sees it (its arrays inline)."""
    generated = sum(mask)
    return Trajectory(prompt_id=prompt_id, num_tokens=len(tokens), num_prompt_tokens=mask.index(1) if generated else
                      len(tokens), num_generated_tokens=generated, reward=reward, data=sample(tokens, mask))


def test_pack_restarts_positions_and_shifts_targets_within_each_sample() -> None:
    packed = pack([sample([5, 6, 7], [0, 1, 1]), sample([8, 9], [0, 1])], [2.0, -1.0])
    assert packed.input_ids_1R.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.positions_1R.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.targets_T.tolist() == [6, 7, 0, 9, 0]  # never a target across samples
    assert packed.loss_mask_T.tolist() == [1, 1, 0, 1, 0]
    assert packed.rollout_logprobs_T.tolist() == [-6, -7, 0, -9, 0]
    assert packed.advantages_T.tolist() == [2, 2, 2, -1, -1]
    assert (packed.num_samples, packed.num_tokens) == (2, 5)


def test_first_token_is_never_trained_and_empty_pack_is_a_dummy_row() -> None:
    assert trained_tokens(meta([1, 2, 3], [1, 1, 0])) == 1
    assert trained_tokens(meta([1, 2, 3], [0, 1, 1])) == 2
    assert pack([sample([1, 2, 3], [1, 1, 0])], [1.0]).loss_mask_T.tolist() == [1, 0, 0]
    empty = pack([], [])
    assert empty.num_tokens == 1 and empty.num_samples == 0 and empty.loss_mask_T.sum() == 0


def test_mismatched_lengths_name_the_field() -> None:
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 tokens"):
        TokenData.build(tokens=[1, 2, 3], loss_mask=[0, 1], logprobs=[0, 0, 0])
    with pytest.raises(ValueError, match="at least one token"):
        TokenData.build(tokens=[], loss_mask=[], logprobs=[])
    with pytest.raises(ValueError, match="2 advantages for 1 samples"):
        pack([sample([1, 2], [0, 1])], [1.0, 2.0])


def test_packed_forward_equals_separate_forwards() -> None:
    config = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    a, b = sample([3, 4, 5, 6], [0, 1, 1, 1]), sample([7, 8, 9], [0, 1, 1])
    packed = pack([a, b], [1.0, 1.0])
    with torch.no_grad():
        logits = model(packed.input_ids_1R, packed.positions_1R)[0]
        alone = torch.cat([model(torch.tensor([s.token_ids().tolist()]))[0] for s in (a, b)])
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def test_split_micro_batches_by_token_budget() -> None:
    assert split_micro_batches([4, 4, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]  # 9 > 8 goes alone
    assert split_micro_batches([], 8) == []
    with pytest.raises(ValueError, match="max_tokens"):
        split_micro_batches([1], 0)


def test_assign_to_ranks_balances_tokens_deterministically() -> None:
    assert assign_to_ranks([10, 1, 9, 2], 2) == [[0, 1], [2, 3]]
    assert assign_to_ranks([5, 5, 5], 1) == [[0, 1, 2]]
    assert assign_to_ranks([3], 2) == [[0], []]


def test_every_rank_gets_only_its_share_and_runs_the_same_number_of_micro_batches() -> None:
    samples = [meta(list(range(n)), [0] + [1] * (n - 1), prompt_id=i // 2, reward=float(i % 2))
               for i, n in enumerate((9, 2, 2, 2, 2, 3))]
    plan = plan_step(samples, 2, max_tokens=4, aggregation="token", advantage=AdvantageConfig())
    assert sorted(i for share in plan.per_rank for i in share) == list(range(6))  # each sample on one rank
    shares = [[samples[i] for i in share] for share in plan.per_rank]
    plans = [micro_batches(share, 4, plan.num_micro_batches) for share in shares]
    assert len(plans[0]) == len(plans[1]) == plan.num_micro_batches
    assert sorted(shares[r][i].num_tokens for r in range(2) for group in plans[r] for i in group) == [2, 2, 2, 2, 3, 9]
    assert [] in plans[0] or [] in plans[1]  # the lighter rank runs empty (dummy) micro-batches
    assert plan.denominator == sum(n - 1 for n in (9, 2, 2, 2, 2, 3))
    assert plan.advantages == pytest.approx([-0.7071, 0.7071] * 3, abs=1e-4)  # per group of one prompt
    with pytest.raises(ValueError, match="needs 4 micro-batches but the plan says 1"):
        micro_batches(shares[0] + shares[1], 4, 1)
    with pytest.raises(ValueError, match="at least one sample"):
        plan_step([], 2, max_tokens=4, aggregation="token", advantage=None)


def test_group_advantages_are_relative_within_each_prompt() -> None:
    samples = [meta([1, 2], [0, 1], prompt_id=p, reward=r) for p, r in ((0, 1.0), (0, 0.0), (1, 0.5), (1, 0.5))]
    grpo = AdvantageConfig(normalize_std=False)
    assert group_advantages(samples, grpo) == [0.5, -0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="same number of samples"):
        group_advantages(samples[:3], grpo)
    assert plan_step(samples, 1, 8, "token", None).advantages == [0.0] * 4  # SFT: none


def test_an_unscored_sample_leaves_its_groups_baseline_and_gets_no_advantage() -> None:
    import msgspec

    rewards = ((0, 1.0), (0, 0.0), (0, 0.0), (1, 1.0), (1, 0.0), (1, 0.0))
    samples = [meta([1, 2], [0, 1], prompt_id=p, reward=r) for p, r in rewards]
    # the last of prompt 0 is unscored (its 0.0 means nothing); prompt 1 has one scored sample only
    samples[2] = msgspec.structs.replace(samples[2], scored=False)
    samples[4] = msgspec.structs.replace(samples[4], scored=False)
    samples[5] = msgspec.structs.replace(samples[5], scored=False)
    grpo = AdvantageConfig(normalize_std=False)
    # prompt 0's baseline is the mean of its two scored rewards, 0.5; prompt 1 has no baseline
    assert group_advantages(samples, grpo) == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]


def tiny_model() -> CausalLM:
    config = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True)
    torch.manual_seed(0)
    return CausalLM(config)


def reference_logprobs(model: CausalLM, samples: list[TokenData]) -> list[torch.Tensor]:
    """log p(token i | tokens < i) for i >= 1, one sample at a time, full float32 log_softmax."""
    out = []
    for s in samples:
        tokens = s.token_ids().tolist()
        logits_TV = model(torch.tensor([tokens]))[0, :-1].float()
        out.append(torch.log_softmax(logits_TV, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0])
    return out


def test_micro_batch_loss_matches_unpacked_sft_and_rl_losses() -> None:
    model = tiny_model()
    samples = [TokenData.build(tokens=[3, 4, 5, 6, 7], loss_mask=[0, 0, 1, 1, 1], logprobs=[0.0] + [-4.0] * 4),
               TokenData.build(tokens=[8, 9, 10], loss_mask=[0, 1, 1], logprobs=[0.0, -3.0, -5.0])]
    advantages = [1.5, -0.5]
    metas = [Trajectory(num_tokens=5, num_prompt_tokens=2, num_generated_tokens=3),
             Trajectory(num_tokens=3, num_prompt_tokens=1, num_generated_tokens=2)]
    batch = pack(samples, advantages)
    with torch.no_grad():
        ref = reference_logprobs(model, samples)
    masks = [torch.tensor(s.mask()[1:], dtype=torch.float32) for s in samples]
    for aggregation in ("token", "sequence"):
        sft_cfg = TrainerConfig(model_dir="m", objective="sft", logprob_chunk_tokens=3,
                                policy_loss=PolicyLossConfig(aggregation=aggregation))
        attach_logprobs(model, sft_cfg)
        denominator = step_denominator(aggregation, metas)
        assert denominator == (5 if aggregation == "token" else 2)
        out = micro_batch_loss(model, batch, sft_cfg, denominator, torch.device("cpu"))
        if aggregation == "token":
            expected = -sum((lp * m).sum() for lp, m in zip(ref, masks)) / 5
        else:
            expected = -sum((lp * m).sum() / m.sum() for lp, m in zip(ref, masks)) / 2
        torch.testing.assert_close(out.loss.detach(), expected)
        assert len(out.sums_K) == len(StepSums.names()) and StepSums.of(out.sums_K).num_trained_tokens == 5
    # RL, token mean: -A * TIS weight min(exp(logp - rollout), cap) (ratio 1 at the step's own weights)
    rl_cfg = TrainerConfig(model_dir="m", policy_loss=PolicyLossConfig(tis_cap=1.5))
    attach_logprobs(model, rl_cfg)
    out = micro_batch_loss(model, batch, rl_cfg, 5, torch.device("cpu"))
    expected = 0.0
    for s, advantage, lp, m in zip(samples, advantages, ref, masks):
        weight = torch.clamp(torch.exp(lp - torch.from_numpy(s.logprob_array()[1:].copy())), max=1.5)
        expected = expected - (advantage * weight * m).sum() / 5
    torch.testing.assert_close(out.loss.detach(), expected)
    sums = msgspec.structs.asdict(StepSums.of(out.sums_K))
    gaps = torch.cat([(lp - torch.from_numpy(s.logprob_array()[1:].copy()))[m > 0] for s, lp, m in zip(samples, ref, masks)])
    assert sums["logprob_abs_diff"] == pytest.approx(float(gaps.abs().sum()), rel=1e-5)
    assert sums["tis_truncated"] == float((gaps.exp() > 1.5).sum())
    assert sums["entropy"] > 0 and sums["loss"] == pytest.approx(float(expected), rel=1e-5)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_ref_logprobs_are_packed_like_the_rollouts() -> None:
    with_ref = TokenData.build(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, ref_logprobs=[0, -1, -2])
    assert pack([with_ref, with_ref], [0.0, 0.0]).ref_logprobs_T.tolist() == [-1, -2, 0, -1, -2, 0]
    assert pack([sample([1, 2], [0, 1])], [0.0]).ref_logprobs_T is None
    with pytest.raises(ValueError, match="ref_logprobs"):
        pack([with_ref, sample([1, 2], [0, 1])], [0.0, 0.0])
    with pytest.raises(ValueError, match="ref_logprobs has 2 entries"):
        TokenData.build(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, ref_logprobs=[0, 1])


def test_config_refuses_bad_values() -> None:
    assert TrainerConfig(model_dir="m").backend == "auto"
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainerConfig(model_dir="m", micro_batch_tokens=0)
    with pytest.raises(ValueError, match="backend"):
        TrainerConfig(model_dir="m", backend="mpi")
    with pytest.raises(ValueError, match="objective"):
        TrainerConfig(model_dir="m", objective="dpo")
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainerConfig(model_dir="m", old_logprobs="ref")
    with pytest.raises(ValueError, match="temperature"):
        TrainerConfig(model_dir="m", temperature=0.0)
    config = msgspec.toml.decode(b'model_dir = "m"\n[policy_loss]\ntis_cap = 5.0\naggregation = "sequence"\n',
                                 type=TrainerConfig)
    assert (config.policy_loss.tis_cap, config.policy_loss.aggregation) == (5.0, "sequence")


def test_packed_routed_experts_are_replayed() -> None:
    config = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    token_lists = ([3, 4, 5, 6], [7, 8, 9])
    samples, alone = [], []
    with torch.no_grad():
        for i, tokens in enumerate(token_lists):
            logits_1TV, experts_L1Tk = model(torch.tensor([tokens]), return_routed_experts=True)
            experts_TLk = experts_L1Tk[:, 0].transpose(0, 1)
            if i == 1:
                experts_TLk = experts_TLk[:-1]  # the engine never forwards a sample's last token
            samples.append(TokenData.build(tokens=list(tokens), loss_mask=[0] + [1] * (len(tokens) - 1),
                                           logprobs=[0.0] * len(tokens), routed_experts=experts_TLk.numpy()))
            alone.append(logits_1TV[0])
        assert samples[0].experts_dtype == "uint8"  # 8 experts: one byte each
        packed = pack(samples, [0.0, 0.0], moe_shape=(2, 2))
        assert packed.routed_experts_L1Tk is not None and packed.routed_experts_L1Tk.shape == (2, 1, 7, 2)
        logits = model(packed.input_ids_1R, packed.positions_1R, routed_experts=packed.routed_experts_L1Tk)[0]
    trained = packed.loss_mask_T.bool()  # the padded last token trains nothing; the rest match
    torch.testing.assert_close(logits[trained], torch.cat(alone)[trained], rtol=1e-5, atol=1e-5)
    assert pack(samples, [0.0, 0.0]).routed_experts_L1Tk is None  # a dense model ignores them
    with pytest.raises(ValueError, match="all or none"):
        pack([samples[0], sample([1, 2], [0, 1])], [0.0, 0.0], moe_shape=(2, 2))
    with pytest.raises(ValueError, match="the model has 3 MoE layers"):
        pack([samples[0]], [0.0], moe_shape=(3, 2))


def test_pack_runs_each_groups_common_prefix_once() -> None:
    a, b = sample([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), sample([1, 2, 3, 7], [0, 0, 1, 1])
    c = sample([1, 2, 3], [0, 0, 1])  # the whole sample is the common prefix: an empty branch
    lone = sample([9, 8], [0, 1])
    packed = pack([a, lone, b, c], [1.0, 2.0, 3.0, 4.0], groups=["g", "h", "g", "g"])
    # documents in order of first appearance: g's trunk [1, 2, 3] then branches [4, 5], [7], []; h alone
    assert packed.input_ids_1R.tolist() == [[1, 2, 3, 4, 5, 7, 9, 8]]
    assert packed.positions_1R.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert packed.branches_1R is not None and packed.branches_1R.tolist() == [[0, 0, 0, 1, 1, 2, 0, 0]]
    assert packed.hidden_rows_T is not None
    # the per-sample slots are those of the plain packing; each reads its token's row
    assert packed.hidden_rows_T.tolist() == [0, 1, 2, 3, 4, 6, 7, 0, 1, 2, 5, 0, 1, 2]
    plain = pack([a, lone, b, c], [1.0, 2.0, 3.0, 4.0])
    for name in ("targets_T", "loss_mask_T", "rollout_logprobs_T", "advantages_T", "sample_T"):
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name
    assert plain.branches_1R is None and plain.hidden_rows_T is None and packed.num_tokens == 8 < plain.num_tokens
    # nothing in common (or one sample per group): the plain layout
    assert pack([a, lone], [0.0, 0.0], groups=["g", "g"]).branches_1R is None
    assert pack([a, b], [0.0, 0.0], groups=["g", "h"]).branches_1R is None
    with pytest.raises(ValueError, match="1 group keys for 2 samples"):
        pack([a, b], [0.0, 0.0], groups=["g"])


@pytest.mark.parametrize("objective", ["rl", "sft"])
def test_shared_prefixes_give_the_plain_packings_loss_and_gradients(objective: str) -> None:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (6, 4)]
    samples, groups, advantages = [], [], []
    for g, prompt in enumerate(prompts):
        for s in range(3):
            answer = torch.randint(1, 64, (2 + s,), generator=gen).tolist()
            tokens = prompt + answer
            samples.append(TokenData.build(tokens=tokens, loss_mask=[0] * len(prompt) + [1] * len(answer),
                                           logprobs=[0.0] * len(prompt) + [-3.0] * len(answer)))
            groups.append(g)
            advantages.append(float(s) - 1.0)
    config = TrainerConfig(model_dir="m", objective=objective, logprob_chunk_tokens=5,
                           policy_loss=PolicyLossConfig(tis_cap=2.0, entropy_coef=0.01))
    results = []
    for share in (False, True):
        model = tiny_model()
        attach_logprobs(model, config)
        batch = pack(samples, advantages, groups=groups if share else None)
        assert (batch.branches_1R is not None) == share
        out = micro_batch_loss(model, batch, config, 21.0, torch.device("cpu"))
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared.loss, plain.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shared.sums_K, plain.sums_K, atol=1e-6, rtol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_routed_expert_replay_packs_each_sample_alone() -> None:
    experts = torch.zeros(3, 2, 2, dtype=torch.uint8).numpy()
    with_experts = [TokenData.build(tokens=[1, 2, t], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, routed_experts=experts)
                    for t in (3, 4)]
    packed = pack(with_experts, [0.0, 0.0], moe_shape=(2, 2), groups=[0, 0])
    assert packed.branches_1R is None and packed.num_tokens == 6
