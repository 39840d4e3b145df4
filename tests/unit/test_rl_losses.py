"""RL losses (miles_async.rl.losses): PPO clip and dual clip, TIS, KL estimators, aggregation modes
and micro-batch equivalence, entropy bonus, SFT; and the chain from a tiny CausalLM's hidden states
through the chunked kernel into the loss.

Tensor names: T tokens, B sequences, V vocab, D hidden.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
import torch.nn.functional as F

from miles_async.kernels.logprobs import token_logprobs_from_hidden, token_logprobs_from_logits
from miles_async.models import CausalLM, DenseCausalAttention, ModelConfig
from miles_async.rl import (
    PolicyLossConfig,
    aggregate,
    aggregation_denominator,
    kl_estimate,
    policy_loss,
    ppo_clip_loss,
    sft_loss,
    tis_weights,
)

# ratio r and advantage A per token, and what PPO (eps 0.2, dual clip c = 3) makes of them
RATIOS = [0.5, 1.0, 1.5, 0.5, 1.5, 5.0]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
EXPECTED_LOSS = [-0.5, -1.0, -1.2, 0.8, 1.5, 3.0]
EXPECTED_CLIPPED = [False, False, True, True, False, False]
EXPECTED_DUAL = [False, False, False, False, False, True]


def _ppo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old_logp_T = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0, -2.5], dtype=torch.float64)
    logp_T = (old_logp_T + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_()
    return logp_T, old_logp_T, torch.tensor(ADVANTAGES, dtype=torch.float64)


def test_ppo_clip_and_dual_clip_by_hand() -> None:
    logp_T, old_logp_T, adv_T = _ppo_inputs()
    loss_T, clipped_T, dual_T = ppo_clip_loss(logp_T, old_logp_T, adv_T, eps_clip_low=0.2, eps_clip_high=0.2,
                                              dual_clip_c=3.0)
    torch.testing.assert_close(loss_T, torch.tensor(EXPECTED_LOSS, dtype=torch.float64))
    assert clipped_T.tolist() == EXPECTED_CLIPPED and dual_T.tolist() == EXPECTED_DUAL
    (grad_T,) = torch.autograd.grad(loss_T.sum(), logp_T)
    # d(-A r)/d logp = -A r where the unclipped term is used; clipped tokens get no gradient.
    expected_grad = [0.0 if c or d else -a * r for r, a, c, d in zip(RATIOS, ADVANTAGES, EXPECTED_CLIPPED,
                                                                     EXPECTED_DUAL)]
    torch.testing.assert_close(grad_T, torch.tensor(expected_grad, dtype=torch.float64))
    # Without dual clip the r = 5, A = -1 token's loss is unbounded: 5.
    loss_T, _, dual_T = ppo_clip_loss(logp_T, old_logp_T, adv_T, eps_clip_low=0.2, eps_clip_high=0.2,
                                      dual_clip_c=None)
    assert loss_T[5].item() == pytest.approx(5.0) and not dual_T.any()


def test_clip_higher_uses_its_own_upper_bound() -> None:
    old_logp_T = torch.zeros(2)
    logp_T = torch.tensor([math.log(1.25), math.log(0.75)])
    adv_T = torch.tensor([1.0, -1.0])
    _, clipped_T, _ = ppo_clip_loss(logp_T, old_logp_T, adv_T, eps_clip_low=0.2, eps_clip_high=0.28,
                                    dual_clip_c=None)
    assert clipped_T.tolist() == [False, True]  # 1.25 < 1.28 passes; 0.75 < 0.8 is clipped
    _, clipped_T, _ = ppo_clip_loss(logp_T, old_logp_T, adv_T, eps_clip_low=0.2, eps_clip_high=0.2,
                                    dual_clip_c=None)
    assert clipped_T.tolist() == [True, True]


def test_tis_weights_truncate_at_the_cap_and_carry_no_gradient() -> None:
    rollout_logp_T = torch.tensor([-1.0, -1.0, -1.0])
    old_logp_T = (rollout_logp_T + torch.tensor([0.5, 1.0, 3.0]).log()).requires_grad_()
    weight_T, truncated_T = tis_weights(old_logp_T, rollout_logp_T, cap=2.0)
    torch.testing.assert_close(weight_T, torch.tensor([0.5, 1.0, 2.0]))
    assert truncated_T.tolist() == [False, False, True]
    assert not weight_T.requires_grad


def test_policy_loss_applies_tis_per_token_and_reports_flags_on_trained_tokens_only() -> None:
    logp_T, old_logp_T, adv_T = _ppo_inputs()
    tis_ratio = torch.tensor([1.0, 3.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)
    rollout_logp_T = old_logp_T - tis_ratio.log()
    mask_T = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # token 3 is not trained
    out = policy_loss(logp_T, adv_T, mask_T, None, PolicyLossConfig(tis_cap=2.0), old_logp_T=old_logp_T,
                      rollout_logp_T=rollout_logp_T)
    weights = [1.0, 2.0, 0.5, 1.0, 1.0, 1.0]
    expected = sum(w * v * m for w, v, m in zip(weights, EXPECTED_LOSS, mask_T.tolist())) / 5
    assert out.loss.item() == pytest.approx(expected)
    assert out.pg_loss.item() == pytest.approx(expected) and not out.pg_loss.requires_grad
    assert out.clipped_T.tolist() == [False, False, True, False, False, False]  # token 3 is masked
    assert out.dual_clipped_T.tolist() == EXPECTED_DUAL
    assert out.tis_truncated_T.tolist() == [False, True, False, False, False, False]
    out.loss.backward()
    assert logp_T.grad is not None and logp_T.grad[3] == 0.0


def test_mis_drops_tokens_whose_ratio_leaves_the_band_and_tis_weights_the_rest() -> None:
    logp_T, old_logp_T, adv_T = _ppo_inputs()
    # importance ratios exp(old - rollout): 3.0 and 0.25 fall outside the band [0.5, 2.0]; 0.6 and
    # 1.9 stay
    tis_ratio = torch.tensor([1.0, 3.0, 0.6, 0.25, 1.9, 1.5], dtype=torch.float64)
    rollout_logp_T = old_logp_T - tis_ratio.log()
    mask_T = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # token 5 is not trained
    for tis_cap, weights in ((None, [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), (1.5, [1.0, 0.0, 0.6, 0.0, 1.5, 1.5])):
        logp_T.grad = None
        out = policy_loss(logp_T, adv_T, mask_T, None, PolicyLossConfig(tis_cap=tis_cap, mis_band=(0.5, 2.0)),
                          old_logp_T=old_logp_T, rollout_logp_T=rollout_logp_T)
        # the denominator still counts the dropped tokens (5 trained tokens)
        expected = sum(w * v * m for w, v, m in zip(weights, EXPECTED_LOSS, mask_T.tolist())) / 5
        assert out.loss.item() == pytest.approx(expected)
        assert out.mis_masked_T is not None
        assert out.mis_masked_T.tolist() == [False, True, False, True, False, False]  # token 5 is masked
        # a dropped token is never also reported as TIS-capped
        assert out.tis_truncated_T.tolist() == [False, False, False, False, tis_cap is not None, False]
        out.loss.backward()
        assert logp_T.grad is not None and logp_T.grad[1] == 0.0 and logp_T.grad[3] == 0.0
        assert logp_T.grad[0] != 0.0
    with pytest.raises(ValueError, match="mis_band is set but no rollout_logp_T"):
        policy_loss(logp_T, adv_T, mask_T, None, PolicyLossConfig(tis_cap=None, mis_band=(0.5, 2.0)))


def test_without_old_logprobs_the_ratio_is_one_and_the_gradient_is_reinforce() -> None:
    logp_T = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv_T = torch.tensor([1.0, -2.0, 0.5])
    out = policy_loss(logp_T, adv_T, torch.ones(3), None, PolicyLossConfig(tis_cap=None))
    out.loss.backward()
    torch.testing.assert_close(logp_T.grad, -adv_T / 3)
    assert not out.clipped_T.any()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_estimates_of_kl(estimator: str) -> None:
    # Exact expectation over the policy's distribution (no sampling noise): E_p[k] = KL(p || q).
    gen = torch.Generator().manual_seed(0)
    logp_V = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), -1)
    ref_logp_V = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), -1)
    true_kl = (logp_V.exp() * (logp_V - ref_logp_V)).sum()
    expectation = (logp_V.exp() * kl_estimate(logp_V, ref_logp_V, estimator)).sum()  # type: ignore[arg-type]
    torch.testing.assert_close(expectation, true_kl)


def test_kl_estimators_by_formula() -> None:
    logp_T, ref_logp_T = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    log_r_T = ref_logp_T - logp_T
    torch.testing.assert_close(kl_estimate(logp_T, ref_logp_T, "k1"), -log_r_T)
    torch.testing.assert_close(kl_estimate(logp_T, ref_logp_T, "k2"), 0.5 * log_r_T**2)
    torch.testing.assert_close(kl_estimate(logp_T, ref_logp_T, "k3"), log_r_T.exp() - 1 - log_r_T)
    assert (kl_estimate(logp_T, ref_logp_T, "k3") >= 0).all()
    assert kl_estimate(logp_T, logp_T, "k3").abs().max() == 0.0
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp_T, ref_logp_T, "k4")  # type: ignore[arg-type]


# Two packed sequences: 1 trained token of value 1, then 3 of value 2; masked values are junk.
VALUES_T = torch.tensor([100.0, 1.0, 100.0, 2.0, 2.0, 2.0])
MASK_T = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
SEQ_IDS_T = torch.tensor([0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("mode,expected,denominator", [
    ("token", (1 + 6) / 4, 4), ("sequence", (1 + 2) / 2, 2), ("seq-mean-token-sum", (1 + 6) / 2, 2),
])
def test_aggregation_modes_by_hand(mode: str, expected: float, denominator: int) -> None:
    assert aggregate(VALUES_T, MASK_T, SEQ_IDS_T, mode).item() == pytest.approx(expected)  # type: ignore[arg-type]
    assert aggregation_denominator(mode, MASK_T, SEQ_IDS_T) == denominator  # type: ignore[arg-type]
    # The same batch padded to [B, T] rows reads one sequence per row without seq_ids.
    padded_values = torch.tensor([[100.0, 1.0, 0.0, 0.0], [100.0, 2.0, 2.0, 2.0]])
    padded_mask = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    assert aggregate(padded_values, padded_mask, None, mode).item() == pytest.approx(expected)  # type: ignore[arg-type]


def test_sequences_without_trained_tokens_do_not_count_and_an_empty_batch_gives_zero() -> None:
    seq_ids_T = torch.tensor([0, 0, 1, 1, 1, 1, 2])  # sequence 2 has no trained token
    values_T, mask_T = torch.cat([VALUES_T, torch.tensor([7.0])]), torch.cat([MASK_T, torch.tensor([0.0])])
    assert aggregate(values_T, mask_T, seq_ids_T, "sequence").item() == pytest.approx(1.5)
    values_T = torch.ones(3, requires_grad=True)
    empty = aggregate(values_T, torch.zeros(3), torch.zeros(3, dtype=torch.int64), "sequence")
    assert empty.item() == 0.0
    empty.backward()
    assert torch.equal(values_T.grad, torch.zeros(3))


@pytest.mark.parametrize("mode", ["token", "sequence", "seq-mean-token-sum"])
def test_micro_batches_with_the_step_denominator_give_the_full_batch_gradient(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    seq_ids_T = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    logp_T = (-torch.rand(14, generator=gen, dtype=torch.float64)).requires_grad_()
    old_T = logp_T.detach() + 0.3 * torch.randn(14, generator=gen, dtype=torch.float64)
    rollout_T = old_T + 0.3 * torch.randn(14, generator=gen, dtype=torch.float64)
    ref_T = old_T + 0.1 * torch.randn(14, generator=gen, dtype=torch.float64)
    entropy_T = torch.rand(14, generator=gen, dtype=torch.float64, requires_grad=True)
    adv_T = torch.randn(4, generator=gen, dtype=torch.float64)[seq_ids_T]
    mask_T = (torch.rand(14, generator=gen) > 0.3).double()
    config = PolicyLossConfig(aggregation=mode, kl_coef=0.1, entropy_coef=0.01)  # type: ignore[arg-type]

    def loss(rows: slice, denominator: float | None) -> torch.Tensor:
        return policy_loss(logp_T[rows], adv_T[rows], mask_T[rows], seq_ids_T[rows], config,
                           old_logp_T=old_T[rows], rollout_logp_T=rollout_T[rows], ref_logp_T=ref_T[rows],
                           entropy_T=entropy_T[rows], denominator=denominator).loss

    full = loss(slice(0, 14), None)
    full_grads = torch.autograd.grad(full, (logp_T, entropy_T))
    halves = [slice(0, 8), slice(8, 14)]  # sequences 0-1 and 2-3: no sequence is split
    step_denominator = sum(aggregation_denominator(mode, mask_T[r], seq_ids_T[r]) for r in halves)  # type: ignore[arg-type]
    summed = sum(loss(r, step_denominator) for r in halves)
    summed_grads = torch.autograd.grad(summed, (logp_T, entropy_T))
    torch.testing.assert_close(summed, full)
    for got, want in zip(summed_grads, full_grads):
        torch.testing.assert_close(got, want)


def test_kl_and_entropy_terms_enter_the_loss_with_their_coefficients() -> None:
    logp_T = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref_T, entropy_T, adv_T = torch.tensor([-1.5, -1.0]), torch.tensor([2.0, 4.0], requires_grad=True), torch.zeros(2)
    out = policy_loss(logp_T, adv_T, torch.ones(2), None,
                      PolicyLossConfig(tis_cap=None, kl_coef=0.5, kl_estimator="k2", entropy_coef=0.1),
                      ref_logp_T=ref_T, entropy_T=entropy_T)
    kl = (0.5 * (ref_T - logp_T.detach()) ** 2).mean()
    assert out.kl.item() == pytest.approx(kl.item()) and out.entropy.item() == pytest.approx(3.0)
    assert out.loss.item() == pytest.approx(0.5 * kl.item() - 0.1 * 3.0)
    out.loss.backward()
    torch.testing.assert_close(entropy_T.grad, torch.tensor([-0.05, -0.05]))
    # Entropy given but not trained on: reported, no gradient path.
    out = policy_loss(logp_T, adv_T, torch.ones(2), None, PolicyLossConfig(tis_cap=None), entropy_T=entropy_T)
    assert out.entropy.item() == pytest.approx(3.0)
    assert torch.autograd.grad(out.loss, entropy_T, allow_unused=True) == (None,)


def test_sft_loss_is_cross_entropy_on_the_masked_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits_TV = torch.randn(12, 50, generator=gen, requires_grad=True)
    targets_T = torch.randint(0, 50, (12,), generator=gen)
    mask_T = (torch.arange(12) % 3 != 0).float()
    logp_T, _ = token_logprobs_from_logits(logits_TV, targets_T, chunk_tokens=5)
    loss = sft_loss(logp_T, mask_T)
    keep = mask_T.bool()
    expected = F.cross_entropy(logits_TV[keep], targets_T[keep])
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits_TV)
    (expected_grad,) = torch.autograd.grad(expected, logits_TV)
    torch.testing.assert_close(grad, expected_grad)


def test_missing_inputs_and_bad_shapes_are_named() -> None:
    logp_T = torch.zeros(3)
    with pytest.raises(ValueError, match="rollout_logp_T"):
        policy_loss(logp_T, torch.zeros(3), torch.ones(3), None, PolicyLossConfig())
    with pytest.raises(ValueError, match="ref_logp_T"):
        policy_loss(logp_T, torch.zeros(3), torch.ones(3), None, PolicyLossConfig(tis_cap=None, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_T"):
        policy_loss(logp_T, torch.zeros(3), torch.ones(3), None, PolicyLossConfig(tis_cap=None, entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages_T has shape"):
        policy_loss(logp_T, torch.zeros(4), torch.ones(3), None, PolicyLossConfig(tis_cap=None))
    with pytest.raises(ValueError, match="needs seq_ids"):
        aggregate(logp_T, torch.ones(3), None, "sequence")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(logp_T, torch.ones(3), None, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="denominator must be > 0"):
        aggregate(logp_T, torch.ones(3), None, "token", denominator=0)


@pytest.mark.parametrize("fields,match", [
    ({"eps_clip_low": 1.0}, "eps_clip_low"), ({"eps_clip_high": -0.1}, "eps_clip_high"),
    ({"dual_clip_c": 1.0}, "dual_clip_c"), ({"tis_cap": 0.0}, "tis_cap"), ({"kl_coef": -1.0}, "kl_coef"),
    ({"kl_estimator": "k4"}, "kl_estimator"), ({"aggregation": "mean"}, "aggregation"),
    ({"mis_band": (1.0, 2.0)}, "mis_band"), ({"mis_band": (0.5, 0.9)}, "mis_band"),
    ({"mis_band": (-0.5, 2.0)}, "mis_band"),
])
def test_policy_loss_config_is_validated(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**fields)


def test_policy_loss_config_decodes_from_recipe_data() -> None:
    config = msgspec.convert({"eps_clip_high": 0.28, "dual_clip_c": None, "aggregation": "sequence"},
                             PolicyLossConfig)
    assert config.eps_clip_high == 0.28 and config.dual_clip_c is None and config.tis_cap == 2.0
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kl_estimator": "k4"}, PolicyLossConfig)


def test_from_tiny_model_hidden_states_to_the_loss_matches_the_unchunked_path() -> None:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf({
        "model_type": "qwen3", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "tie_word_embeddings": True,
    })).double()
    input_ids_1T = torch.randint(0, 300, (1, 10))
    positions_1T = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])  # two packed samples
    seq_ids_T = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    targets_T = torch.cat([input_ids_1T[0, 1:], torch.zeros(1, dtype=torch.int64)])
    mask_T = torch.tensor([0.0, 1, 1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.float64)
    adv_T = torch.tensor([0.0, 1, 1, 0, 0, -1, -1, -1, -1, 0], dtype=torch.float64)
    config = PolicyLossConfig(tis_cap=None, entropy_coef=0.01, aggregation="sequence")

    def grads(chunked: bool) -> list[torch.Tensor]:
        model.zero_grad()
        if chunked:
            h_1TD, _ = model.model(input_ids_1T, positions_1T, DenseCausalAttention(), None)
            logp_T, ent_T = token_logprobs_from_hidden(h_1TD[0], model.lm_head.weight, targets_T, chunk_tokens=3)
        else:
            logp_T, ent_T = token_logprobs_from_logits(model(input_ids_1T, positions_1T)[0], targets_T,
                                                       chunk_tokens=10**6)
        policy_loss(logp_T, adv_T, mask_T, seq_ids_T, config, entropy_T=ent_T).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(grads(chunked=True), grads(chunked=False)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
