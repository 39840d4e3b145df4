"""The loop benchmark's peer, TRL's GRPOTrainer, runs on our tiny model and task (tiny sizes; no speed asserted)."""

from __future__ import annotations

import pytest

from miles_async.bench.loop_peers import exact_match_rewards, trl_grpo


def test_exact_match_rewards_score_like_the_reverse_task():
    completions = ["kqjf", " kqjf\n", "kqjf<|im_end|>", "kqj", "kqjff", ""]
    assert exact_match_rewards(completions, ["kqjf"] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_trl_grpo_rejects_a_single_step_before_starting_a_child(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="num_steps must be >= 2"):
        trl_grpo(str(tmp_path), ["r:fjqk="], ["kqjf"], group_size=4, prompts_per_step=1, num_steps=1,
                 max_new_tokens=8, temperature=1.0, lr=1e-4, seed=0)


@pytest.mark.timeout(90)
def test_trl_grpo_trains_two_steps_on_the_tiny_model(tmp_path):
    pytest.importorskip("trl", reason="the peer is TRL's GRPOTrainer; install the dev extra (pip install -e .[dev])")
    from miles_async.models import init_model, load_tokenizer
    from miles_async.tasks.reverse import ReverseTaskConfig, prompts

    model_dir = str(init_model("qwen3", "tiny", tmp_path / "model", seed=0))
    task = prompts(ReverseTaskConfig(), 4, load_tokenizer(model_dir))
    result = trl_grpo(model_dir, [p.text for p in task], [p.answer for p in task], group_size=4,
                      prompts_per_step=2, num_steps=2, max_new_tokens=8, temperature=1.0, lr=1e-4, seed=0,
                      timeout_s=80)
    assert result["samples_per_s"] > 0
    assert result["samples_per_step"] == 8 and result["measured_steps"] == 1
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])
    assert len(result["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in result["reward_mean"])
    assert all(8 <= n <= 8 * 8 for n in result["completion_tokens"]), "8 samples of 1..8 tokens each"
    assert result["prompts_in_order"] and result["prompt_ids_match_ours"]
    config = result["config"]
    assert config["device"] == "cpu" and config["dtype"] == "torch.float32" and config["torch_threads"] == 1
    assert not config["gradient_checkpointing"]
    assert set(result["versions"]) == {"trl", "transformers", "torch"}


@pytest.mark.timeout(60)
def test_trl_grpo_raises_with_the_childs_stderr_when_it_fails(tmp_path):
    pytest.importorskip("trl", reason="the peer is TRL's GRPOTrainer; install the dev extra (pip install -e .[dev])")
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers cannot load it
    with pytest.raises(RuntimeError, match="TRL GRPO child failed") as failure:
        trl_grpo(str(tmp_path), ["r:fjqk="], ["kqjf"], group_size=2, prompts_per_step=1, num_steps=2,
                 max_new_tokens=4, temperature=1.0, lr=1e-4, seed=0, timeout_s=50)
    assert "Traceback" in str(failure.value)
