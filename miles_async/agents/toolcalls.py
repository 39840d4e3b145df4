"""Tool calls in a model's text: Qwen 2.5's `<tool_call>` blocks, read into OpenAI's shape.

The chat template of `miles_async.models.tokenizer` (ChatML with Qwen 2.5's tool format) asks the
model to answer a tool call as

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

`parse_tool_calls(text)` returns the content (the text outside the well-formed blocks) and the
calls, each as OpenAI's {id, type: "function", function: {name, arguments: JSON string}}. A block
that is not valid JSON, lacks a name, or is never closed stays in the content, word for word, and
is reported (`scan_tool_calls(text).errors`, and a log line): an agent harness sees what the
model wrote instead of a crash or a silently dropped call.

Try it: `python -c "from miles_async.agents.toolcalls import parse_tool_calls as p;
print(p('Let me add.\\n<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1}}\\n</tool_call>'))"`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

import msgspec

log = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class ToolCallFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention)


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call, in OpenAI's chat.completion shape (`msgspec.to_builtins` gives its JSON)."""

    id: str
    function: ToolCallFunction
    type: str = "function"


class ToolCallParse(msgspec.Struct, frozen=True, kw_only=True):
    content: str
    tool_calls: list[ToolCall]
    errors: list[str]  # one line per malformed block, naming what is wrong with it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_tool_calls(text: str) -> ToolCallParse:
    """Split `text` into content and well-formed tool calls; list the malformed blocks.

    Content is the text outside the well-formed blocks, with the whitespace just before each block
    removed (the newline the template puts between content and a call) and, when there are calls,
    its trailing whitespace too. Without calls the content is `text` unchanged.
    """
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call, error = _read_block(match.group(1))
        if call is None:
            errors.append(f"tool call at character {match.start()}: {error}")
            continue  # the malformed block stays in the content
        pieces.append(text[position:match.start()].rstrip())
        calls.append(call)
        position = match.end()
    pieces.append(text[position:])
    unclosed = text.find(TOOL_CALL_OPEN, position)
    if unclosed >= 0 and _BLOCK.search(text, unclosed) is None:
        errors.append(f"tool call at character {unclosed}: {TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}")
    content = "".join(pieces)
    if calls:
        content = content.rstrip()
    return ToolCallParse(content=content, tool_calls=calls, errors=errors)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a model's text; malformed blocks stay in the content and are logged."""
    parsed = scan_tool_calls(text)
    for error in parsed.errors:
        log.warning("malformed %s", error)
    return parsed.content, parsed.tool_calls


def _read_block(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object with name and arguments, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "no function name (a non-empty string under \"name\")"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            return None, f"arguments of {name!r} is a string that does not hold a JSON object"
        arguments_text = arguments
    elif isinstance(arguments, dict):
        # json.dumps with its default separators is what the template's tojson writes: a call the
        # model wrote in the template's own format renders back to the same text.
        arguments_text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None, f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=arguments_text)), ""
