"""miles_async.tasks.dataset: the `DatasetTask` plug-in over real files (JSONL, JSON, Parquet written
with pyarrow, folders written by `datasets`' save_to_disk, a Hub dataset in the datasets cache read
offline by the real `datasets`), prompts by key or as chats, with and without the chat template,
the held-out split, the rewards through the task, SFT examples, and every bad input's one line.

The tokenizer is the tiny model's (`init_model`: a byte-level BPE with a ChatML template)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _support_datasets import place_hub_dataset

from miles_async.models import init_model, load_tokenizer
from miles_async.models.tokenizer import Tokenizer
from miles_async.task import Completion, TaskSpec, decode_item, load_task, task_class
from miles_async.tasks.dataset import DatasetTask, Row, prompt_hash

ROWS = [{"question": f"Tom has {i} apples and buys 2 more. How many now?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
        for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny"))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make(tokenizer: Tokenizer, **config: Any) -> DatasetTask:
    """The task as a recipe builds it: by its built-in name, through [task.config]."""
    task = load_task(TaskSpec(plugin="dataset", config={"prompt_key": "question", **config}), tokenizer)
    assert isinstance(task, DatasetTask)
    return task


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def score(task: DatasetTask, item: Row, text: str) -> float:
    return asyncio.run(task.reward(item, Completion(text=text, token_ids=[], finish_reason="stop")))


def test_jsonl_rows_become_items_in_the_chat_template(tmp_path: Path, tokenizer: Tokenizer) -> None:
    task = make(tokenizer, path=str(write_jsonl(tmp_path / "train.jsonl", ROWS)), eval_fraction=0.25)
    train, probe = task.items("train", 1000), task.items("probe", 1000)  # all of each: fewer than asked
    assert 0 < len(probe) < 20 and len(train) + len(probe) == 40
    assert {i.row_id for i in train}.isdisjoint(i.row_id for i in probe)
    for item in [*train, *probe]:
        row = ROWS[item.row_id]
        assert item.label == row["answer"]
        assert item.input_ids == chat_ids(tokenizer, [{"role": "user", "content": row["question"]}])
    assert task.items("train", 3) == train[:3] and task.items("train", 0) == []
    # an item that crossed a node arrives as plain data
    assert decode_item(task, msgspec.to_builtins(train[0])) == train[0] and task.multi_turn is False


def test_the_held_out_rows_are_stable_and_never_trained_on(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = [*ROWS, ROWS[5], ROWS[9]]  # repeated prompts fall on one side with their twins
    first = make(tokenizer, path=str(write_jsonl(tmp_path / "a.jsonl", rows)), eval_fraction=0.3)
    again = make(tokenizer, path=str(write_jsonl(tmp_path / "b.jsonl", rows[::-1])), eval_fraction=0.3)

    def questions(task: DatasetTask, split: str) -> set[str]:
        return {str(r.prompt) for r in task.records(split)}  # type: ignore[arg-type]

    assert questions(first, "probe") == questions(again, "probe")  # by the prompt, not the file's order
    assert questions(first, "probe").isdisjoint(questions(first, "train"))
    assert questions(first, "probe") == {r["question"] for r in ROWS if prompt_hash(r["question"], 0) < 0.3}
    other_seed = make(tokenizer, path=str(tmp_path / "a.jsonl"), eval_fraction=0.3, seed=1)
    assert questions(other_seed, "probe") != questions(first, "probe")
    # eval_path: its rows are the probe set, and a training row with one of their prompts is left out
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[:4])
    split = make(tokenizer, path=str(tmp_path / "a.jsonl"), eval_path=str(test))
    assert [r.label for r in split.records("probe")] != [] and questions(split, "probe") == {r["question"]
                                                                                            for r in ROWS[:4]}
    assert len(split.records("train")) == 38 and questions(split, "train").isdisjoint(questions(split, "probe"))
    # shuffled by the seed; shuffle = false keeps the file's order
    ordered = make(tokenizer, path=str(tmp_path / "a.jsonl"), eval_path=str(test), shuffle=False)
    assert [r.row_id for r in ordered.records("train")] == [i for i in range(42) if i not in (0, 1, 2, 3)]


def test_raw_text_prompts_with_a_system_prompt_and_a_format(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    raw = make(tokenizer, path=str(path), chat_template=False, system_prompt="Solve it.",
               prompt_format="Q: {prompt}\nA: \\boxed{}")
    item = raw.items("train", 1)[0]
    text = f"Solve it.\n\nQ: {ROWS[item.row_id]['question']}\nA: \\boxed{{}}"
    assert item.input_ids == tokenizer.encode(text, add_special_tokens=True)
    chat = make(tokenizer, path=str(path), system_prompt="Solve it.", prompt_format="Q: {prompt}")
    item = chat.items("train", 1)[0]
    assert item.input_ids == chat_ids(tokenizer, [{"role": "system", "content": "Solve it."},
                                                  {"role": "user", "content": f"Q: {ROWS[item.row_id]['question']}"}])


def test_chat_rows_by_messages_key(tmp_path: Path, tokenizer: Tokenizer) -> None:
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}], "answer": i + 1} for i in range(10)]
    path = write_jsonl(tmp_path / "chats.jsonl", [*rows, {"messages": own_system, "answer": 4}])
    task = make(tokenizer, path=str(path), messages_key="messages", system_prompt="You add.", eval_fraction=0.5)
    items = {i.row_id: i for i in [*task.items("train", 100), *task.items("probe", 100)]}
    assert items[3].label == "4"  # a number label arrives as its text
    assert items[3].input_ids == chat_ids(tokenizer, [{"role": "system", "content": "You add."}, *rows[3]["messages"]])
    assert items[10].input_ids == chat_ids(tokenizer, own_system)  # the row's own system message wins


def test_json_files_a_list_a_data_object_or_lines(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "list.json").write_text(json.dumps(ROWS[:6]))
    (tmp_path / "data.json").write_text(json.dumps({"version": 1, "data": ROWS[:6]}))
    write_jsonl(tmp_path / "lines.json", ROWS[:6])
    for name in ("list.json", "data.json", "lines.json"):
        task = make(tokenizer, path=str(tmp_path / name), eval_path=str(tmp_path / "list.json"))
        assert sorted(r.label for r in task.records("probe")) == sorted(r["answer"] for r in ROWS[:6])


def test_parquet_and_save_to_disk_folders(tmp_path: Path, tokenizer: Tokenizer) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**row, "extra": [1, 2]} for row in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = make(tokenizer, path=str(tmp_path / "train.parquet"), eval_fraction=0.25)
    assert sorted(r.row_id for r in [*task.records("train"), *task.records("probe")]) == list(range(40))
    assert task.records("train")[0].where.startswith(f"{tmp_path / 'train.parquet'}: record ")

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    one = make(tokenizer, path=str(tmp_path / "one"), eval_fraction=0.25)
    assert [r.prompt for r in one.records("probe")] == [r.prompt for r in task.records("probe")]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:30]),
                                   "test": datasets.Dataset.from_list(rows[30:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    both = make(tokenizer, path=str(tmp_path / "dict"), eval_split="test")
    assert sorted(r.label for r in both.records("probe")) == sorted(r["answer"] for r in rows[30:])
    assert len(both.items("train", 100)) == 30


# Run in a fresh interpreter: huggingface_hub and datasets read HF_HOME and HF_HUB_OFFLINE when imported.
HUB_SCRIPT = """
import json, sys
from miles_async.tasks.dataset import DatasetTask, DatasetTaskConfig
task = DatasetTask(DatasetTaskConfig(path="openai/gsm8k", name="main", prompt_key="question", eval_split="test"), None)
out = {"train": [r.label for r in task.records("train")], "probe": [r.label for r in task.records("probe")],
       "where": task.records("train")[0].where, "errors": []}
