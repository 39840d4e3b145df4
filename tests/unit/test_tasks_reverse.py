"""miles_async.tasks.reverse: the `ReverseTask` plug-in (a `miles_async.task.Task`), deterministic
disjoint splits, one token per character with the real tokenizer of init_model, SFT masks over
answer + EOS only, and an exact reward."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import pytest

from miles_async.models import init_model, load_tokenizer
from miles_async.models.tokenizer import IM_END, PAD_TOKEN, Tokenizer
from miles_async.task import Completion, Task, TaskSpec, decode_item, load_task
from miles_async.tasks.reverse import (
    Prompt,
    ReverseTask,
    ReverseTaskConfig,
    is_correct,
    num_words,
    probe_accuracy,
    prompts,
    sft_examples,
)
from miles_async.trainer.packing import trained_tokens
from miles_async.trajectory import TokenData, Trajectory

PLUGIN = "miles_async.tasks.reverse:ReverseTask"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny")))


def sample(tokens: list[int], mask: list[int]) -> Trajectory:
    """An SFT example as the trainer takes it (arrays inline, metadata from the mask)."""
    num_generated = sum(mask)
    return Trajectory(num_tokens=len(tokens), num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated,
                      data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=[0.0] * len(tokens)))


@pytest.fixture(scope="module")
def task(tokenizer: Tokenizer) -> ReverseTask:
    return ReverseTask(ReverseTaskConfig(), tokenizer)


def _score(task: ReverseTask, prompt: Prompt, text: str, finish_reason: str = "stop") -> float:
    return asyncio.run(task.reward(prompt, Completion(text=text, token_ids=[], finish_reason=finish_reason)))


def test_the_plugin_is_a_task(tokenizer: Tokenizer) -> None:
    config = ReverseTaskConfig(seed=3)
    task = ReverseTask(config, tokenizer)
    assert isinstance(task, Task) and not task.multi_turn
    assert task.Config is ReverseTaskConfig and task.Item is Prompt
    assert task.items("train", 20) == prompts(config, 20, tokenizer)
    assert task.items("probe", 5) == prompts(config, 5, tokenizer, split="probe")
    for item in task.items("train", 20):
        assert task.prompt_ids(item) == item.input_ids == tokenizer.encode(item.text)
    # A recipe names it by path; `[task.config]` fills its Config.
    loaded = load_task(TaskSpec(plugin=PLUGIN, config={"seed": 3}), tokenizer)
    assert isinstance(loaded, ReverseTask) and loaded.config == config
    assert loaded.items("train", 20) == task.items("train", 20)


def test_prompts_are_deterministic_by_seed(tokenizer: Tokenizer) -> None:
    config = ReverseTaskConfig(seed=3)
    first = prompts(config, 50, tokenizer)
    assert first == prompts(config, 50, tokenizer)
    assert prompts(config, 20, tokenizer) == first[:20]  # a longer list extends a shorter one
    assert [p.text for p in prompts(ReverseTaskConfig(seed=4), 50, tokenizer)] != [p.text for p in first]


def test_prompts_are_well_formed_and_distinct(tokenizer: Tokenizer) -> None:
    config = ReverseTaskConfig()
    batch = prompts(config, 300, tokenizer)
    assert len({p.text for p in batch}) == 300
    assert len({p.prompt_id for p in batch}) == 300
    for p in batch:
        word = p.text[2:-1]
        assert p.text == f"r:{word}=" and p.answer == word[::-1]
        assert config.min_len <= len(word) <= config.max_len and set(word) <= set(config.alphabet)
        assert 0 <= p.prompt_id < num_words(config)
    assert {len(p.answer) for p in batch} == {4, 5, 6}


def test_train_and_probe_are_disjoint(tokenizer: Tokenizer) -> None:
    config = ReverseTaskConfig()
    train = {p.text for p in prompts(config, 3000, tokenizer, split="train")}
    probe = prompts(config, 200, tokenizer, split="probe")
    assert not train & {p.text for p in probe}
    assert not {p.prompt_id for p in prompts(config, 3000, tokenizer)} & {p.prompt_id for p in probe}


def test_prompts_refuse_bad_requests(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="split"):
        prompts(ReverseTaskConfig(), 1, tokenizer, split="test")  # type: ignore[arg-type]
    small = ReverseTaskConfig(alphabet="fg", min_len=1, max_len=2)  # 6 words in all
    with pytest.raises(ValueError, match="only 6 words"):
        prompts(small, 7, tokenizer)
    with pytest.raises(ValueError, match="distinct train words"):
        prompts(small, 6, tokenizer)  # some of the 6 are probe words
    for bad in ({"alphabet": "ffg"}, {"alphabet": "fG"}, {"alphabet": "fr"}, {"alphabet": ""},
                {"min_len": 5, "max_len": 4}, {"min_len": 0}, {"probe_every": 1}):
        with pytest.raises(ValueError):
            ReverseTaskConfig(**bad)  # type: ignore[arg-type]


def test_one_token_per_character_and_round_trip(tokenizer: Tokenizer) -> None:
    batch = prompts(ReverseTaskConfig(), 200, tokenizer) + prompts(ReverseTaskConfig(), 50, tokenizer, "probe")
    for p in batch:
        assert len(p.input_ids) == len(p.text), p.text  # no BPE merge inside the frame or the word
        assert tokenizer.decode(p.input_ids) == p.text
        answer_ids = tokenizer.encode(p.answer)
        assert len(answer_ids) == len(p.answer) and tokenizer.decode(answer_ids) == p.answer
        # Encoding apart (as the engine generates) gives the same ids as encoding the whole text.
        assert tokenizer.encode(p.text + p.answer) == p.input_ids + answer_ids
    # Why the alphabet matters: common letters merge, so their words are not character-level.
    assert len(tokenizer.encode("fedcba")) < 6


def test_sft_masks_cover_exactly_answer_and_eos(tokenizer: Tokenizer) -> None:
    batch = prompts(ReverseTaskConfig(), 20, tokenizer)
    examples = sft_examples(batch, tokenizer)
    # the plug-in's examples are the module's, as (tokens, mask) pairs
    assert ReverseTask(ReverseTaskConfig(), tokenizer).sft_examples(batch) == [(e.tokens, e.loss_mask) for e in examples]
    for p, ex in zip(batch, examples):
        assert ex.prompt_id == p.prompt_id
        assert ex.tokens[: len(p.input_ids)] == p.input_ids
        assert ex.tokens[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ex.tokens[len(p.input_ids):], skip_special_tokens=True) == p.answer
        assert ex.loss_mask == [0] * len(p.input_ids) + [1] * (len(p.answer) + 1)
        trajectory = sample(ex.tokens, ex.loss_mask)  # TokenData.build checks the lengths
        assert trained_tokens(trajectory) == len(p.answer) + 1


def test_sft_needs_an_eos(tokenizer: Tokenizer) -> None:
    @dataclass
    class NoEos:
        eos_token_id: int | None = None

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [1]

    with pytest.raises(ValueError, match="eos_token_id"):
        sft_examples(prompts(ReverseTaskConfig(), 1, tokenizer), NoEos())
    with pytest.raises(ValueError, match="eos_token_id"):
        ReverseTask(ReverseTaskConfig(), NoEos()).sft_examples(prompts(ReverseTaskConfig(), 1, tokenizer))


def test_reward_is_exact(task: ReverseTask) -> None:
    prompt = Prompt(prompt_id=0, text="r:fjqk=", input_ids=[], answer="kqjf")
    for right in ("kqjf", " kqjf\n", f"kqjf{IM_END}", f"kqjf{IM_END}{PAD_TOKEN}", f"kqjf\n{IM_END}\n"):
        assert _score(task, prompt, right) == 1.0 and is_correct(right, "kqjf"), right
    for wrong in ("", "kqj", "kqjff", "fjqk", "k q j f", "KQJF", f"{IM_END}kqjf", f"kqjf{IM_END}x", "kqjf."):
        assert _score(task, prompt, wrong) == 0.0 and not is_correct(wrong, "kqjf"), wrong


def test_reward_reads_the_text_only(task: ReverseTask) -> None:
    """Replaces the old module-level `reward(sample)`'s duck typing (any object with `prompt` and
    `output_text`): the plug-in's reward takes the item and a typed `Completion`, and scores the
    text alone, so a generation cut at max tokens (no EOS) scores as one that stopped."""
    prompt = Prompt(prompt_id=0, text="r:fjqk=", input_ids=[], answer="kqjf")
    assert _score(task, prompt, "kqjf", finish_reason="length") == 1.0
    assert _score(task, prompt, "kqj", finish_reason="length") == 0.0


def test_malformed_items_and_configs_are_refused_at_the_boundary(task: ReverseTask, tokenizer: Tokenizer) -> None:
    """The old `reward` refused a sample whose `prompt` or `output_text` was missing or ill-typed;
    that subject is gone (the reward takes a typed `Prompt` and `Completion`). What enters as
    plain data now is an item that crossed a node (`decode_item`), a completion decoded from a
    message, and the recipe's `[task.config]` (`load_task`): each refuses a malformed value, naming it."""
    prompt = task.items("train", 1)[0]
    assert decode_item(task, prompt) is prompt
    assert decode_item(task, msgspec.to_builtins(prompt)) == prompt
    with pytest.raises(msgspec.ValidationError, match="answer"):
        decode_item(task, {"prompt_id": 0, "text": "r:fjqk=", "input_ids": []})
    with pytest.raises(msgspec.ValidationError, match=r"\$.input_ids"):
        decode_item(task, {"prompt_id": 0, "text": "r:fjqk=", "input_ids": "fjqk", "answer": "kqjf"})
    with pytest.raises(msgspec.ValidationError, match=r"\$.text"):
        msgspec.convert({"text": None, "token_ids": [], "finish_reason": "stop"}, Completion)
    with pytest.raises(ValueError, match="unknown key.*task.config.alphabets"):
        load_task(TaskSpec(plugin=PLUGIN, config={"alphabets": "fgjk"}), tokenizer)
    with pytest.raises(ValueError, match="task.config"):
        load_task(TaskSpec(plugin=PLUGIN, config={"alphabet": "fgr"}), tokenizer)  # __post_init__ refuses it


