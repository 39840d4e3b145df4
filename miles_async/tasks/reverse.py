"""String reversal: the demo task on which GRPO visibly learns on a CPU in about a minute.

A prompt is `r:{word}=` and the answer is the word reversed, then EOS: `r:fjqk=` -> `kqjf`.
Words are 4-6 letters drawn from a small alphabet (shared/peers/rl-demo-calibration.md: after a
short SFT warm start, stopped when sampled accuracy on a probe set reaches ~0.15, reward rises by
0.4-0.7 within 1,000 GRPO steps; sorting, addition and counting did worse).

Why the default alphabet is `fgjkmpqv`: the tokenizer of `init_model` is a byte-level BPE whose
learned merges join common letter pairs (`de`, `ed`, `th`, `in`, ...), so `r:abcdef=` would be
`r : a b c de f =`, and the answer `fedcba` `f ed c b a`. A reversal is a character-level job, and
a tiny model learns it far more easily when every letter is one token in the prompt and in the
answer. No two letters of `fgjkmpqv` are merged by that tokenizer, and `r`, `:` and `=` are
pre-tokenized apart from the word, so prompt and answer are one token per character
(tests/unit/test_tasks_reverse.py checks this against the real tokenizer). An alphabet of your
own may merge: check `len(prompt.input_ids) == len(prompt.text)`.

The plug-in (`miles_async.task`): `ReverseTask`, named in a recipe as
`plugin = "miles_async.tasks.reverse:ReverseTask"` with `[task.config]` filling
`ReverseTaskConfig`. Its items are `Prompt`s; its reward is 1.0 when the output is exactly the
answer (`is_correct`), else 0.0; its SFT examples put the loss on the answer and EOS only.

The functions under it:
- `ReverseTaskConfig`: the alphabet, word lengths, seed and which words are held out for probing.
- `prompts(config, count, tokenizer, split="train" | "probe")`: a deterministic list of distinct
  `Prompt`s. A word belongs to exactly one split (a hash of the seed and the word decides), so
  the train and probe sets never share a word, whatever counts are asked for. `prompt_id` is the
  word's index in the space of all words (stable across calls, splits and counts).
- `sft_examples(prompts, tokenizer)`: prompt + answer + EOS token ids with a loss mask over the
  answer and EOS only, for the SFT warm start.
- `is_correct(output_text, answer)`: exact match after removing surrounding whitespace and
  trailing end-of-text markers (`<|im_end|>`, `<|endoftext|>`): an engine decoding with
  skip_special_tokens=False leaves EOS in the text, and a generation cut at max tokens may lack
  it; neither should change the score.
- `probe_accuracy(outputs, prompts)`: the fraction answered exactly.

Try it:
    from miles_async.models import init_model, load_tokenizer
    from miles_async.tasks.reverse import ReverseTask, ReverseTaskConfig
    task = ReverseTask(ReverseTaskConfig(), load_tokenizer(init_model("qwen3", "tiny", "/tmp/tiny")))
    print(task.items("probe", 3))
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import msgspec

from miles_async.models.tokenizer import IM_END, PAD_TOKEN
from miles_async.task import Completion

Split = Literal["train", "probe"]
# Trailing text an engine may leave when it decodes the stop token (Qwen's and our tokenizer's).
END_MARKERS: tuple[str, ...] = (IM_END, PAD_TOKEN)
_RESERVED = frozenset("r:=")  # letters of the prompt's frame; a word made of them would read ambiguously


class ReverseTaskConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which words the task draws and how the probe set is held out."""

    alphabet: str = "fgjkmpqv"  # distinct lowercase letters, none merged by init_model's BPE
    min_len: int = 4  # shortest word, in letters
    max_len: int = 6  # longest word, in letters
    seed: int = 0  # which words are held out, and the words each split draws
    probe_every: int = 16  # about 1 word in `probe_every` belongs to the probe split
    # How word lengths are drawn: "uniform" over min_len..max_len, or "zipf": P(len) proportional
    # to (len - min_len + 1) ** -zipf_a, mostly short with a long tail (as real rollouts' lengths are).
    lengths: Literal["uniform", "zipf"] = "uniform"
    zipf_a: float = 1.5  # lengths "zipf": the exponent, > 0 (larger: shorter words)

    def __post_init__(self) -> None:
        letters = self.alphabet
        if not letters or len(set(letters)) != len(letters) or not all("a" <= c <= "z" for c in letters):
            raise ValueError(f"alphabet must be distinct lowercase ascii letters, got {letters!r}")
        if _RESERVED & set(letters):
            raise ValueError(f"alphabet {letters!r} must not contain {sorted(_RESERVED)} (the prompt's frame)")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len} max_len={self.max_len}")
        if self.lengths not in ("uniform", "zipf") or not self.zipf_a > 0:
            raise ValueError(f"lengths must be 'uniform' or 'zipf' (with zipf_a > 0), got {self.lengths!r}, "
                             f"zipf_a={self.zipf_a}")
        if self.probe_every < 2:
            raise ValueError(f"probe_every must be >= 2 (1 would put every word in the probe split), "
                             f"got {self.probe_every}")


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One question: `text` as the model sees it, its token ids, and the expected answer (no EOS)."""

    prompt_id: int
    text: str
    input_ids: list[int]
    answer: str


class SFTExample(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt, answer and EOS as one token sequence; `loss_mask` is 1 over the answer and EOS only."""

    prompt_id: int
    tokens: list[int]
    loss_mask: list[int]


