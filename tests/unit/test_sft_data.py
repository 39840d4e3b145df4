"""SFT mode's data and plan: JSONL records to token ids and loss masks (chat template or raw pairs),
bad lines refused by line number, the seeded epoch order, and the recipe's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_async.actors.sft import SFTLoopConfig, batch_indices, load_sft_recipe
from miles_async.models import init_model, load_tokenizer
from miles_async.sft import SFTDataConfig, chat_example, example_from_record, load_sft_data
from miles_async.tasks.reverse import ReverseTaskConfig, prompts, sft_examples


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny"))


def test_a_conversation_is_masked_on_what_the_assistant_says(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6"}]
    tokens, mask = chat_example(tokenizer, messages)
    assert tokens == tokenizer.encode(tokenizer.apply_chat_template(messages))
    trained = [t for t, m in zip(tokens, mask) if m]
    end = tokenizer.eos_token_id
    assert trained == [*tokenizer.encode("4"), end, *tokenizer.encode("6"), end]  # each reply and its end of turn
    # the tokens before each reply are exactly the conversation rendered for generation
    first = mask.index(1)
    assert tokens[:first] == tokenizer.encode(tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True))
    with pytest.raises(ValueError, match="no assistant message"):
        chat_example(tokenizer, messages[:2])


def test_a_raw_pair_is_the_reverse_tasks_own_sft_example(tokenizer) -> None:
    prompt = prompts(ReverseTaskConfig(), 1, tokenizer)[0]
    tokens, mask = example_from_record({"prompt": prompt.text, "response": prompt.answer}, tokenizer,
                                       chat_template=False)
    [expected] = sft_examples([prompt], tokenizer)
    assert (tokens, mask) == (expected.tokens, expected.loss_mask)
    # "completion" is accepted for "response" (TRL's name); a pair through the chat template is a
    # one-turn conversation
    assert example_from_record({"prompt": "hi", "completion": "yo"}, tokenizer) == chat_example(
        tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def test_bad_lines_are_refused_by_line_number_and_unusable_examples_counted(tokenizer, tmp_path: Path) -> None:
    good = {"prompt": "r:fgjk=", "response": "kjgf"}
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([json.dumps(good), "", json.dumps({"prompt": "r:" + "fgjk" * 20 + "=", "response": "kjgf"}),
                               json.dumps({"prompt": "r:=", "response": ""})]) + "\n")
    data = load_sft_data(SFTDataConfig(path=str(path), chat_template=False, max_tokens=40), tokenizer)
    # the long one is left out; the empty response still trains its EOS
    assert len(data.examples) == 2 and data.too_long == 1 and data.heldout == []
    assert load_sft_data(SFTDataConfig(path=str(path), chat_template=False, max_tokens=40, num_heldout=1),
                         tokenizer).heldout == [data.examples[-1]]
    for line, message in ((json.dumps([1, 2]), "must be a JSON object"), ("{oops", ""),
                          (json.dumps({"prompt": "a"}), 'a string "prompt" and a string "response"'),
                          (json.dumps({"messages": [{"content": "x"}]}), "with a \"role\"")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
            load_sft_data(SFTDataConfig(path=str(bad), chat_template=False), tokenizer)
    with pytest.raises(ValueError, match="data.path is empty"):
        load_sft_data(SFTDataConfig(), tokenizer)
    with pytest.raises(ValueError, match="num_heldout is 5"):
        load_sft_data(SFTDataConfig(path=str(path), chat_template=False, num_heldout=5), tokenizer)


def test_each_epoch_visits_every_example_once_in_a_seeded_order() -> None:
    n, batch = 10, 4
    positions = [i for step in range(5) for i in batch_indices(step, batch, n, seed=3)]  # 2 epochs
    assert sorted(positions[:10]) == sorted(positions[10:20]) == list(range(10))
    assert positions[:10] != positions[10:20]  # another order each epoch
    assert positions == [i for step in range(5) for i in batch_indices(step, batch, n, seed=3)]  # a function of the step
    assert positions != [i for step in range(5) for i in batch_indices(step, batch, n, seed=4)]
    assert SFTLoopConfig(epochs=2.5, batch_size=4).num_steps(10) == 7 and SFTLoopConfig(max_steps=3).num_steps(10) == 3


def test_the_recipe_refuses_what_the_run_sets_and_unknown_keys(tmp_path: Path) -> None:
    recipe = tmp_path / "sft.toml"
    recipe.write_text('[data]\npath = "x.jsonl"\n[loop]\nbatch_size = 8\n')
    assert load_sft_recipe(recipe, ["loop.lr=1e-4"]).loop.lr == 1e-4
    for override, message in (("trainer.model_dir=m", "set by the run"), ("trainer.objective=rl", "set by the run"),
                              ("trainer.lr=1", "set by the run"), ("loop.steps=3", "unknown key 'loop.steps'"),
                              ("loop.batch_size=0", "batch_size >= 1")):
        with pytest.raises(ValueError, match=message):
            load_sft_recipe(recipe, [override])


def test_the_shipped_reverse_data_is_what_write_sft_pairs_writes(tmp_path: Path) -> None:
    from miles_async.actors.sft import load_sft_recipe
    from miles_async.tasks.reverse import write_sft_pairs

    root = Path(__file__).resolve().parents[2]
    assert write_sft_pairs(tmp_path / "pairs.jsonl", 4000) == 4000
    assert (tmp_path / "pairs.jsonl").read_bytes() == (root / "recipes" / "data" / "reverse-sft.jsonl").read_bytes()
    recipe = load_sft_recipe(root / "recipes" / "sft-reverse.toml")
    # The recipe writes the path from its own folder; loading it makes the path absolute.
    assert recipe.data.path == str(root / "recipes" / "data" / "reverse-sft.jsonl") and not recipe.data.chat_template
