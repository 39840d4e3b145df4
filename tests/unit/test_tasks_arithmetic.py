"""miles_async.tasks.arithmetic: the `ArithmeticTask` plug-in (a `miles_async.task.Task`): disjoint,
deterministic splits over operand pairs, prompts in the model's chat template, an exact reward on
the number after the first `=`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from miles_async.models import init_model, load_tokenizer
from miles_async.models.tokenizer import Tokenizer
from miles_async.task import Completion, Task, TaskSpec, decode_item, load_task
from miles_async.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig, Problem, answer_of, pairs

PLUGIN = "miles_async.tasks.arithmetic:ArithmeticTask"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny"))


def reward(task: ArithmeticTask, item: Problem, text: str) -> float:
    return asyncio.run(task.reward(item, Completion(text=text, token_ids=[], finish_reason="stop")))


@pytest.mark.parametrize(("text", "expected"), [
    ("The equation is 59 + 63 = 122.", 122),
    ("59+63=122", 122),
    ("1,000 + 234 = 1,234 apples", 1234),
    ("a = -5, b = 7", -5),  # the first "=" decides
    ("59 + 63 is 122", None),
    ("x = y", None),
    ("= ,", None),
])
def test_answer_of_reads_the_first_number_after_the_first_equals(text: str, expected: int | None) -> None:
    assert answer_of(text) == expected


def test_the_plugin_loads_from_a_recipe_table_and_refuses_unknown_keys(tokenizer: Tokenizer) -> None:
    task = load_task(TaskSpec(plugin=PLUGIN, config={"min_value": 2, "max_value": 9}), tokenizer)
    assert isinstance(task, Task) and isinstance(task, ArithmeticTask) and not task.multi_turn
    assert task.sft_examples(task.items("train", 2)) == []
    with pytest.raises(ValueError, match="unknown key.*max_val"):
        load_task(TaskSpec(plugin=PLUGIN, config={"max_val": 9}), tokenizer)


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_value": 5, "max_value": 4}, "min_value <= max_value"),
    ({"question": "Add {a} and b."}, "must contain"),
    ({"probe_every": 1}, "probe_every"),
])
def test_bad_configs_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticTaskConfig(**fields)  # type: ignore[arg-type]


def test_splits_are_disjoint_deterministic_and_cover_the_range() -> None:
    config = ArithmeticTaskConfig(min_value=10, max_value=99)
    train, probe = pairs(config, "train"), pairs(config, "probe")
    assert not set(train) & set(probe) and len(train) + len(probe) == 90 * 90
    assert 0.08 < len(probe) / 8100 < 0.17  # about 1 in probe_every (8)
    assert pairs(config, "train") == train and pairs(ArithmeticTaskConfig(seed=1), "train") != train
    with pytest.raises(ValueError, match="split must be"):
        pairs(config, "test")  # type: ignore[arg-type]


def test_items_are_chat_prompts_with_distinct_ids(tokenizer: Tokenizer) -> None:
    task = ArithmeticTask(ArithmeticTaskConfig(), tokenizer)
    items = task.items("probe", 50)
    assert len({i.problem_id for i in items}) == 50
    first = items[0]
    text = tokenizer.decode(task.prompt_ids(first))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Add {first.a} and {first.b}. Write the equation."}], add_generation_prompt=True)
    assert text == expected and text.endswith("<|im_start|>assistant\n")
    assert task.items("probe", 50) == items  # deterministic
    with_system = ArithmeticTask(ArithmeticTaskConfig(system="Be brief."), tokenizer).items("probe", 1)[0]
    assert "Be brief." in tokenizer.decode(with_system.input_ids)
    with pytest.raises(ValueError, match="has 1,?0\\d\\d|widen"):
        task.items("probe", 5000)


def test_an_item_crosses_a_node_as_plain_data(tokenizer: Tokenizer) -> None:
    task = ArithmeticTask(ArithmeticTaskConfig(), tokenizer)
    item = task.items("train", 1)[0]
    plain = msgspec.json.decode(msgspec.json.encode(item))
    assert decode_item(task, plain) == item


def test_the_reward_is_exact(tokenizer: Tokenizer) -> None:
    task = ArithmeticTask(ArithmeticTaskConfig(), tokenizer)
    item = Problem(problem_id=0, a=59, b=63, input_ids=[])
    assert reward(task, item, "The equation is 59 + 63 = 122.") == 1.0
    assert reward(task, item, "The equation is 59 + 63 = 112. No: 122") == 0.0
    assert reward(task, item, "122") == 0.0  # no equation
    assert reward(task, item, "59 + 63 = 1220") == 0.0


def test_the_shipped_recipe_loads() -> None:
    from miles_async.actors.recipe import load_recipe

    config = load_recipe(Path(__file__).parents[2] / "recipes" / "smollm2-math.toml")
    assert config.model.pretrained == "smollm2" and config.task.plugin == PLUGIN
    assert config.trainer.compute_dtype == config.rollout.engine.dtype == "auto" and config.eval.at_start
