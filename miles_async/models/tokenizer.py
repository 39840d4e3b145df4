"""Tokenizers: build a small one offline, and load any Hugging Face `tokenizer.json` folder.

`build_tokenizer` makes the tokenizer of the models `init_model` writes. It is a byte-level BPE
(the scheme of GPT-2, Llama 3 and Qwen) trained by the `tokenizers` library on a small corpus
built into this module, because:
- byte-level means every string encodes, with no unknown token, and decodes back exactly: the
  property TITO needs, whatever text an agent or a tool produces;
- digits are split one by one (as Qwen does), so the arithmetic of toy RL tasks is learnable by a
  tiny model and numbers tokenise the same way wherever they appear;
- a few hundred learned merges keep ordinary text about 2-3x shorter than bytes, so rollouts of a
  tiny model stay cheap, while the vocabulary (and the embedding) stays small;
- training on a fixed corpus is deterministic: the same call gives the same tokenizer.json.
Its special tokens are Qwen's ChatML ones (<|endoftext|> is the pad token, <|im_end|> the end of
a turn and the eos token), plus the tool-call and think tags as ordinary added tokens, and its chat
template (`CHAT_TEMPLATE`) is ChatML with Qwen 2.5's tool-call format.

`load_tokenizer(path)` wraps any folder's tokenizer.json with what the engine and the session
server need (encode, decode, eos ids, the chat template rendered with jinja2), without
transformers.

Try it: `python -c "from miles_async.models.tokenizer import build_tokenizer as b;
print(b().encode('12 + 34 = 46').tokens)"`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
# Added but not special: they must survive decode(skip_special_tokens=True), as in Qwen.
TAG_TOKENS: tuple[str, ...] = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"
)
DEFAULT_VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('only the first message may be a system message') }}"
    "{%- endif %}"
    "{%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- raise_exception('unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROSE = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. It is trained first on a large amount of text, and then it is taught to
follow instructions and to answer questions in a conversation with a user.
Reinforcement learning improves the model further: the model writes several answers to the same
question, a reward function scores each answer, and the answers that score better than the others
of their group become more likely. The policy is updated, the new weights are sent to the
inference engines, and the engines keep generating while the trainer trains.
You are a helpful assistant. Please think step by step, then give the final answer.
What is the sum of these numbers? Let me add them one at a time. The answer is correct.
Solve the problem and put your final answer in a box. Reverse the string. Sort the list.
Count the letters in the word. Which number is larger? The result is even, so it is divisible
by two. First, second, third, fourth, fifth. One, two, three, four, five, six, seven, eight,
nine, ten, eleven, twelve, hundred, thousand, million.
I will call the calculator tool to check the result. The tool returned an error, so I will try
again with different arguments. The search tool found three documents about the question.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
Hello! How can I help you today? Thank you, that was very useful. Good morning, good night.
Yes, no, maybe, true, false, left, right, up, down, before, after, because, however, therefore.
"""


def training_corpus() -> list[str]:
    """The fixed text the BPE is trained on: prose, code, JSON, arithmetic and chat turns."""
    rng = random.Random(0)
    lines = _PROSE.splitlines()
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {result}. The answer is {result}.")
    for question in ("What is 2 + 2?", "Reverse the word 'cat'.", "Name a prime number."):
        lines.append(f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n")
    return lines


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> HFTokenizer:
    """Train the byte-level BPE described in the module docstring (deterministic).

    The vocabulary holds the special tokens (ids 0, 1, 2), the 256 byte symbols, the learned
    merges, then the tag tokens; it may come out smaller than `vocab_size` if the corpus runs out
    of pairs to merge.
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + 256 bytes), got {vocab_size}")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tokenizer


def write_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> HFTokenizer:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


class Tokenizer:
    """A Hugging Face tokenizer folder, read with `tokenizers` and jinja2 only.

    encode() adds no special tokens by default: the chat template already writes every one the
    model expects, and adding a BOS again would double it. decode() keeps special tokens by
    default, so that decode(encode(text)) == text for any text, chat markup included.
    """

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], generation_config: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.eos_token_id = self._id_of(self.eos_token) if self.eos_token else None
        if self.eos_token_id is None:
            self.eos_token_id = _first_id(generation_config.get("eos_token_id"))
        self.bos_token_id = self._id_of(self.bos_token) if self.bos_token else None
        self.pad_token_id = self._id_of(self.pad_token) if self.pad_token else None
        generation_eos = generation_config.get("eos_token_id")
        ids = [self.eos_token_id, *(generation_eos if isinstance(generation_eos, list) else [generation_eos])]
        # Every id that ends generation: the tokenizer's eos and the generation config's.
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer can produce, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} named in tokenizer_config.json is not in tokenizer.json")
        return token_id

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation as text, as transformers' apply_chat_template(tokenize=False) does."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=[dict(m) for m in messages],
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **template_kwargs,
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder: tokenizer.json, tokenizer_config.json (special tokens,
    chat template), chat_template.jinja if present (transformers 5 writes the template there), and
    generation_config.json's eos ids."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder} has no tokenizer.json (only fast, tokenizers-format tokenizers are read)")
    config = _read_json(folder / "tokenizer_config.json")
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    return Tokenizer(
        HFTokenizer.from_file(str(folder / "tokenizer.json")),
        config,
        _read_json(folder / "generation_config.json"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    """A token named in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    return token.get("content") if isinstance(token, dict) else token


def _first_id(ids: int | list[int] | None) -> int | None:
    return ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None


_TEMPLATES: dict[str, Any] = {}


def _generation_tag(jinja2: Any) -> type:
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it): render the body."""

    class GenerationTag(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def _compile_template(source: str) -> Any:
    """Compile with the sandbox, filters and globals transformers gives chat templates."""
    if source in _TEMPLATES:
        return _TEMPLATES[source]
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1'") from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes <, > and & for HTML; chat templates want plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_tag(jinja2)]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
