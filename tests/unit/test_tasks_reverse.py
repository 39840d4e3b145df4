"""miles_async.tasks.reverse: deterministic disjoint splits, one token per character with the real
tokenizer of init_model, SFT masks over answer + EOS only, and an exact, strict reward."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import pytest

from miles_async.models import init_model, load_tokenizer
from miles_async.models.tokenizer import IM_END, PAD_TOKEN, Tokenizer
from miles_async.tasks.reverse import (
    Completion,
    Prompt,
    ReverseTaskConfig,
    num_words,
    probe_accuracy,
    prompts,
    reward,
    sft_examples,
)
from miles_async.trainer.packing import TrainSample, num_trained_tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny")))


def _score(sample: object) -> float:
    return asyncio.run(reward(sample))  # type: ignore[arg-type]


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
    for p, ex in zip(batch, sft_examples(batch, tokenizer)):
        assert ex.prompt_id == p.prompt_id
        assert ex.tokens[: len(p.input_ids)] == p.input_ids
        assert ex.tokens[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ex.tokens[len(p.input_ids):], skip_special_tokens=True) == p.answer
        assert ex.loss_mask == [0] * len(p.input_ids) + [1] * (len(p.answer) + 1)
        sample = TrainSample(tokens=ex.tokens, loss_mask=ex.loss_mask, rollout_logprobs=[0.0] * len(ex.tokens))
        sample.check()
        assert num_trained_tokens(sample) == len(p.answer) + 1


def test_sft_needs_an_eos(tokenizer: Tokenizer) -> None:
    @dataclass
    class NoEos:
        eos_token_id: int | None = None

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [1]

    with pytest.raises(ValueError, match="eos_token_id"):
        sft_examples(prompts(ReverseTaskConfig(), 1, tokenizer), NoEos())


def test_reward_is_exact() -> None:
    prompt = Prompt(prompt_id=0, text="r:fjqk=", input_ids=[], answer="kqjf")
    for right in ("kqjf", " kqjf\n", f"kqjf{IM_END}", f"kqjf{IM_END}{PAD_TOKEN}", f"kqjf\n{IM_END}\n"):
        assert _score(Completion(prompt=prompt, output_text=right)) == 1.0, right
    for wrong in ("", "kqj", "kqjff", "fjqk", "k q j f", "KQJF", f"{IM_END}kqjf", f"kqjf{IM_END}x", "kqjf."):
        assert _score(Completion(prompt=prompt, output_text=wrong)) == 0.0, wrong


def test_reward_accepts_any_object_with_the_two_fields() -> None:
    @dataclass
    class EngineSample:
        prompt: Prompt
        output_text: str
        reward: float = 0.0

    prompt = Prompt(prompt_id=0, text="r:fjqk=", input_ids=[], answer="kqjf")
    assert _score(EngineSample(prompt=prompt, output_text="kqjf")) == 1.0


def test_reward_refuses_malformed_samples() -> None:
    prompt = Prompt(prompt_id=0, text="r:fjqk=", input_ids=[], answer="kqjf")

    @dataclass
    class Sample:
        prompt: object
        output_text: object

    with pytest.raises(ValueError, match="sample.prompt"):
        _score(Sample(prompt={"answer": "kqjf"}, output_text="kqjf"))
    with pytest.raises(ValueError, match="sample.output_text"):
        _score(Sample(prompt=prompt, output_text=None))
    with pytest.raises(ValueError, match="sample.output_text"):
        _score(Sample(prompt=prompt, output_text=[1, 2]))
    with pytest.raises(ValueError, match="sample.prompt"):
        _score(object())


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
