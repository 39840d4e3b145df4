"""The dataset task's recipes: recipes/smollm2-word-problems.toml (CPU) and recipes/gsm8k-qwen3-0.6b.toml
(GPU) load; the CPU recipe's shipped word problems are what their generator writes, in GSM8K's
format, disjoint, and every row passes the task's checks and the math reward's label check."""

from __future__ import annotations

import json
from pathlib import Path

from miles_async.actors.recipe import load_recipe
from miles_async.task import task_class, task_config
from miles_async.tasks import word_problems
from miles_async.tasks.dataset import DatasetTask, DatasetTaskConfig
from miles_async.tasks.rewards import math_reward, parses

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_the_cpu_recipe_reads_its_shipped_word_problems() -> None:
    config = load_recipe(RECIPES / "smollm2-word-problems.toml")
    assert config.model.pretrained == "smollm2" and task_class(config.task) is DatasetTask
    task = task_config(config.task)
    assert isinstance(task, DatasetTaskConfig) and task.reward == "math" and task.prompt_key == "question"
    # the recipe's relative paths are taken from its folder
    assert task.path == str(RECIPES / "data" / "word-problems-train.jsonl")
    assert task.eval_path == str(RECIPES / "data" / "word-problems-test.jsonl")
    assert config.eval.at_start and config.eval.temperature == 0 and config.eval.every > 0
    records = DatasetTask(task, None)  # reading and checking the rows needs no tokenizer
    train, probe = records.records("train"), records.records("probe")
    assert (len(train), len(probe)) == (1200, 200) and config.task.num_prompts == 1200
    assert {r.prompt for r in train}.isdisjoint(r.prompt for r in probe)  # type: ignore[misc]
    assert all(parses(r.label) for r in probe)
    assert all(math_reward(r.label, r.label) == 1.0 for r in probe[:20])


def test_the_shipped_word_problems_are_their_generators(tmp_path: Path) -> None:
    word_problems.main(["--train", str(tmp_path / "train.jsonl"), "--test", str(tmp_path / "test.jsonl")])
    for name in ("train", "test"):
        shipped = RECIPES / "data" / f"word-problems-{name}.jsonl"
        assert (tmp_path / f"{name}.jsonl").read_bytes() == shipped.read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    kinds = {template.__name__ for template in word_problems.TEMPLATES}
    assert len(kinds) == 6 and {"add_then_take", "multiply_then_add"} <= kinds  # one- and two-step problems
    for row in rows:
        assert set(row) == {"question", "answer"} and row["question"].endswith("?")
        *steps, final = row["answer"].split("\n")
        assert 1 <= len(steps) <= 2 and final.startswith("#### ") and final[5:].isdigit()
        assert all("<<" in step and ">>" in step for step in steps)  # GSM8K's calculator annotations


def test_the_gpu_recipe_loads() -> None:
    config = load_recipe(RECIPES / "gsm8k-qwen3-0.6b.toml")
    assert config.model.path == "Qwen/Qwen3-0.6B"  # a Hub id: kept as written
    task = task_config(config.task)
    assert isinstance(task, DatasetTaskConfig)
    assert (task.path, task.name, task.split, task.eval_split) == ("openai/gsm8k", "main", "train", "test")
    assert task.reward == "math" and task.chat_template_kwargs == {"enable_thinking": False}
    assert config.rollout.engine.device == "cuda" and config.trainer.backend == "nccl"
    assert config.scheduler.group_size == 8 and config.trainer.lr == 1e-6
    assert 512 <= config.rollout.sampling.max_new_tokens <= 1024
    assert config.eval.num_prompts == 1319 and config.eval.temperature == 0 and config.eval.at_start
