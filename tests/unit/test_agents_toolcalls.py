"""Tool-call parsing (miles_async.agents.toolcalls): Qwen 2.5's <tool_call> blocks → OpenAI's shape."""

from __future__ import annotations

import json

import msgspec
import pytest

from miles_async.agents.toolcalls import parse_tool_calls, scan_tool_calls
from miles_async.models.tokenizer import CHAT_TEMPLATE, Tokenizer, build_tokenizer

pytestmark = pytest.mark.timeout(30)


def block(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_one_call_after_content():
    content, calls = parse_tool_calls("Let me add them.\n" + block("add", {"a": 1, "b": [2, 3]}))
    assert content == "Let me add them."
    (call,) = calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": [2, 3]}
    assert call.id.startswith("call_")
    assert set(msgspec.to_builtins(call)) == {"id", "type", "function"}


def test_several_calls_get_distinct_ids_and_keep_their_order():
    text = block("search", {"q": "x"}) + "\n" + block("open", {"url": "u"}) + "\n" + block("close", {})
    content, calls = parse_tool_calls(text)
    assert content == ""
    assert [c.function.name for c in calls] == ["search", "open", "close"]
    assert len({c.id for c in calls}) == 3
    assert calls[2].function.arguments == "{}"


def test_no_call_leaves_the_text_unchanged():
    text = "  The answer is 4.\n"
    assert parse_tool_calls(text) == (text, [])
    assert scan_tool_calls(text).errors == []


@pytest.mark.parametrize("body, problem", [
    ("{not json}", "not valid JSON"),
    ('["add", {}]', "expected a JSON object"),
    ('{"arguments": {"a": 1}}', "no function name"),
    ('{"name": "add", "arguments": 3}', "must be a JSON object"),
    ('{"name": "add", "arguments": "not json"}', "does not hold a JSON object"),
])
def test_a_malformed_block_stays_in_the_content_and_is_reported(body, problem):
    bad = f"<tool_call>\n{body}\n</tool_call>"
    text = "Before. " + bad + "\n" + block("ok", {"x": 1})
    parsed = scan_tool_calls(text)
    assert [c.function.name for c in parsed.tool_calls] == ["ok"]
    assert parsed.content == "Before. " + bad
    assert len(parsed.errors) == 1 and problem in parsed.errors[0]


def test_an_unclosed_block_stays_content_and_is_reported():
    text = block("first", {}) + "\n<tool_call>\n{\"name\": \"second\", \"argu"
    parsed = scan_tool_calls(text)
    assert [c.function.name for c in parsed.tool_calls] == ["first"]
    assert parsed.content == "\n<tool_call>\n{\"name\": \"second\", \"argu".rstrip()
    assert any("never closed" in e for e in parsed.errors)


def test_arguments_given_as_a_json_string_are_kept_verbatim():
    _, (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>')
    assert call.function.arguments == '{"k": 2}'


def test_a_call_in_the_templates_format_renders_back_to_the_same_text():
    """What the model writes in the template's format, parsed and rendered again, is the same text."""
    tokenizer = Tokenizer(build_tokenizer(), {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, {})
    sampled = "Checking.\n" + block("calc", {"expression": "3 * (4 + 5)", "exact": True})
    content, calls = parse_tool_calls(sampled)
    message = {"role": "assistant", "content": content, "tool_calls": [msgspec.to_builtins(c) for c in calls]}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, message])
    assert f"<|im_start|>assistant\n{sampled}<|im_end|>\n" in rendered