def test_probe_accuracy() -> None:
    batch = [Prompt(prompt_id=i, text=f"r:{w}=", input_ids=[], answer=w[::-1])
             for i, w in enumerate(["fjqk", "ggkm", "pqvvf", "kkkk"])]
    assert probe_accuracy(["kqjf", "mkgg", "wrong", f"kkkk{IM_END}"], batch) == 0.75
    with pytest.raises(ValueError, match="one output per prompt"):
        probe_accuracy(["kqjf"], batch)
    with pytest.raises(ValueError, match="at least one"):
        probe_accuracy([], [])


def test_structs_round_trip_through_msgspec(tokenizer: Tokenizer) -> None:
    p = prompts(ReverseTaskConfig(), 1, tokenizer)[0]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=Prompt) == p
    config = msgspec.convert({"alphabet": "fgjk", "seed": 7}, ReverseTaskConfig)
    assert config.alphabet == "fgjk" and config.max_len == 6
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"alphabet": "fgr"}, ReverseTaskConfig)  # __post_init__ runs on decode too


def test_zipf_lengths_are_mostly_short_with_a_long_tail(tokenizer):
    config = ReverseTaskConfig(lengths="zipf", min_len=4, max_len=24)
    lengths = sorted(len(p.answer) for p in prompts(config, 1000, tokenizer))
    assert lengths[500] <= 5 and lengths[-1] >= 18 and lengths[0] == 4
    with pytest.raises(ValueError, match="lengths must be"):
        ReverseTaskConfig(lengths="normal")
