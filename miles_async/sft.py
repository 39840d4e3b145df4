"""Supervised fine-tuning data: a JSONL file of conversations or prompt/response pairs, as token
ids with a loss mask over what the model should learn to say.

One JSON object per line, in one of these shapes:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...],
     "tools": [...]}                                     # tools optional, as OpenAI's chat API has them
    {"prompt": "...", "response": "..."}                 # or "completion" for "response" (TRL's name)

A conversation is rendered with the model's chat template (`models.tokenizer`), turn by turn: the
mask is 1 on each assistant message up to and including its end-of-turn token and 0 on
everything else (system, user and tool messages, the template's glue), which is what the
engine's sampling would have produced after the prompt. A pair is the conversation of one user
message and one assistant reply; with `chat_template = false` it is instead the prompt's ids
followed by the response's ids and EOS, each encoded apart, the way the engine continues a
prompt given as ids (recipes/reverse.toml's task reads its prompts so).

A line that is not such an object is refused naming its line number and what is wrong with it;
an example longer than `max_tokens`, or with nothing to learn, is left out and counted.

Try it:
    data = load_sft_data(SFTDataConfig(path="train.jsonl"), load_tokenizer(model_dir))
    tokens, mask = data.examples[0]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

Example = tuple[list[int], list[int]]  # (token ids, loss mask)


class SFTDataConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A recipe's `[data]`: the file and how to read it."""

    path: str = ""  # the JSONL file; a relative path: beside the recipe if there, else from the cwd
    chat_template: bool = True  # render through the model's chat template (pairs may opt out)
    max_tokens: int = 4096  # longer examples are left out (and counted)
    num_heldout: int = 0  # examples set aside (the file's last ones) for a held-out loss

    def __post_init__(self) -> None:
        if self.max_tokens < 2 or self.num_heldout < 0:
            raise ValueError(f"data.max_tokens must be >= 2 and data.num_heldout >= 0, got {self.max_tokens} "
                             f"and {self.num_heldout}")


@dataclass(frozen=True)
class SFTData:
    examples: list[Example]  # to train on, in file order
    heldout: list[Example]  # the last `num_heldout` usable examples of the file
    too_long: int  # left out: longer than max_tokens
    nothing_to_learn: int  # left out: no token under the mask

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens, _ in self.examples)


def load_sft_data(config: SFTDataConfig, tokenizer: Any) -> SFTData:
    """Read and tokenize `config.path` (module docstring); ValueError naming the line on bad input."""
    if not config.path:
        raise ValueError("data.path is empty: name the JSONL file of examples to train on")
    path = Path(config.path)
    if not path.is_file():
        raise ValueError(f"data.path {str(path)!r} is not a file")
    examples: list[Example] = []
    too_long = nothing = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                tokens, mask = example_from_record(record, tokenizer, chat_template=config.chat_template)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            if len(tokens) > config.max_tokens:
                too_long += 1
            elif not any(mask[1:]):  # the first token is never trained (nothing predicts it)
                nothing += 1
            else:
                examples.append((tokens, mask))
    if len(examples) <= config.num_heldout:
        raise ValueError(f"{path} has {len(examples)} usable example(s) ({too_long} longer than {config.max_tokens} "
                         f"tokens, {nothing} with nothing to learn); data.num_heldout is {config.num_heldout}")
    cut = len(examples) - config.num_heldout
    return SFTData(examples=examples[:cut], heldout=examples[cut:], too_long=too_long, nothing_to_learn=nothing)


def example_from_record(record: Any, tokenizer: Any, *, chat_template: bool = True) -> Example:
    """(token ids, loss mask) of one JSONL record (module docstring)."""
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object with \"messages\" or \"prompt\" and \"response\", got "  # noqa: TRY004 - bad input
                         f"{type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("\"messages\" must be a list of objects with a \"role\"")
        if not chat_template:
            raise ValueError("a conversation (\"messages\") needs the chat template: set data.chat_template = true")
        return chat_example(tokenizer, messages, record.get("tools"))
    response_key = "response" if "response" in record else "completion"
    if not isinstance(record.get("prompt"), str) or not isinstance(record.get(response_key), str):
        raise ValueError(f"a line needs \"messages\", or a string \"prompt\" and a string \"response\" (or "  # noqa: TRY004
                         f"\"completion\"); it has {sorted(record)}")
    prompt, response = record["prompt"], record[response_key]
    if chat_template:
        return chat_example(tokenizer, [{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": response}])
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: a response must end in it")
    prompt_ids, response_ids = tokenizer.encode(prompt), [*tokenizer.encode(response), eos]
    return [*prompt_ids, *response_ids], [0] * len(prompt_ids) + [1] * len(response_ids)


def chat_example(tokenizer: Any, messages: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]] | None = None) -> Example:
    """(token ids, loss mask) of a conversation rendered with the chat template: the mask is 1 on
    each assistant message up to and including its end-of-turn token (EOS), 0 elsewhere.

    Each assistant turn is found as the difference between the conversation rendered up to it
    (with the generation prompt) and through it; a template that rewrites earlier turns as the
    conversation grows (not append-only) is refused.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message: nothing to learn")
    end_id = tokenizer.eos_token_id
    tokens: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = tokenizer.encode(tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True))
        full = tokenizer.encode(tokenizer.apply_chat_template(messages[:i + 1], tools=tools))
        if full[:len(tokens)] != tokens or prefix[:len(tokens)] != tokens or full[:len(prefix)] != prefix:
            raise ValueError("the chat template is not append-only for this conversation (an earlier turn "
                             "renders differently once a later one follows)")
        mask += [0] * (len(prefix) - len(tokens))
        reply = full[len(prefix):]
        cut = reply.index(end_id) + 1 if end_id in reply else len(reply)
        mask += [1] * cut + [0] * (len(reply) - cut)
        tokens = full
    tail = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))
    if tail[:len(tokens)] != tokens:
        raise ValueError("the chat template is not append-only for this conversation")
    mask += [0] * (len(tail) - len(tokens))
    return tail, mask