class TextTokenizer(Protocol):
    """The part of `miles_async.models.tokenizer.Tokenizer` the task uses."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


def prompt_text(word: str) -> str:
    return f"r:{word}="


def num_words(config: ReverseTaskConfig) -> int:
    """How many distinct words the config can draw (both splits together)."""
    base = len(config.alphabet)
    return sum(base**length for length in range(config.min_len, config.max_len + 1))


def prompts(config: ReverseTaskConfig, count: int, tokenizer: TextTokenizer, split: Split = "train") -> list[Prompt]:
    """`count` distinct prompts of `split`, the same for the same config, count and split.

    Lengths are drawn first (`config.lengths`), then letters, so short words are not outnumbered
    by long ones.
    Raises ValueError if the split cannot supply `count` distinct words (widen the alphabet or the
    lengths, or ask for fewer).
    """
    out = []
    for word in words(config, count, split):
        text = prompt_text(word)
        out.append(Prompt(prompt_id=_word_index(config, word), text=text, input_ids=list(tokenizer.encode(text)),
                          answer=word[::-1]))
    return out


def words(config: ReverseTaskConfig, count: int, split: Split = "train") -> list[str]:
    """The words of `prompts(config, count, tokenizer, split)`, in the same order (no tokenizer needed)."""
    if split not in ("train", "probe"):
        raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    total = num_words(config)
    if count > total:
        raise ValueError(f"asked for {count} prompts but the config has only {total} words in all")
    rng = random.Random(f"reverse:{config.seed}:{split}")
    sizes = list(range(config.min_len, config.max_len + 1))
    weights = [(n - config.min_len + 1) ** -config.zipf_a for n in sizes]
    # Rejection sampling: bounded so that an impossible request fails instead of spinning.
    max_draws = 64 * count + 1024
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(max_draws):
        if len(out) == count:
            break
        length = (rng.randint(config.min_len, config.max_len) if config.lengths == "uniform"
                  else rng.choices(sizes, weights)[0])
        word = "".join(rng.choice(config.alphabet) for _ in range(length))
        if word in seen or _split_of(config, word) != split:
            continue
        seen.add(word)
        out.append(word)
    if len(out) < count:
        raise ValueError(f"found only {len(out)} distinct {split} words of {count} asked for in {max_draws} draws; "
                         "widen the alphabet or the lengths, or ask for fewer")
    return out


def write_sft_pairs(path: str | Path, count: int, config: ReverseTaskConfig | None = None) -> int:
    """Write the first `count` train-split prompts with their answers as JSONL prompt/response
    pairs, the data file of `miles-async sft` (read with `data.chat_template = false`, they encode
    as `sft_examples` does); the number written. recipes/data/reverse-sft.jsonl is
    `write_sft_pairs("recipes/data/reverse-sft.jsonl", 4000)`."""
    lines = "".join(json.dumps({"prompt": prompt_text(word), "response": word[::-1]}) + "\n"
                    for word in words(config or ReverseTaskConfig(), count))
    Path(path).write_text(lines)
    return count


def sft_examples(prompts: Sequence[Prompt], tokenizer: TextTokenizer) -> list[SFTExample]:
    """Teacher-forced examples for the SFT warm start: loss on the answer and EOS, not the prompt.

    The answer is encoded apart from the prompt, as the engine would generate it after the
    prompt's ids (token in, token out), so the trained ids are the ones sampling produces.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token_id; SFT must teach the model to stop")
    examples = []
    for prompt in prompts:
        answer_ids = [*tokenizer.encode(prompt.answer), eos_id]
        examples.append(SFTExample(prompt_id=prompt.prompt_id, tokens=[*prompt.input_ids, *answer_ids],
                                   loss_mask=[0] * len(prompt.input_ids) + [1] * len(answer_ids)))
    return examples


def is_correct(output_text: str, answer: str) -> bool:
    """Exact match after removing surrounding whitespace and trailing end-of-text markers."""
    text = output_text.strip()
    stripped = True
    while stripped:
        stripped = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                stripped = True
    return text == answer


def probe_accuracy(outputs: Sequence[str], prompts: Sequence[Prompt]) -> float:
    """The fraction of `outputs` (decoded responses, one per prompt, in order) that are correct."""
    if len(outputs) != len(prompts):
        raise ValueError(f"got {len(outputs)} outputs for {len(prompts)} prompts; give one output per prompt")
    if not prompts:
        raise ValueError("probe_accuracy needs at least one prompt")
    return sum(is_correct(o, p.answer) for o, p in zip(outputs, prompts)) / len(prompts)


def _split_of(config: ReverseTaskConfig, word: str) -> Split:
    # A stable hash (not Python's salted hash()) so that the split survives processes and restarts.
    return "probe" if zlib.crc32(f"{config.seed}:{word}".encode()) % config.probe_every == 0 else "train"


def _word_index(config: ReverseTaskConfig, word: str) -> int:
    """The word's position among all words, shorter lengths first, then in alphabet order."""
    base = len(config.alphabet)
    offset = sum(base**length for length in range(config.min_len, len(word)))
    value = 0
    for letter in word:
        value = value * base + config.alphabet.index(letter)
    return offset + value


class ReverseTask:
    """The task plug-in (`miles_async.task.Task`) over `Prompt`s of this module."""

    Config: ClassVar[type[msgspec.Struct]] = ReverseTaskConfig
    Item: ClassVar[type] = Prompt
    multi_turn = False

    def __init__(self, config: ReverseTaskConfig, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def items(self, split: Split, count: int) -> list[Prompt]:
        return prompts(self.config, count, self.tokenizer, split)

    def prompt_ids(self, item: Prompt) -> list[int]:
        return item.input_ids

    async def reward(self, item: Prompt, completion: Completion) -> float:
        return 1.0 if is_correct(completion.text, item.answer) else 0.0

    def sft_examples(self, items: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
        return [(e.tokens, e.loss_mask) for e in sft_examples(items, self.tokenizer)]