for config in ({"path": "openai/no-such-set"}, {"path": "openai/gsm8k", "name": "mian"},
               {"path": "openai/gsm8k", "name": "main", "split": "tain"}):
    try:
        DatasetTask(DatasetTaskConfig(prompt_key="question", **config), None).records("train")
    except ValueError as e:
        out["errors"].append(str(e))
print(json.dumps(out))
"""


@pytest.mark.timeout(60)
def test_a_hub_dataset_from_the_datasets_cache_offline(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    home = tmp_path / "hf-home"
    place_hub_dataset(home, "openai/gsm8k", "main", {"train": ROWS[:30], "test": ROWS[30:]})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=50,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(out["train"]) == sorted(r["answer"] for r in ROWS[:30])
    assert sorted(out["probe"]) == sorted(r["answer"] for r in ROWS[30:])
    assert out["where"].startswith("dataset openai/gsm8k/main (train): row ")
    missing, subset, split = out["errors"]
    assert missing.startswith("task.config.path 'openai/no-such-set': no such file, and the Hub dataset cannot be "
                              "reached (HF_HUB_OFFLINE is set: only datasets already in the datasets cache load)")
    assert "'mian'" in subset and "Available configs in the cache: ['main']" in subset
    assert "Unknown split \"tain\". Should be one of ['train', 'test']" in split
    assert all("\n" not in e for e in out["errors"])


def test_rewards_through_the_task(tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(write_jsonl(tmp_path / "train.jsonl", ROWS))
    item = make(tokenizer, path=path).items("train", 1)[0]
    answer = item.label.split("#### ")[1]
    math = make(tokenizer, path=path)
    assert score(math, item, f"So it is {answer}.<|im_end|>") == 1.0  # graded in a worker thread
    assert score(math, item, "So it is 1000.") == 0.0
    regex = make(tokenizer, path=path, reward="regex:is (\\d+)")
    assert score(regex, item, f"it is {answer}<|im_end|>") == 1.0
    (tmp_path / "slow_reward.py").write_text(
        "import asyncio\n\nasync def never(completion, label):\n    await asyncio.Event().wait()\n\n"
        "def shout(completion, label):\n    return completion.isupper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hung = make(tokenizer, path=path, reward="slow_reward:never", reward_timeout_s=0.05)
    assert score(hung, item, "anything") == 0.0  # past reward_timeout_s: 0, and the loop goes on
    assert score(make(tokenizer, path=path, reward="slow_reward:shout"), item, "YES<|im_end|>") == 1.0


def test_sft_examples_put_the_loss_on_the_label_and_eos(tmp_path: Path, tokenizer: Tokenizer) -> None:
    task = make(tokenizer, path=str(write_jsonl(tmp_path / "train.jsonl", ROWS)))
    items = task.items("train", 2)
    for item, (tokens, mask) in zip(items, task.sft_examples(items)):
        reply = [*tokenizer.encode(item.label), tokenizer.eos_token_id]
        assert tokens == item.input_ids + reply and mask == [0] * len(item.input_ids) + [1] * len(reply)


def test_the_plugin_is_named_by_its_short_or_long_name() -> None:
    assert task_class(TaskSpec(plugin="dataset")) is DatasetTask
    assert task_class(TaskSpec(plugin="miles_async.tasks.dataset:DatasetTask")) is DatasetTask
    assert task_class(TaskSpec(plugin="reverse")).__name__ == "ReverseTask"
    with pytest.raises(ValueError, match="'datset' is neither a built-in task \\(did you mean 'dataset'\\?\\)"):
        task_class(TaskSpec(plugin="datset"))


def _bad_inputs(tmp: Path) -> list[tuple[dict[str, Any], str]]:
    """(task.config, the error it must raise) for each kind of bad input."""
    rows = write_jsonl(tmp / "ok.jsonl", ROWS[:4])
    bad_rows = {
        "no_prompt.jsonl": [ROWS[0], ROWS[1], {"questoin": "typo", "answer": "1"}],
        "no_label.jsonl": [ROWS[0], {"question": "Where is it?"}],
        "int_prompt.jsonl": [{"question": 7, "answer": "7"}],
        "chat_prompt.jsonl": [{"question": [{"role": "user", "content": "hi"}], "answer": "7"}],
        "empty_prompt.jsonl": [ROWS[0], {"question": "  ", "answer": "7"}],
        "list_label.jsonl": [{"question": "q", "answer": ["7"]}],
        "not_object.jsonl": [ROWS[0], ["question", "answer"]],
        "words.jsonl": [{"question": "q", "answer": "no number at all"}],
        "bad_chat.jsonl": [{"messages": [{"role": "user"}], "answer": "1"}],
    }
    for name, content in bad_rows.items():
        write_jsonl(tmp / name, content)
    (tmp / "broken.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    (tmp / "record.json").write_text(json.dumps([ROWS[0], {"question": "q"}]))
    (tmp / "scalar.json").write_text("3")
    (tmp / "table.csv").write_text("question,answer\n")
    (tmp / "folder").mkdir()
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    f, e = str(tmp), re.escape(str(tmp))
    return [
        ({"path": f"{f}/missing.jsonl"}, f"task.config.path '{e}/missing.jsonl' does not exist"),
        ({"path": "nowhere"}, "task.config.path 'nowhere' does not exist"),
        ({"path": str(rows), "eval_path": f"{f}/missing.json"}, f"task.config.eval_path '{e}/missing.json' does not"),
        ({"path": f"{f}/no_prompt.jsonl"}, (f"^{e}/no_prompt.jsonl:3: the row has no 'question' "
                                            r"\(task.config.prompt_key\) \(did you mean 'questoin'\?\); it has: ")),
        ({"path": f"{f}/no_label.jsonl"}, (f"^{e}/no_label.jsonl:2: the row has no 'answer' "
                                           r"\(task.config.label_key\); it has: question")),
        ({"path": f"{f}/int_prompt.jsonl"}, ":1: 'question' must be a string, got int$"),
        ({"path": f"{f}/chat_prompt.jsonl"}, "must be a string, got list \\(a chat\\? set task.config.messages_key\\)"),
        ({"path": f"{f}/empty_prompt.jsonl"}, "empty_prompt.jsonl:2: 'question' is empty"),
        ({"path": f"{f}/list_label.jsonl"}, "'answer' \\(the label\\) must be a string or a number, got list"),
        ({"path": f"{f}/not_object.jsonl"}, "not_object.jsonl:2: a row must be an object"),
        ({"path": f"{f}/broken.jsonl"}, "broken.jsonl:2: not JSON"),
        ({"path": f"{f}/record.json"}, "record.json: record 1: the row has no 'answer'"),
        ({"path": f"{f}/scalar.json"}, "must hold a list of rows or {\"data\": \\[...\\]}, got int"),
        ({"path": f"{f}/table.csv"}, "cannot tell how to read a .csv file"),
        ({"path": f"{f}/folder"}, "is a folder but not one written by datasets' save_to_disk"),
        ({"path": f"{f}/empty.jsonl"}, "holds no rows"),
        ({"path": f"{f}/latin1.jsonl"}, "latin1.jsonl: not UTF-8 text"),
        ({"path": f"{f}/words.jsonl"}, "words.jsonl:1: math-verify reads no answer in the label 'no number at all'"),
        ({"path": f"{f}/bad_chat.jsonl", "messages_key": "messages"}, "'messages' message 0 must be an object with"),
        ({"path": str(rows), "reward": "mth"}, "did you mean 'math'"),
        ({"path": str(rows), "reward": "regex:[0-9"}, "regex '\\[0-9' does not compile"),
        ({"path": str(rows), "reward": "no_such_module:score"}, "cannot import 'no_such_module'"),
        ({"path": str(rows), "eval_path": str(rows), "eval_fraction": 0.1}, "eval_path and task.config.eval_fraction"),
        ({"path": str(rows), "eval_fraction": 1.5}, "between 0 and 1"),
        ({"path": str(rows), "eval_split": "test"}, "names a split of a Hub dataset or save_to_disk folder"),
        ({"path": str(rows), "name": "main"}, "is a file: task.config.name and split pick"),
        ({"path": str(rows), "messages_key": "m", "chat_template": False}, "needs the chat template"),
        ({"path": str(rows), "prompt_format": "Solve this"}, "must contain {prompt}"),
        ({"path": ""}, "task.config.path is empty"),
        ({"path": str(rows), "eval_fraction": 0.0001}, "the probe split of task.config.path .* is empty"),
        ({"path": str(rows), "limit": 3}, "unknown key\\(s\\) task.config.limit"),
    ]


def test_bad_inputs_are_refused_as_the_task_is_built_in_one_line(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Building the task and drawing its items (what the run's pre-flight does) is where each check
    happens: a ValueError, one line, naming the file and line or record."""
    for config, message in _bad_inputs(tmp_path):
        with pytest.raises(ValueError, match=message) as error:
            task = load_task(TaskSpec(plugin="dataset", config={"prompt_key": "question", **config}), tokenizer)
            task.items("train", 10)
            task.items("probe", 10)
        assert "\n" not in str(error.value), config


def test_without_datasets_a_parquet_file_names_the_extra(tmp_path: Path, tokenizer: Tokenizer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets when it is not installed
    with pytest.raises(ValueError, match=r"needs the datasets package: pip install 'miles-async\[data\]'"):
        make(tokenizer, path=str(tmp_path / "train.parquet")).items("train", 1)
