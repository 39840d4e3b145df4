"""The loop benchmark's peer, TRL's GRPOTrainer, runs on our tiny model and task (tiny sizes; no speed asserted)."""

from __future__ import annotations

import pytest

from miles_async.bench.loop_peers import exact_match_rewards, trl_grpo


def test_exact_match_rewards_score_like_the_reverse_task():
    completions = ["kqjf", " kqjf\n", "kqjf<|im_end|>", "kqj", "kqjff", ""]
    assert exact_match_rewards(completions, ["kqjf"] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_exact_match_rewards_score_like_the_arithmetic_task():
    completions = ["The equation is 59 + 63 = 122.", "59+63=122", "= 121", "122", "59 + 63 = 1220"]
    assert exact_match_rewards(completions, ["122"] * len(completions), "arithmetic") == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_trl_grpo_rejects_an_unknown_reward_before_starting_a_child(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="reward must be one of"):
        trl_grpo(str(tmp_path), ["r:fjqk="], ["kqjf"], group_size=4, prompts_per_step=1, num_steps=2,
                 max_new_tokens=8, temperature=1.0, lr=1e-4, seed=0, reward="bleu")


@pytest.mark.slow  # ~7 s: TRL in a child process
@pytest.mark.timeout(90)
def test_trl_grpo_takes_chat_rendered_prompts_the_arithmetic_reward_and_bf16(tmp_path):
    """What `bench loop --model smollm2` gives TRL, on the tiny model: prompts rendered with the
    chat template (our ids decoded) that TRL tokenizes back into our ids, and bf16 mixed precision."""
    pytest.importorskip("trl", reason="the peer is TRL's GRPOTrainer; install the dev extra (pip install -e .[dev])")
    from miles_async.bench.loop import peer_prompts
    from miles_async.models import init_model, load_tokenizer
    from miles_async.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig

    model_dir = init_model("qwen3", "tiny", tmp_path / "model", seed=0)
    items = ArithmeticTask(ArithmeticTaskConfig(), load_tokenizer(model_dir)).items("train", 2)
    texts, answers = peer_prompts(model_dir, items)
    assert texts[0].startswith("<|im_start|>") and answers == [str(i.a + i.b) for i in items]
    result = trl_grpo(str(model_dir), texts, answers, group_size=2, prompts_per_step=2, num_steps=2,
                      max_new_tokens=4, temperature=1.0, lr=1e-4, seed=0, timeout_s=80, reward="arithmetic",
                      bf16=True)
    assert result["prompt_ids_match_ours"] and result["prompts_in_order"]
    assert result["config"]["bf16"] is True and result["config"]["reward"] == "arithmetic"
    assert result["reward_mean"] == [0.0, 0.0]  # a random model does not add


def test_trl_grpo_rejects_a_single_step_before_starting_a_child(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="num_steps must be >= 2"):
        trl_grpo(str(tmp_path), ["r:fjqk="], ["kqjf"], group_size=4, prompts_per_step=1, num_steps=1,
                 max_new_tokens=8, temperature=1.0, lr=1e-4, seed=0)


@pytest.mark.slow  # ~7 s: TRL in a child process
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


@pytest.mark.slow  # ~7 s: TRL in a child process
@pytest.mark.timeout(60)
def test_trl_grpo_raises_with_the_childs_stderr_when_it_fails(tmp_path):
    pytest.importorskip("trl", reason="the peer is TRL's GRPOTrainer; install the dev extra (pip install -e .[dev])")
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers cannot load it
    with pytest.raises(RuntimeError, match="TRL GRPO child failed") as failure:
        trl_grpo(str(tmp_path), ["r:fjqk="], ["kqjf"], group_size=2, prompts_per_step=1, num_steps=2,
                 max_new_tokens=4, temperature=1.0, lr=1e-4, seed=0, timeout_s=50)
    assert "Traceback" in str(failure.value)
