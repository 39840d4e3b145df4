"""Your prompts and answers as a task: a JSONL, JSON or Parquet file, a `datasets` folder or a Hub dataset.

    [task]
    plugin = "dataset"                    # this module's DatasetTask
    [task.config]                         # DatasetTaskConfig
    path = "data/train.jsonl"             # beside the recipe; or "openai/gsm8k" with name = "main"
    prompt_key = "question"
    label_key = "answer"
    eval_fraction = 0.05                  # or eval_path = "data/test.jsonl", or eval_split = "test"
    reward = "math"                       # "exact", "regex:PATTERN", "package.module:function"

Where the rows come from (`path`): a `.jsonl` file (one JSON object a line), a `.json` file (a
list of objects, or `{"data": [...]}`), a `.parquet` file, a folder written by `datasets`'
`save_to_disk` (a Dataset, or a DatasetDict and its `split`), or a Hub dataset id `org/name`
with its subset (`name`) and `split`, loaded by `datasets.load_dataset` (its cache, `HF_HOME`,
`HF_TOKEN`, `HF_HUB_OFFLINE`). JSONL and JSON need nothing more; the others need the `[data]` extra.
A relative path in a recipe file is taken from the recipe's folder (actors.recipe).

Each row gives a prompt, a string under `prompt_key` (the user's message, through `prompt_format`)
or a chat under `messages_key` (a list of {"role", "content"}), and a label under `label_key` (a
string, or a number). With `chat_template = true` the prompt is the model's chat template over
the conversation (`system_prompt` first, when the row has no system message of its own) with the
generation prompt; with false it is the raw text (the system prompt, a blank line, the message),
encoded as the model's tokenizer encodes plain text (its BOS, if it adds one).

The held-out rows ("probe": the evaluations and the SFT warm start's stop rule) are `eval_path`'s
rows, the `eval_split` of a Hub dataset or DatasetDict, or else the fraction `eval_fraction` of
`path`'s rows (5% by default) picked by a stable hash of the row's prompt and `seed`: the same
rows whatever the file's order, the process or the count asked for. A training row whose prompt is
also a held-out one is left out, so nothing held out is trained on. Both splits are shuffled by
`seed` (`shuffle`); `items(split, count)` gives the first `count` (all, when the split holds
fewer: the run cycles through them).

The reward (`miles_async.tasks.rewards`) compares the completion, less a trailing end-of-text
token, with the row's label. SFT examples (the warm start): the prompt's ids, then the label's
and the end-of-turn token (EOS), the loss on the label and EOS, as the engine would have sampled
them: useful when the labels are full answers (GSM8K's rationales).

Every row is checked when the task first reads its data (the run's pre-flight, before the run
folder is made): a missing file or Hub dataset, a row without the prompt or the label, of the
wrong type, or with an empty prompt, is one `ValueError` line naming the file and line (JSONL) or
record (JSON, Parquet, datasets); with the "math" reward, so is a label of a split's first 32 rows
that math-verify reads no answer in (label_key naming the wrong column). Rollout workers never
read the data: an item carries its prompt's token ids and its label.

Try it:
    from miles_async.models import load_tokenizer
    from miles_async.models.smollm2 import smollm2_checkpoint
    from miles_async.tasks.dataset import DatasetTask, DatasetTaskConfig
    task = DatasetTask(DatasetTaskConfig(path="recipes/data/word-problems-train.jsonl",
                                         prompt_key="question"), load_tokenizer(smollm2_checkpoint()))
    print(task.items("probe", 2))
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import json
import logging
import random
import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import msgspec

from miles_async.task import Completion, Split
from miles_async.tasks import rewards

log = logging.getLogger("miles_async.tasks.dataset")

DEFAULT_EVAL_FRACTION = 0.05
NUM_LABELS_CHECKED = 32  # the "math" reward: labels of each split's first rows that math-verify must read
EXTRA = "pip install 'miles-async[data]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_TYPES = (".jsonl", ".ndjson", ".json", ".parquet")

Prompt = str | list  # a message's text, or a chat (a list of {"role", "content"})


class DatasetTaskConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the rows are, how to read them, which are held out and how an answer is scored (module docstring)."""

    path: str = ""  # a .jsonl / .json / .parquet file, a save_to_disk folder, or a Hub dataset id org/name
    name: str = ""  # a Hub dataset's subset (its config), e.g. GSM8K's "main"; "" for none
    split: str = "train"  # the split to train on, of a Hub dataset or a save_to_disk DatasetDict
    prompt_key: str = "prompt"  # the column with the user's message (a string)
    messages_key: str = ""  # or the column with a chat (a list of {"role", "content"}): then prompt_key is not read
    label_key: str = "answer"  # the column with the answer the reward compares with (a string or a number)
    system_prompt: str = ""  # a system message put first ("" leaves the chat template's default)
    # The user's message made from the row's prompt: "{prompt}" is replaced by it (nothing else is
    # read, so LaTeX braces need no escaping), e.g. "{prompt}\nPut your final answer within \\boxed{}."
    prompt_format: str = "{prompt}"
    chat_template: bool = True  # render with the tokenizer's chat template and its generation prompt; false: raw text
    chat_template_kwargs: dict[str, Any] = {}  # given to the chat template, e.g. {enable_thinking = false} for Qwen3
    # The held-out rows, one of: a file (or folder, or Hub id) of their own; a split of the Hub
    # dataset or DatasetDict; the fraction of `path`'s rows a stable hash of the prompt picks
    # (none of the three: 5%).
    eval_path: str = ""
    eval_split: str = ""  # the held-out rows: this split of the Hub dataset or DatasetDict; "": none
    eval_fraction: float | None = None  # or this share of `path`'s rows, in (0, 1); unset: 0.05 (no eval_*)
    reward: str = "math"  # "math" | "exact" | "regex:PATTERN" | "package.module:function" (tasks/rewards.py)
    # A score that takes longer is 0 (and logged): math-verify's own timeout, signal-based, cannot
    # run in the worker thread that grades (tasks/rewards.py).
    reward_timeout_s: float = 10.0
    shuffle: bool = True  # shuffle each split (by seed); false keeps the file's order
    seed: int = 0  # of that shuffle and of the hash that picks the eval_fraction rows

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("task.config.path is empty: name a .jsonl, .json or .parquet file, a save_to_disk folder "
                             "or a Hub dataset id (org/name)")
        rewards.check_name(self.reward)
        sources = [name for name, value in (("eval_path", self.eval_path), ("eval_split", self.eval_split),
                                            ("eval_fraction", self.eval_fraction)) if value not in ("", None)]
        if len(sources) > 1:
            raise ValueError(f"task.config.{' and task.config.'.join(sources)} both name the held-out rows: keep one")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ValueError(f"task.config.eval_fraction must be between 0 and 1 (exclusive), got {self.eval_fraction}")
        if "{prompt}" not in self.prompt_format:
            raise ValueError(f"task.config.prompt_format must contain {{prompt}} (where the row's prompt goes), got "
                             f"{self.prompt_format!r}")
        if self.messages_key and not self.chat_template:
            raise ValueError(f"task.config.messages_key = {self.messages_key!r} reads a chat, which needs the chat "
                             "template: set task.config.chat_template = true, or use prompt_key for raw text")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"task.config.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if (not self.prompt_key and not self.messages_key) or not self.label_key:
            raise ValueError("task.config.prompt_key (or messages_key) and task.config.label_key must name columns")


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One item: the row's index in its file or split, its prompt's token ids and its label."""

    row_id: int
    input_ids: list[int]
    label: str


@dataclass(frozen=True, slots=True)
class Record:
    """A checked row of a source, before it is rendered."""

    where: str  # "file:line", "file: record N" or "dataset org/name (split): row N": for error messages
    row_id: int
    prompt: Prompt
    label: str


# ----- reading the rows -----

def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _import_datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"{what} needs the datasets package: {EXTRA}") from e
    return datasets


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    out = []
    for number, line in enumerate(_text(path).split("\n"), start=1):  # not splitlines(): U+2028 is text in JSON
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    return out


def _read_json(path: Path) -> list[tuple[str, Any]]:
    text = _text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object a line, named .json: read it as what it is
            return _read_jsonl(path)
        raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        keys = f" with keys {sorted(data)[:8]}" if isinstance(data, dict) else ""
        raise ValueError(f"{path}: a JSON file must hold a list of rows or {{\"data\": [...]}}, got "  # noqa: TRY004
                         f"{type(data).__name__}{keys}")
    return [(f"{path}: record {i}", record) for i, record in enumerate(data)]


def _read_parquet(path: Path, columns: list[str]) -> list[tuple[str, Any]]:
    _import_datasets(f"reading {path}")  # pyarrow comes with it
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=_present(pq.read_schema(path).names, columns, str(path)))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a Parquet file pyarrow can read ({_one_line(e)})") from e
    return [(f"{path}: record {i}", record) for i, record in enumerate(table.to_pylist())]


def _present(names: Sequence[str], columns: list[str], source: str) -> list[str]:
    """`columns`, once each is one of `names` (a table's columns); ValueError naming a missing one."""
    for column in columns:
        if column not in names:
            close = difflib.get_close_matches(column, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{source} has no column {column!r}{hint}; its columns: {', '.join(names)}")
    return columns


def _rows_of(dataset: Any, columns: list[str], source: str) -> list[tuple[str, Any]]:
    """The rows of a `datasets.Dataset`, its needed columns only."""
    table = dataset.select_columns(_present(dataset.column_names, columns, source))
    return [(f"{source}: row {i}", record) for i, record in enumerate(table.to_list())]


def _read_folder(path: Path, split: str, columns: list[str]) -> list[tuple[str, Any]]:
    if not any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
        raise ValueError(f"{path} is a folder but not one written by datasets' save_to_disk (no dataset_dict.json or "
                         "state.json): name a file in it, or save the dataset with save_to_disk")
    datasets = _import_datasets(f"reading {path}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise ValueError(f"{path}: datasets cannot read it ({_one_line(e)})") from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path} has no split {split!r}; its splits: {', '.join(loaded)}")
        return _rows_of(loaded[split], columns, f"{path} ({split})")
    return _rows_of(loaded, columns, str(path))


def _read_hub(repo: str, name: str, split: str, columns: list[str], what: str) -> list[tuple[str, Any]]:
    datasets = _import_datasets(f"the Hub dataset {repo!r}")
    from huggingface_hub import constants

    try:
        loaded = datasets.load_dataset(repo, name or None, split=split)
    except ConnectionError as e:
        offline = " (HF_HUB_OFFLINE is set: only datasets already in the datasets cache load)" \
            if constants.HF_HUB_OFFLINE else ""
        raise ValueError(f"{what} {repo!r}: no such file, and the Hub dataset cannot be reached{offline}: "
                         f"{_one_line(e)}") from e
    except datasets.exceptions.DatasetNotFoundError as e:
        raise ValueError(f"{what} {repo!r} is not a local file nor a dataset on the Hub (a gated or private one needs "
                         f"HF_TOKEN): {_one_line(e)}") from e
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # a subset or split it does not have, ...
        raise ValueError(f"{what} {repo!r} (name {name!r}, split {split!r}): {_one_line(e)}") from e
    return _rows_of(loaded, columns, f"dataset {repo}" + (f"/{name}" if name else "") + f" ({split})")


def read_source(path: str, *, name: str, split: str, columns: list[str], what: str,
                strict: bool = True) -> list[tuple[str, Any]]:
    """(where, record) of every row of `path` (module docstring); ValueError naming what is wrong.
    `name` and `split` are a Hub dataset's (a folder reads `split` only); `strict` refuses them for
    a local file or folder that has no use for them (`eval_path` is read with the training set's)."""
    local = Path(path)
    if local.is_dir():
        if name and strict:
            raise ValueError(f"task.config.name ({name!r}) picks a subset of a Hub dataset, but {what} {path!r} is a "
                             "folder: remove it")
        return _read_folder(local, split, columns)
    if local.is_file():
        if strict and (name or split != "train"):
            raise ValueError(f"{what} {path!r} is a file: task.config.name and split pick a subset and split of a Hub "
                             "dataset or save_to_disk folder; remove them (a file's held-out rows come from eval_path "
                             "or eval_fraction)")
        suffix = local.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            return _read_jsonl(local)
        if suffix == ".json":
            return _read_json(local)
        if suffix == ".parquet":
            return _read_parquet(local, columns)
        raise ValueError(f"{what} {path!r}: cannot tell how to read a {suffix or 'suffix-less'} file; use "
                         f"{', '.join(_FILE_TYPES)}, a save_to_disk folder or a Hub dataset id")
    if _HUB_ID.match(path) and not path.lower().endswith(_FILE_TYPES):
        return _read_hub(path, name, split, columns, what)
    raise ValueError(f"{what} {path!r} does not exist (a relative path in a recipe file is taken from the recipe's "
                     "folder, on the command line from the working directory), and is no Hub dataset id (org/name)")


# ----- checking a row -----

def _key_error(where: str, record: dict[str, Any], key: str, setting: str) -> ValueError:
    close = difflib.get_close_matches(key, [str(k) for k in record], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"{where}: the row has no {key!r} (task.config.{setting}){hint}; it has: "
                      f"{', '.join(map(str, record)) or 'nothing'}")


def _check_messages(where: str, key: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{\"role\", \"content\"}} messages, got "
                         f"{type(value).__name__}" + (" (empty)" if value == [] else ""))
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: {key!r} message {i} must be an object with a string \"role\" and "  # noqa: TRY004
                             f"a string \"content\", got {message!r:.80}")
    if not any(m["content"].strip() for m in value):
        raise ValueError(f"{where}: {key!r} has no message with any text")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_record(config: DatasetTaskConfig, where: str, row_id: int, record: Any) -> Record:
    """A row read from a source, checked (module docstring); ValueError naming where it is."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a row must be an object (a JSON object, a table's row), "  # noqa: TRY004
                         f"got {type(record).__name__}")
    prompt_key = config.messages_key or config.prompt_key
    if prompt_key not in record:
        raise _key_error(where, record, prompt_key, "messages_key" if config.messages_key else "prompt_key")
    value = record[prompt_key]
    prompt: Prompt
    if config.messages_key:
        prompt = _check_messages(where, prompt_key, value)
    else:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {prompt_key!r} must be a string, got {type(value).__name__}"
                             + (" (a chat? set task.config.messages_key)" if isinstance(value, list) else ""))
        if not value.strip():
            raise ValueError(f"{where}: {prompt_key!r} is empty")
        prompt = value
    if config.label_key not in record:
        raise _key_error(where, record, config.label_key, "label_key")
    label = record[config.label_key]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ValueError(f"{where}: {config.label_key!r} (the label) must be a string or a number, got "  # noqa: TRY004
                         f"{type(label).__name__}")
    label = str(label)
    if not label.strip():
        raise ValueError(f"{where}: {config.label_key!r} (the label) is empty")
    return Record(where=where, row_id=row_id, prompt=prompt, label=label)


def prompt_hash(prompt: Prompt, seed: int) -> float:
    """A number in [0, 1) fixed by the prompt and the seed (not Python's salted hash(): it survives processes)."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    digest = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64


# ----- the task -----

class DatasetTask:
    """The task plug-in (`miles_async.task.Task`) over a dataset's rows (module docstring)."""

    Config: ClassVar[type[msgspec.Struct]] = DatasetTaskConfig
    Item: ClassVar[type] = Row
    multi_turn = False

    def __init__(self, config: DatasetTaskConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.score = rewards.reward_fn(config.reward)  # a user's function is imported here: an error is one line
        self._score_async = rewards.is_async(self.score)
        self._in_thread = not self._score_async and config.reward != "exact" and not config.reward.startswith("regex:")
        self._splits: dict[str, list[Record]] | None = None
        # Text an engine leaves at the end when it decodes the stop token (it is not the answer).
        ends = (getattr(tokenizer, "eos_token", None), getattr(tokenizer, "pad_token", None))
        self._end_texts = tuple(t for t in ends if t)

    # -- the data (read once, on first use: the pre-flight's items() call) --

    def _columns(self) -> list[str]:
        return [self.config.messages_key or self.config.prompt_key, self.config.label_key]

    def _records(self, path: str, split: str, what: str) -> list[Record]:
        read = read_source(path, name=self.config.name, split=split, columns=self._columns(), what=what,
                           strict=what == "task.config.path")
        if not read:
            raise ValueError(f"{what} {path!r} holds no rows")
        return [check_record(self.config, where, i, record) for i, (where, record) in enumerate(read)]

    def _load(self) -> dict[str, list[Record]]:
        cfg = self.config
        train = self._records(cfg.path, cfg.split, "task.config.path")
        if cfg.eval_path:
            probe = self._records(cfg.eval_path, cfg.split, "task.config.eval_path")
        elif cfg.eval_split:
            if Path(cfg.path).is_file():
                raise ValueError(f"task.config.eval_split ({cfg.eval_split!r}) names a split of a Hub dataset or "
                                 f"save_to_disk folder, but {cfg.path!r} is a file: use eval_path or eval_fraction")
            probe = self._records(cfg.path, cfg.eval_split, "task.config.path")
        else:
            fraction = DEFAULT_EVAL_FRACTION if cfg.eval_fraction is None else cfg.eval_fraction
            probe = [r for r in train if prompt_hash(r.prompt, cfg.seed) < fraction]
        held_out = {json.dumps(r.prompt, sort_keys=True) for r in probe}
        kept = [r for r in train if json.dumps(r.prompt, sort_keys=True) not in held_out]
        if len(kept) < len(train) and (cfg.eval_path or cfg.eval_split):
            log.info("dataset: %d training row(s) left out: their prompts are held-out ones", len(train) - len(kept))
        splits = {"train": kept, "probe": probe}
        if cfg.shuffle:
            for split, records in splits.items():
                random.Random(f"dataset:{cfg.seed}:{split}").shuffle(records)
        if cfg.reward == "math":
            for record in (*kept[:NUM_LABELS_CHECKED], *probe[:NUM_LABELS_CHECKED]):
                if not rewards.parses(record.label):
                    raise ValueError(f"{record.where}: math-verify reads no answer in the label {record.label!r:.80} "
                                     f"(task.config.label_key = {cfg.label_key!r}): point label_key at the answers, "
                                     "or use another reward")
        return splits

    def records(self, split: Split) -> list[Record]:
        """Every checked row of `split`, in the task's order."""
        if split not in ("train", "probe"):
            raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
        if self._splits is None:
            self._splits = self._load()
        return self._splits[split]

    def prompt_text(self, prompt: Prompt) -> str:
        """The prompt as the model reads it (module docstring)."""
        cfg = self.config
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        if isinstance(prompt, list):
            messages = prompt if prompt[0]["role"] == "system" else [*system, *prompt]
        else:
            message = cfg.prompt_format.replace("{prompt}", prompt)
            if not cfg.chat_template:
                return f"{cfg.system_prompt}\n\n{message}" if cfg.system_prompt else message
            messages = [*system, {"role": "user", "content": message}]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **cfg.chat_template_kwargs)
        except Exception as e:  # the model's own template (jinja2) failed: said in one line
            raise ValueError(f"task.config.chat_template: the model's chat template cannot render this prompt "
                             f"({type(e).__name__}: {_one_line(e)}); set chat_template = false for raw text") from e

    def items(self, split: Split, count: int) -> list[Row]:
        """The first `count` rows of `split` (all, if it holds fewer); ValueError if it holds none."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        records = self.records(split)
        if not records:
            raise ValueError(f"the {split} split of task.config.path {self.config.path!r} is empty: "
                             + ("every row is held out" if split == "train" else "raise task.config.eval_fraction or "
                                "name eval_path"))
        raw = not self.config.chat_template
        items = []
        for record in records[:count]:
            ids = self.tokenizer.encode(self.prompt_text(record.prompt), add_special_tokens=raw)
            items.append(Row(row_id=record.row_id, input_ids=ids, label=record.label))
        return items

    def prompt_ids(self, item: Row) -> list[int]:
        return item.input_ids

    def answer_text(self, completion: Completion) -> str:
        """The completion's text without a trailing end-of-text token."""
        text = completion.text.rstrip()
        while self._end_texts and text.endswith(self._end_texts):
            end = next(end for end in self._end_texts if text.endswith(end))
            text = text[:-len(end)].rstrip()
        return text

    async def reward(self, item: Row, completion: Completion) -> float:
        text = self.answer_text(completion)
        if self._score_async:
            pending = cast("Awaitable[float]", self.score(text, item.label))
        elif self._in_thread:  # "math" (SymPy work) and a user's plain function: off the event loop
            pending = asyncio.to_thread(self.score, text, item.label)
        else:  # "exact", "regex:": a string compare, on the loop
            return float(cast("float", self.score(text, item.label)))
        try:
            return float(await asyncio.wait_for(pending, self.config.reward_timeout_s))
        except asyncio.TimeoutError:
            log.warning("reward %s took over %.0f s on row %d: scored 0", self.config.reward,
                        self.config.reward_timeout_s, item.row_id)
            return 0.0

    def sft_examples(self, items: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id: an SFT example of a label must end in it")
        out = []
        for item in items:
            reply = [*self.tokenizer.encode(item.label), eos]
            out.append(([*item.input_ids, *reply], [0] * len(item.input_ids) + [1] * len(reply)))
        return out
