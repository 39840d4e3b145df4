"""GRPO and REINFORCE advantages (miles_async.rl.advantages) against hand-computed values.

Tensor names: G groups, S samples per group, B sequences, T tokens.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from miles_async.rl import (
    AdvantageConfig,
    advantages_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
)


def test_grpo_centres_and_normalises_each_group_on_its_own() -> None:
    rewards_GS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    adv_GS = grpo_advantages(rewards_GS)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(adv_GS[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv_GS[1], torch.zeros(4))  # all equal: 0, not 0/0
    torch.testing.assert_close(adv_GS[2].sum(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv_GS[2].std(), torch.tensor(1.0), atol=1e-5, rtol=0)
    centred_GS = grpo_advantages(rewards_GS, normalize_std=False)
    torch.testing.assert_close(centred_GS[2], torch.tensor([2.25, -0.75, -0.75, -0.75]))


def test_reinforce_leave_one_out_baseline_is_the_mean_of_the_others() -> None:
    rewards_GS = torch.tensor([[1.0, 0.0, 0.0], [4.0, 2.0, 0.0]])
    adv_GS = reinforce_advantages(rewards_GS)
    torch.testing.assert_close(adv_GS, torch.tensor([[1.0, -0.5, -0.5], [3.0, 0.0, -3.0]]))
    # RLOO is GRPO's centring scaled by S / (S - 1).
    torch.testing.assert_close(adv_GS, 1.5 * grpo_advantages(rewards_GS, normalize_std=False))


def test_reinforce_with_a_given_baseline() -> None:
    rewards_GS = torch.tensor([[1.0, 0.0], [4.0, 2.0]])
    torch.testing.assert_close(reinforce_advantages(rewards_GS, 0.5), rewards_GS - 0.5)
    torch.testing.assert_close(reinforce_advantages(rewards_GS, torch.tensor([[1.0], [3.0]])),
                               torch.tensor([[0.0, -1.0], [1.0, -1.0]]))
    # One sample per group is fine when the baseline is given.
    torch.testing.assert_close(reinforce_advantages(torch.tensor([[2.0]]), 1.0), torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="does not broadcast"):
        reinforce_advantages(rewards_GS, torch.zeros(3))


def test_compute_advantages_follows_the_config() -> None:
    rewards_GS = torch.tensor([[1.0, 0.0, 0.0]])
    torch.testing.assert_close(compute_advantages(rewards_GS, AdvantageConfig()), grpo_advantages(rewards_GS))
    torch.testing.assert_close(compute_advantages(rewards_GS, AdvantageConfig(normalize_std=False)),
                               grpo_advantages(rewards_GS, normalize_std=False))
    torch.testing.assert_close(compute_advantages(rewards_GS, AdvantageConfig(estimator="reinforce")),
                               reinforce_advantages(rewards_GS))
    with pytest.raises(ValueError, match="estimator is 'grpo'"):
        compute_advantages(rewards_GS, AdvantageConfig(), baseline=0.0)


@pytest.mark.parametrize("rewards,match", [
    (torch.tensor([1.0, 0.0]), r"\[groups, samples per group\]"),
    (torch.tensor([[1.0], [0.0]]), "no group baseline"),
    (torch.tensor([[1.0, float("nan")]]), "NaN"),
])
def test_bad_rewards_are_refused(rewards: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards)


def test_advantages_reach_only_the_trained_tokens_of_their_sequence() -> None:
    adv_B = torch.tensor([1.5, -2.0])
    seq_ids_T = torch.tensor([0, 0, 0, 1, 1])  # packed: a 3-token and a 2-token sequence
    mask_T = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(advantages_to_tokens(adv_B, seq_ids_T, mask_T),
                               torch.tensor([0.0, 1.5, 1.5, 0.0, -2.0]))
    with pytest.raises(ValueError, match=r"seq_ids must lie in \[0, 2\)"):
        advantages_to_tokens(adv_B, torch.tensor([0, 0, 2, 1, 1]), mask_T)
    with pytest.raises(ValueError, match="one per sequence"):
        advantages_to_tokens(adv_B[None], seq_ids_T, mask_T)


def test_config_is_validated_and_decodes_from_recipe_data() -> None:
    config = msgspec.convert({"estimator": "reinforce", "normalize_std": False}, AdvantageConfig)
    assert config == AdvantageConfig(estimator="reinforce", normalize_std=False)
    with pytest.raises(ValueError, match="estimator must be one of"):
        AdvantageConfig(estimator="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="std_eps"):
        AdvantageConfig(std_eps=0.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"estimator": "ppo"}, AdvantageConfig)
