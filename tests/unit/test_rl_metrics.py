"""Step metrics (miles_async.rl.metrics): values by hand, exact zero when trainer and rollout agree,
and sums that add across micro-batches.

Tensor names: T tokens, K metric sums.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from miles_async.rl import METRIC_SUM_NAMES, MetricSums, PolicyLossConfig, RLMetrics, metric_sums, policy_loss


def test_identical_log_probs_read_exactly_zero() -> None:
    logp_T = torch.tensor([-0.3, -1.7, -2.2, -0.01])
    metrics = RLMetrics.from_sums(metric_sums(trainer_logp_T=logp_T, rollout_logp_T=logp_T.clone(),
                                              loss_mask_T=torch.ones(4)))
    assert metrics.logprob_abs_diff == 0.0 and metrics.rollout_kl_k3 == 0.0
    assert metrics.num_trained_tokens == 4


def test_values_by_hand_over_trained_tokens_only() -> None:
    rollout_T = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    trainer_T = rollout_T + torch.tensor([0.1, -0.2, 5.0], dtype=torch.float64)  # token 2 is not trained
    mask_T = torch.tensor([1.0, 1.0, 0.0])
    entropy_T = torch.tensor([1.0, 2.0, 100.0])
    metrics = RLMetrics.from_sums(metric_sums(trainer_logp_T=trainer_T, rollout_logp_T=rollout_T,
                                              loss_mask_T=mask_T, entropy_T=entropy_T))
    assert metrics.logprob_abs_diff == pytest.approx(0.15)
    k3 = [math.exp(d) - 1 - d for d in (0.1, -0.2)]
    assert metrics.rollout_kl_k3 == pytest.approx(sum(k3) / 2)
    assert metrics.entropy == pytest.approx(1.5)
    assert metrics.clip_fraction == metrics.tis_truncated_fraction == 0.0


def test_fractions_come_from_the_policy_loss_and_sums_add_across_micro_batches() -> None:
    old_T = torch.zeros(6)
    logp_T = torch.tensor([math.log(1.5), 0.0, 0.0, math.log(0.5), math.log(5.0), 0.0])
    adv_T = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    rollout_T = torch.tensor([0.0, -2.0, 0.0, 0.0, 0.0, -2.0])  # exp(2) > cap 2: truncated
    mask_T = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    halves = [slice(0, 3), slice(3, 6)]
    sums_K = torch.zeros(len(METRIC_SUM_NAMES), dtype=torch.float64)
    for rows in halves:
        out = policy_loss(logp_T[rows], adv_T[rows], mask_T[rows], None, PolicyLossConfig(tis_cap=2.0),
                          old_logp_T=old_T[rows], rollout_logp_T=rollout_T[rows])
        sums_K += metric_sums(trainer_logp_T=old_T[rows], rollout_logp_T=rollout_T[rows],
                              loss_mask_T=mask_T[rows], loss=out)
    whole = policy_loss(logp_T, adv_T, mask_T, None, PolicyLossConfig(tis_cap=2.0), old_logp_T=old_T,
                        rollout_logp_T=rollout_T)
    whole_K = metric_sums(trainer_logp_T=old_T, rollout_logp_T=rollout_T, loss_mask_T=mask_T, loss=whole)
    torch.testing.assert_close(sums_K, whole_K)
    metrics = RLMetrics.from_sums(sums_K)
    assert metrics.num_trained_tokens == 5
    assert metrics.clip_fraction == pytest.approx(2 / 5)  # r = 1.5 with A > 0, r = 0.5 with A < 0
    assert metrics.dual_clip_fraction == pytest.approx(1 / 5)  # r = 5 with A < 0
    assert metrics.tis_truncated_fraction == pytest.approx(1 / 5)  # token 5 is also capped but not trained
    assert metrics.logprob_abs_diff == pytest.approx(2 / 5)
    assert metrics.mis_masked_fraction == 0.0
    # MIS with the band [0.5, 1.5] drops token 1 (ratio e^2), not the untrained token 5
    mis = policy_loss(logp_T, adv_T, mask_T, None, PolicyLossConfig(tis_cap=None, mis_band=(0.5, 1.5)),
                      old_logp_T=old_T, rollout_logp_T=rollout_T)
    mis_K = metric_sums(trainer_logp_T=old_T, rollout_logp_T=rollout_T, loss_mask_T=mask_T, loss=mis)
    assert RLMetrics.from_sums(mis_K).mis_masked_fraction == pytest.approx(1 / 5)


def test_no_trained_tokens_gives_zeros_and_the_struct_encodes() -> None:
    metrics = RLMetrics.from_sums(metric_sums(trainer_logp_T=torch.zeros(2), rollout_logp_T=torch.ones(2),
                                              loss_mask_T=torch.zeros(2)))
    assert metrics == RLMetrics(num_trained_tokens=0, logprob_abs_diff=0.0, rollout_kl_k3=0.0, clip_fraction=0.0,
                                dual_clip_fraction=0.0, tis_truncated_fraction=0.0, entropy=0.0)
    assert msgspec.json.decode(msgspec.json.encode(metrics), type=RLMetrics) == metrics


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="rollout_logp_T has shape"):
        metric_sums(trainer_logp_T=torch.zeros(2), rollout_logp_T=torch.zeros(3), loss_mask_T=torch.ones(2))
    with pytest.raises(ValueError, match="metric sums must have shape"):
        RLMetrics.from_sums(torch.zeros(3))


def test_a_sum_vector_is_its_structs_fields_in_order() -> None:
    """The step's vector order is defined once, by the Struct: stack and of round-trip by field
    name, a subclass appends its fields after the rl sums, and a name that is no field is refused."""
    from miles_async.trainer.loss import StepSums

    assert METRIC_SUM_NAMES == MetricSums.names() and StepSums.names()[:len(METRIC_SUM_NAMES)] == METRIC_SUM_NAMES
    sums_K = StepSums.stack(entropy=torch.tensor(2.5), loss=0.25, num_samples=4)
    assert sums_K.dtype == torch.float64 and not sums_K.requires_grad
    sums = StepSums.of(sums_K + sums_K)
    assert (sums.entropy, sums.loss, sums.num_samples, sums.kl) == (5.0, 0.5, 8.0, 0.0)
    assert RLMetrics.of(MetricSums(num_trained_tokens=2, entropy=3.0)).entropy == 1.5
    with pytest.raises(ValueError, match="not sums of StepSums"):
        StepSums.stack(entropie=1.0)
    with pytest.raises(ValueError, match="StepSums sums must have shape"):
        StepSums.of(torch.zeros(len(METRIC_SUM_NAMES)))
