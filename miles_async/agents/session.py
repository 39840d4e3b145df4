"""The TITO session server: an OpenAI-compatible chat endpoint that keeps the tokens agents sample.

    miles-async serve session --engine http://127.0.0.1:30000 --port 8000
    # an agent harness, with any OpenAI client:
    AsyncOpenAI(base_url="http://127.0.0.1:8000/sessions/ep-17/v1", api_key="x")
    # the trainer, once the episode is over:
    GET http://127.0.0.1:8000/sessions/ep-17/samples

Why (docs/design.md, "TITO", token in, token out): an agent talks in messages, but the trainer must
score exactly the tokens the engine sampled. Re-tokenizing a conversation's text is not enough:
the ids a model sampled need not be the ids the tokenizer gives their decoded text (BPE merges
differently, bytes split across tokens, special tokens dropped from the text). So this server
owns tokenization:
- turn 1 renders the chat template (with the tools) and sends `input_ids` to the engine;
- after each turn it checkpoints the messages so far (with the assistant reply it returned), the
  token ids (prompt + the ids the model sampled), log-probs and weight versions;
- a later turn finds the deepest checkpoint whose messages are a prefix of the new list, renders
  only what the appended messages add (the template's close of the assistant turn, then the new
  messages and the generation prompt), tokenizes that suffix, and sends checkpoint ids + suffix:
  sampled ids are reused exactly, never re-tokenized;
- it checks the append-only property: the full list rendered and tokenized in one go must equal
  checkpoint ids + suffix. A disagreement is counted per session and in `stats()`
  (`num_mismatches`; `num_template_mismatches` when the sampled text is not even the text the
  template renders for the reply, e.g. a stop string or a reformatted tool call); the sampled ids
  are what is sent and trained on, never the re-tokenization;
- a message list that diverges from every checkpoint (a harness that rewrote or compressed
  history) branches from the deepest common checkpoint, or starts a new root; every leaf of the
  tree is one training sample (`GET /sessions/{id}/samples`, `SessionServer.samples(id)`), with a
  loss mask of 1 exactly on the tokens the model generated: a `miles_async.trajectory.Trajectory`
  with its token arrays inline (base64 in the JSON), the record the trainer consumes.

Routing: every turn of a session goes to the engine it started on (which holds its prefix in its
cache); a new session goes to the engine with the fewest requests in flight (then the fewest
sessions, then the first).

Endpoints: POST /v1/chat/completions (session from the body's `session_id`, else the X-Session-Id
header, else a fresh one; the id comes back in the X-Session-Id header and the body's `session_id`.
The body field is for clients that share one base URL across sessions and whose header is not
theirs to set: Verifiers' interception sends its own trace id as X-Session-ID, and passes
`session_id` through as a sampling field, miles_async/agents/verifiers.py), POST
/sessions/{id}/v1/chat/completions, GET /sessions/{id}/samples, DELETE /sessions/{id}, GET /stats,
GET /health, GET /v1/models and /v1/models/{id} (the served name: `served_model_name`, by default the
model folder's name, a Hub snapshot's id), GET /metrics (Prometheus text, engine/metrics.py's names:
turns in flight and answered, their prompt, cached and generated tokens, latency, the newest weight
version sampled, sessions open, TITO mismatches; the engines' own pages have their queues and KV
use). A completion's `model` is the one the request named: an agent harness names its policy as
its own config says, and whatever the name, this server serves the one policy. Errors use OpenAI's
shape {"error": {message, type, param, code}} on every route (unknown routes 404, wrong methods 405).
Streaming (`stream: true`) sends the engine server's chunk shapes (engine/openai.py): a role delta,
content deltas, the tool calls, an empty delta with the finish reason (and the log-probs, when
asked), then with `stream_options: {"include_usage": true}` a usage chunk with no choices, then
[DONE]. Beyond OpenAI's fields, a completion carries `prompt_token_ids` and `choices[0].token_ids`
(vLLM's names): the ids sent to and sampled by the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jinja2
import msgspec
import numpy as np
from aiohttp import web

from miles_async.agents.toolcalls import TOOL_CALL_OPEN, scan_tool_calls
from miles_async.engine.backend import Backend, EngineBackend, GenerateParams, connect
from miles_async.engine.client import EngineHTTPError, EngineOutput
from miles_async.engine.http_base import AppServer, default_served_model_name
from miles_async.engine.metrics import CONTENT_TYPE, Histogram, Page
from miles_async.models.config import ModelConfig
from miles_async.models.tokenizer import Tokenizer, load_tokenizer
from miles_async.trajectory import TokenData, Trajectory, VersionSpan

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20
DEFAULT_MAX_SESSIONS = 10_000
ROLES = ("system", "user", "assistant", "tool")
# OpenAI fields this server cannot honour at anything but their neutral value: refused, not ignored.
NEUTRAL_FIELDS: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                                  "top_logprobs": 0, "response_format": None, "parallel_tool_calls": True}
NEUTRAL_RESPONSE_FORMATS = ({"type": "text"},)


class RequestError(ValueError):
    """A request refused with an HTTP status and OpenAI's error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code


def error_response(error: RequestError) -> web.Response:
    return web.json_response({"error": {"message": str(error), "type": error.kind, "param": error.param,
                                        "code": error.code}}, status=error.status)


# ----- requests -----


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A checked chat.completions request: what the session and the engine need from it."""

    messages: list[dict[str, Any]]  # rendered form: role, content (str), tool_calls for the template
    keys: list[str]  # one canonical key per message, for prefix matching
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    sampling_params: dict[str, Any]
    logprobs: bool
    stream: bool
    model: str
    include_usage: bool = False  # stream_options.include_usage


def parse_chat_request(body: Any, model: str) -> ChatRequest:
    """OpenAI's ChatCompletionCreateParams → ChatRequest; RequestError names the bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, neutral in NEUTRAL_FIELDS.items():
        if body.get(name) is not None and body[name] != neutral:
            if name == "response_format" and body[name] in NEUTRAL_RESPONSE_FORMATS:
                continue
            raise RequestError(f"{name}={body[name]!r} is not supported by the session server (only {neutral!r}): "
                               + ("send one request per sample" if name == "n" else "leave it unset"), param=name)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("messages must be a non-empty list of message objects", param="messages")
    messages = [_render_message(m, i) for i, m in enumerate(raw_messages)]
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice={tool_choice!r} is not supported: use \"auto\" or \"none\"",
                           param="tool_choice")
    params: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
                raise RequestError(f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
            if name == "top_p" and value == 0:
                raise RequestError("top_p must be > 0", param=name)
            params[name] = float(value)
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None and "max_new_tokens" not in params:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}", param=name)
            params["max_new_tokens"] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of them", param="stop")
        params["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise RequestError(f"seed must be a non-negative integer, got {seed!r}", param="seed")
        params["sampling_seed"] = seed
    logprobs, stream = body.get("logprobs"), body.get("stream")
    for name, value in (("logprobs", logprobs), ("stream", stream)):
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return ChatRequest(messages=messages, keys=[_message_key(m) for m in messages], tools=tools,
                       parse_tools=tool_choice != "none", sampling_params=params, logprobs=bool(logprobs),
                       stream=bool(stream), model=body["model"] if isinstance(body.get("model"), str) else model,
                       include_usage=_include_usage(body.get("stream_options"), bool(stream)))


def _include_usage(options: Any, stream: bool) -> bool:
    """stream_options.include_usage, checked as the engine server checks it."""
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f'stream_options must be an object such as {{"include_usage": true}}, got {options!r}',
                           param="stream_options")
    return options.get("include_usage", False)


def _render_message(message: Any, index: int) -> dict[str, Any]:
    """One OpenAI message → the plain dict the chat template reads (content always a string)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object, got {type(message).__name__}", param=where)
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    rendered: dict[str, Any] = {"role": role, "content": _text_content(message.get("content"), where)}
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise RequestError(f"{where}.tool_calls must be a list, on an assistant message", param=where)
        rendered["tool_calls"] = [_render_tool_call(call, f"{where}.tool_calls[{i}]")
                                  for i, call in enumerate(tool_calls)]
    return rendered


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content may only hold text parts ({{\"type\": \"text\", \"text\": ...}})",
                                   param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _render_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                           param=where)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _message_key(message: dict[str, Any]) -> str:
    """What makes two messages the same turn: role, text, and calls (ids aside, arguments as JSON values)."""
    calls = []
    for call in message.get("tool_calls", ()):
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
        calls.append([call["function"]["name"], arguments])
    return json.dumps([message["role"], message["content"], calls], sort_keys=True)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("tools must be a list of tool objects ({\"type\": \"function\", \"function\": {...}})",
                           param="tools")
    return tools


# ----- sessions and their checkpoints -----


@dataclass(slots=True)
class Checkpoint:
    """The state after one turn: a node of the session's tree (its parent is the turn it extended)."""

    keys: list[str]  # the request's messages, then the assistant reply returned
    tools_key: str
    tokens: list[int]  # prompt ids + output ids
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[VersionSpan]  # the version of every generated token, over `tokens` positions
    output_ids: list[int]
    num_turns: int
    finish_reason: str
    num_mismatches: int
    num_children: int = 0
    # MoE (R3): the experts the engine routed every token but the last to, as the engine sent them
    # (int32 little-endian [tokens - 1, MoE layers, top_k]); the last turn's cover the whole trajectory.
    routed_experts: bytes = b""


@dataclass(slots=True)
class Prompt:
    """What one turn sends: the ids, and what the trainer keeps from the history behind them."""

    input_ids: list[int]
    parent: Checkpoint | None
    mismatch: bool  # the full rendering, tokenized at once, disagrees with input_ids
    template_mismatch: bool  # the sampled text is not what the template renders for the reply


@dataclass(slots=True)
class Session:
    session_id: str
    engine_index: int
    checkpoints: list[Checkpoint] = field(default_factory=list)
    num_turns: int = 0
    num_mismatches: int = 0
    num_template_mismatches: int = 0
    num_malformed_tool_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def stats(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "engine_index": self.engine_index, "num_turns": self.num_turns,
                "num_branches": sum(1 for c in self.checkpoints if c.num_children == 0),
                "num_mismatches": self.num_mismatches, "num_template_mismatches": self.num_template_mismatches,
                "num_malformed_tool_calls": self.num_malformed_tool_calls, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True)


class TitoTokenizer:
    """The pure half of TITO: render, tokenize, extend checkpoints. No I/O, so tests drive it directly."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # the messages broke the template
            raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None

    def deepest_checkpoint(self, session: Session, request: ChatRequest) -> Checkpoint | None:
        """The checkpoint with the longest message list that is a proper prefix of the request's."""
        key = tools_key(request.tools)
        best: Checkpoint | None = None
        for checkpoint in session.checkpoints:
            depth = len(checkpoint.keys)
            if (checkpoint.tools_key == key and depth < len(request.keys) and request.keys[:depth] == checkpoint.keys
                    and (best is None or depth > len(best.keys))):
                best = checkpoint
        return best

    def prompt(self, request: ChatRequest, parent: Checkpoint | None) -> Prompt:
        """The ids to send: parent ids (as sampled) + the tokenized suffix, or a fresh rendering."""
        full_text = self.render(request.messages, request.tools, True)
        full_ids = self.tokenizer.encode(full_text)
        if parent is None:
            return Prompt(input_ids=full_ids, parent=None, mismatch=False, template_mismatch=False)
        depth = len(parent.keys)
        history_text = self.render(request.messages[:depth], request.tools, False)
        before_reply = self.render(request.messages[:depth - 1], request.tools, True)
        if not (full_text.startswith(history_text) and history_text.startswith(before_reply)):
            # The template is not append-only for these messages: no suffix to add; start afresh.
            return Prompt(input_ids=full_ids, parent=None, mismatch=True, template_mismatch=True)
        reply_text = history_text[len(before_reply):]  # the reply as the template writes it
        sampled_text = self.tokenizer.decode(parent.output_ids)
        template_mismatch = not reply_text.startswith(sampled_text)
        if not template_mismatch:
            close = reply_text[len(sampled_text):]  # e.g. "\n" after a sampled <|im_end|>
        else:
            close = self._close_of(reply_text, parent.output_ids)
        suffix_ids = self.tokenizer.encode(close + full_text[len(history_text):])
        # This turn's own check (earlier turns were checked when they were extended): the reply as
        # the template writes it, tokenized with what follows, against the sampled ids + suffix.
        retokenized = self.tokenizer.encode(full_text[len(before_reply):])
        return Prompt(input_ids=parent.tokens + suffix_ids, parent=parent,
                      mismatch=retokenized != parent.output_ids + suffix_ids, template_mismatch=template_mismatch)

    def _close_of(self, reply_text: str, output_ids: list[int]) -> str:
        """The template's end of an assistant turn, for a reply whose sampled text it would not write."""
        eos = self.tokenizer.eos_token
        at = reply_text.rfind(eos) if eos else -1
        if at < 0:
            return ""
        ended = bool(output_ids) and output_ids[-1] in self.tokenizer.eos_token_ids
        return reply_text[at + len(eos):] if ended else reply_text[at:]

    @staticmethod
    def checkpoint(request: ChatRequest, prompt: Prompt, reply_key: str, output_ids: list[int],
                   output_logprobs: list[float], weight_versions: list[VersionSpan], finish_reason: str,
                   routed_experts: bytes = b"") -> Checkpoint:
        parent = prompt.parent
        num_new = len(prompt.input_ids) - (len(parent.tokens) if parent else 0)
        if parent is not None:
            parent.num_children += 1
        return Checkpoint(
            keys=[*request.keys, reply_key], tools_key=tools_key(request.tools),
            tokens=prompt.input_ids + output_ids,
            loss_mask=(parent.loss_mask if parent else []) + [0] * num_new + [1] * len(output_ids),
            logprobs=(parent.logprobs if parent else []) + [0.0] * num_new + list(output_logprobs),
            weight_versions=(parent.weight_versions if parent else []) + [  # spans over output -> over tokens
                VersionSpan(version=v.version, start=v.start + len(prompt.input_ids), end=v.end + len(prompt.input_ids))
                for v in weight_versions],
            output_ids=output_ids, num_turns=(parent.num_turns if parent else 0) + 1, finish_reason=finish_reason,
            num_mismatches=(parent.num_mismatches if parent else 0) + int(prompt.mismatch),
            routed_experts=routed_experts)


def trajectory_of(checkpoint: Checkpoint, moe_shape: tuple[int, int] | None) -> Trajectory:
    """A branch as the record the trainer consumes, its arrays inline (`moe_shape`: the model's
    (MoE layers, top_k), to shape the routed experts; None for a dense model)."""
    experts = None
    if checkpoint.routed_experts and moe_shape is not None:
        experts = np.frombuffer(checkpoint.routed_experts, dtype="<i4").reshape(-1, *moe_shape)
    data = TokenData.build(tokens=checkpoint.tokens, loss_mask=checkpoint.loss_mask, logprobs=checkpoint.logprobs,
                           routed_experts=experts)
    num_generated = sum(checkpoint.loss_mask)
    first = checkpoint.loss_mask.index(1) if num_generated else len(checkpoint.tokens)
    return Trajectory(finish_reason=checkpoint.finish_reason, versions=tuple(checkpoint.weight_versions),
                      num_tokens=len(checkpoint.tokens), num_prompt_tokens=first, num_generated_tokens=num_generated,
                      num_turns=checkpoint.num_turns, num_tito_mismatches=checkpoint.num_mismatches, data=data)


# ----- the server -----


@dataclass(slots=True)
class EngineSlot:
    url: str
    backend: EngineBackend
    num_in_flight: int = 0
    num_requests: int = 0
    num_sessions: int = 0
    alive: bool = True  # False once removed (its engine lost): no session is routed to it any more


@dataclass(slots=True)
class TurnCounters:
    """What /metrics reports of the turns answered since start (counters never go down)."""

    num_turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    num_mismatches: int = 0
    weight_version: int | None = None  # the newest a turn was sampled under
    latency_s: Histogram = field(default_factory=Histogram)


@dataclass(slots=True)
class Turn:
    """One finished generation, read from the engine's answer."""

    output_ids: list[int]
    logprobs: list[float]
    text: str
    engine_finish: str  # stop, length or abort
    weight_versions: list[VersionSpan]  # over the output
    prompt_tokens: int
    cached_tokens: int
    routed_experts: bytes = b""


class SessionServer(AppServer):
    """Serve TITO sessions over engines (SGLang-API URLs) on host:port (port 0: any free port).

        async with SessionServer(["http://127.0.0.1:30000"], "models/tiny") as server:
            client = AsyncOpenAI(base_url=f"{server.url}/sessions/s1/v1", api_key="x")
            ...
            samples = server.samples("s1")
    """

    def __init__(self, engine_urls: Sequence[str], model_dir_or_tokenizer: str | Path | Tokenizer,
                 host: str = "127.0.0.1", port: int = 0, *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 engine_timeout_s: float = 600.0, engine_api_key: str | None = None,
                 api_key: str | None = None, moe_shape: tuple[int, int] | None = None,
                 backend: Backend = "embedded", adapter: str = "", served_model_name: str | None = None) -> None:
        if not engine_urls:
            raise ValueError("give at least one engine URL (e.g. http://127.0.0.1:30000)")
        self.backend_kind = backend  # how the engines are spoken to (engine/backend.py)
        self.adapter = adapter  # a LoRA adapter every engine request names (connect's)
        self.moe_shape = moe_shape  # (MoE layers, top_k): routed experts are recorded (R3)
        if isinstance(model_dir_or_tokenizer, Tokenizer):
            tokenizer, self.model = model_dir_or_tokenizer, "miles-async"
        else:
            tokenizer = load_tokenizer(model_dir_or_tokenizer)
            self.model = default_served_model_name(str(model_dir_or_tokenizer))
            self.moe_shape = ModelConfig.from_hf(model_dir_or_tokenizer).moe_shape
        self.model = served_model_name or self.model  # /v1/models' id, /metrics' model_name
        self.counters = TurnCounters()
        self.tito = TitoTokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.engine_timeout_s, self.engine_api_key = engine_timeout_s, engine_api_key
        self.engines = [self._slot(url) for url in engine_urls]
        super().__init__(host, port, api_key)  # api_key: what its own clients must send (off loopback)
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        self._num_closed_turns = 0

    def _slot(self, url: str) -> EngineSlot:
        return EngineSlot(url, connect(self.backend_kind, url, timeout_s=self.engine_timeout_s,
                                       api_key=self.engine_api_key, adapter=self.adapter))

    # ----- Python API -----

    def add_engine(self, url: str) -> None:
        """Route new sessions to one more engine too (an engine that joined the running job)."""
        self.engines.append(self._slot(url))

    async def remove_engine(self, url: str) -> None:
        """Stop routing to the engine at `url` (it is lost): new sessions go to the others, and a
        session that was on it moves to another one at its next turn (the whole prompt is sent every
        turn, so only that engine's prefix cache is lost). A turn in flight on it fails as it would."""
        for slot in self.engines:
            if slot.url == url and slot.alive:
                slot.alive = False
                await slot.backend.close()


    def samples(self, session_id: str) -> list[Trajectory]:
        """One sample per leaf of the session's tree, oldest first, with the session's prompt and
        cached token counts; KeyError for an unknown session."""
        session = self.sessions[session_id]
        return [msgspec.structs.replace(trajectory_of(c, self.moe_shape), prompt_tokens_sent=session.prompt_tokens,
                                        cached_tokens=session.cached_tokens)
                for c in session.checkpoints if c.num_children == 0]

    def close_session(self, session_id: str) -> list[Trajectory]:
        """Forget a session (freeing its checkpoints) and return its samples."""
        samples = self.samples(session_id)
        session = self.sessions.pop(session_id)
        self.engines[session.engine_index].num_sessions -= 1
        self._num_closed_turns += session.num_turns
        return samples

    def stats(self) -> dict[str, Any]:
        open_sessions = list(self.sessions.values())
        prompt_tokens = sum(s.prompt_tokens for s in open_sessions)
        cached_tokens = sum(s.cached_tokens for s in open_sessions)
        return {
            "num_sessions": len(open_sessions),
            "num_turns": sum(s.num_turns for s in open_sessions),
            "num_turns_closed_sessions": self._num_closed_turns,
            "num_mismatches": sum(s.num_mismatches for s in open_sessions),
            "num_template_mismatches": sum(s.num_template_mismatches for s in open_sessions),
            "num_malformed_tool_calls": sum(s.num_malformed_tool_calls for s in open_sessions),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "engines": [{"url": e.url, "num_in_flight": e.num_in_flight, "num_requests": e.num_requests,
                         "num_sessions": e.num_sessions, "alive": e.alive} for e in self.engines],
        }

    # ----- one turn -----

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                raise RequestError(f"{self.max_sessions} sessions are open: close finished ones "
                                   "(DELETE /sessions/{id}) before starting more", status=503, kind="server_error")
            session = self.sessions[session_id] = Session(session_id, self._pick_engine())
            self.engines[session.engine_index].num_sessions += 1
        elif not self.engines[session.engine_index].alive:  # its engine is lost: on to another one
            self.engines[session.engine_index].num_sessions -= 1
            session.engine_index = self._pick_engine()
            self.engines[session.engine_index].num_sessions += 1
        return session

    def _pick_engine(self) -> int:
        """The live engine with the fewest requests in flight, then the fewest sessions."""
        live = [i for i, e in enumerate(self.engines) if e.alive]
        if not live:
            raise RequestError("no engine is left to serve sessions (every one was lost)", status=503,
                               kind="server_error")
        return min(live, key=lambda i: (self.engines[i].num_in_flight, self.engines[i].num_sessions, i))

    async def _generate(self, engine: EngineSlot, input_ids: list[int], params: dict[str, Any],
                        on_text: Any = None) -> Turn:
        engine.num_in_flight += 1
        engine.num_requests += 1
        try:
            wanted = GenerateParams.from_sglang(params, return_routed_experts=self.moe_shape is not None)
            output: EngineOutput | None = None
            if on_text is None:
                output = await engine.backend.generate(input_ids, wanted, version=0)
            else:
                async for output in engine.backend.generate_stream(input_ids, wanted, version=0):
                    await on_text(output.text)
                if output is None:
                    raise RequestError("the engine's stream ended without an output", status=502, kind="server_error")
        except EngineHTTPError as e:
            status = e.status if e.status in (400, 503) else 502
            raise RequestError(f"engine {engine.url}: {e.message}", status=status,
                               kind="invalid_request_error" if status == 400 else "server_error") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RequestError(f"engine {engine.url} is unreachable: {type(e).__name__}: {e}", status=502,
                               kind="server_error") from None
        finally:
            engine.num_in_flight -= 1
        if len(output.output_logprobs) != len(output.output_ids):
            raise RequestError(f"engine {engine.url} sent {len(output.output_logprobs)} log-probs for "
                               f"{len(output.output_ids)} tokens", status=502, kind="server_error")
        return Turn(output_ids=output.output_ids, logprobs=output.output_logprobs, text=output.text,
                    engine_finish=output.finish_reason, weight_versions=output.weight_versions,
                    prompt_tokens=output.prompt_tokens or len(input_ids), cached_tokens=output.cached_tokens,
                    routed_experts=output.routed_experts)

    async def complete(self, session_id: str, request: ChatRequest, on_text: Any = None) -> dict[str, Any]:
        """Run one turn of `session_id`: TITO prompt, engine, checkpoint; return chat.completion JSON."""
        session = self._session(session_id)
        prompt = self.tito.prompt(request, self.tito.deepest_checkpoint(session, request))
        started_s = time.perf_counter()
        turn = await self._generate(self.engines[session.engine_index], prompt.input_ids,
                                    request.sampling_params, on_text)
        self._count(turn, prompt, time.perf_counter() - started_s)
        parsed = scan_tool_calls(turn.text) if request.parse_tools else None
        calls = parsed.tool_calls if parsed is not None else []
        content = parsed.content if parsed is not None else turn.text
        for error in parsed.errors if parsed is not None else ():
            log.debug("session %s: malformed %s", session_id, error)  # counted in stats; a learning policy writes many
        finish = ("length" if turn.engine_finish in ("length", "abort") else "tool_calls" if calls else "stop")
        reply = {"role": "assistant", "content": content,
                 **({"tool_calls": [msgspec.to_builtins(c) for c in calls]} if calls else {})}
        checkpoint = self.tito.checkpoint(
            request, prompt, _message_key(_render_message(reply, 0)), turn.output_ids, turn.logprobs,
            turn.weight_versions, "abort" if turn.engine_finish == "abort" else finish, turn.routed_experts)
        session.checkpoints.append(checkpoint)
        session.num_turns += 1
        session.num_mismatches += int(prompt.mismatch)
        session.num_template_mismatches += int(prompt.template_mismatch)
        session.num_malformed_tool_calls += len(parsed.errors) if parsed is not None else 0
        session.prompt_tokens += turn.prompt_tokens
        session.cached_tokens += turn.cached_tokens
        if calls and not content:
            reply["content"] = None
        choice: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None,
                                  "token_ids": turn.output_ids}
        if request.logprobs:
            choice["logprobs"] = {"content": [self._logprob_entry(i, lp)
                                              for i, lp in zip(turn.output_ids, turn.logprobs)]}
        completion_tokens = len(turn.output_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": [choice], "session_id": session_id,
            "prompt_token_ids": prompt.input_ids,
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": turn.prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}},
        }

    def _count(self, turn: Turn, prompt: Prompt, latency_s: float) -> None:
        counters = self.counters
        counters.num_turns += 1
        counters.prompt_tokens += turn.prompt_tokens
        counters.cached_tokens += turn.cached_tokens
        counters.generation_tokens += len(turn.output_ids)
        counters.num_mismatches += int(prompt.mismatch)
        for span in turn.weight_versions:
            if counters.weight_version is None or span.version > counters.weight_version:
                counters.weight_version = span.version
        counters.latency_s.observe(latency_s)

    def _logprob_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}

    # ----- lifecycle -----

    def make_app(self) -> web.Application:
        return create_app(self)

    async def stop(self) -> None:
        await super().stop()
        for engine in self.engines:
            await engine.backend.close()


# ----- HTTP -----

SERVER_KEY = web.AppKey("session_server", SessionServer)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    body = await _read_json(request)
    session_id = (request.match_info.get("session_id") or _body_session_id(body)
                  or request.headers.get("X-Session-Id") or uuid.uuid4().hex)
    chat = parse_chat_request(body, server.model)
    if chat.stream:
        return await _stream(request, server, session_id, chat)
    completion = await server.complete(session_id, chat)
    return web.json_response(completion, headers={"X-Session-Id": session_id})


def _body_session_id(body: Any) -> str | None:
    """The body's `session_id` (module docstring), None when it has none; RequestError when it is not a name."""
    session_id = body.get("session_id") if isinstance(body, dict) else None
    if session_id is not None and (not isinstance(session_id, str) or not session_id or "/" in session_id):
        raise RequestError(f"session_id must be a non-empty string without '/', got {session_id!r}", param="session_id")
    return session_id


def _streamable(text: str) -> str:
    """The part of a partial output that is safe to send: before any tool call, whole characters, and
    no trailing whitespace (which the final content drops before a call)."""
    cut = text.find(TOOL_CALL_OPEN)
    text = text if cut < 0 else text[:cut]
    for size in range(len(TOOL_CALL_OPEN) - 1, 0, -1):  # a tag that may be arriving
        if text.endswith(TOOL_CALL_OPEN[:size]):
            text = text[:-size]
            break
    return text.rstrip("\ufffd").rstrip()


async def _stream(request: web.Request, server: SessionServer, session_id: str, chat: ChatRequest) -> web.StreamResponse:
    """OpenAI's SSE: a role chunk, content deltas as they come, the tool calls, the finish (and the
    log-probs), the usage if asked for, [DONE] (the module docstring)."""
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Session-Id": session_id})
    sent = ""

    async def send(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> None:
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": chat.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}], **extra}
        if chat.include_usage:
            chunk["usage"] = None
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    async def on_text(text: str) -> None:
        nonlocal sent
        if not response.prepared:
            await response.prepare(request)
            await send({"role": "assistant", "content": ""})
        if "stop" in chat.sampling_params:  # the engine trims a stop string only at the end
            return
        safe = _streamable(text) if chat.parse_tools else text.rstrip("\ufffd")
        if len(safe) > len(sent) and safe.startswith(sent):
            await send({"content": safe[len(sent):]})
            sent = safe

    try:
        completion = await server.complete(session_id, chat, on_text)  # errors before the first chunk: plain JSON
    except RequestError as e:
        if not response.prepared:
            raise
        # The headers went out: the error becomes an event, OpenAI's shape (as vLLM sends it).
        error = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code}}
        await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response
    if not response.prepared:
        await response.prepare(request)
        await send({"role": "assistant", "content": ""})
    choice = completion["choices"][0]
    content = choice["message"]["content"] or ""
    if not content.startswith(sent):  # not expected: _streamable holds back what the end may change
        log.warning("session %s: streamed %r is not a prefix of the final content %r", session_id, sent, content)
        sent = content
    final: dict[str, Any] = {}
    if len(content) > len(sent):
        final["content"] = content[len(sent):]
    if choice["message"].get("tool_calls"):
        final["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice["message"]["tool_calls"])]
    if final:
        await send(final)
    await send({}, choice["finish_reason"], choice["logprobs"], session_id=session_id)
    if chat.include_usage:
        await send_usage(response, completion)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def send_usage(response: web.StreamResponse, completion: dict[str, Any]) -> None:
    chunk = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
             "model": completion["model"], "choices": [], "usage": completion["usage"]}
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


def _known_session(request: web.Request) -> str:
    session_id = request.match_info["session_id"]
    if session_id not in request.app[SERVER_KEY].sessions:
        raise RequestError(f"no session {session_id!r} (a session starts with its first chat completion)",
                           status=404, code="session_not_found")
    return session_id


async def get_samples(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    session_id = _known_session(request)
    return web.json_response({"session_id": session_id,
                              "samples": msgspec.to_builtins(server.samples(session_id)),
                              "metadata": server.sessions[session_id].stats()})


async def delete_session(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    session_id = _known_session(request)
    samples = server.close_session(session_id)
    return web.json_response({"session_id": session_id, "closed": True, "num_samples": len(samples)})


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVER_KEY].stats())


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def _card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "miles-async"}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app[SERVER_KEY].model)]})


async def model_card(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    if model != request.app[SERVER_KEY].model:
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
    return web.json_response(_card(model))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text, under the engine server's names (engine/metrics.py)."""
    server = request.app[SERVER_KEY]
    counters = server.counters
    page = Page({"model_name": server.model})
    page.gauge("sglang:num_running_reqs", "The number of turns at the engines.",
               sum(e.num_in_flight for e in server.engines))
    page.counter("sglang:prompt_tokens_total", "Number of prompt tokens the turns sent.", counters.prompt_tokens)
    page.counter("sglang:cached_tokens_total", "Number of them the engines' prefix caches held.",
                 counters.cached_tokens)
    page.counter("sglang:generation_tokens_total", "Number of tokens the turns generated.",
                 counters.generation_tokens)
    page.gauge("sglang:cache_hit_rate", "The prefix cache hit rate of the turns.",
               counters.cached_tokens / counters.prompt_tokens if counters.prompt_tokens else 0.0)
    page.counter("sglang:num_requests_total", "Number of turns answered.", counters.num_turns)
    page.histogram("sglang:e2e_request_latency_seconds", "Histogram of the turns' latency in seconds",
                   counters.latency_s)
    if counters.weight_version is not None:
        page.gauge("miles_async:weight_version", "The newest weight version a turn was sampled under.",
                   counters.weight_version)
    page.gauge("miles_async:sessions_open", "The number of open sessions.", len(server.sessions))
    page.counter("miles_async:tito_mismatches_total", "Turns whose re-tokenized history differs from the sampled ids.",
                 counters.num_mismatches)
    return web.Response(body=page.text().encode(), headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(e)
    except web.HTTPException as e:  # aiohttp's own 404/405/413, in OpenAI's shape
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
        response = error_response(RequestError(f"{request.method} {request.path}: {e.reason}", status=e.status))
        response.headers.update(allow)
        return response
    except ConnectionResetError:  # the client went away: nobody to answer
        raise
    except Exception:  # the HTTP boundary: a fault of ours, with its traceback in the log, not the client's
        log.exception("%s %s failed", request.method, request.path)
        return error_response(RequestError(f"{request.method} {request.path} failed inside the server (its log "
                                           "says why)", status=500, kind="server_error"))


def create_app(server: SessionServer) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[SERVER_KEY] = server
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/sessions/{session_id}/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/sessions/{session_id}/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_card)  # a Hub id holds a slash
    app.router.add_get("/sessions/{session_id}/v1/models/{model:.+}", model_card)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sessions/{session_id}/samples", get_samples)
    app.router.add_delete("/sessions/{session_id}", delete_session)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/health", health)
    return app


async def serve_forever(engine_urls: Sequence[str], model_dir: str, host: str, port: int,
                        served_model_name: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SessionServer(engine_urls, model_dir, host, port, served_model_name=served_model_name) as server:
        print(f"miles-async session: serving {', '.join(engine_urls)} on {server.url} "
              f"(OpenAI base URL: {server.url}/sessions/SESSION_ID/v1)", flush=True)
        await stop.wait()


def main(engine_urls: list[str], model_dir: str, host: str, port: int, served_model_name: str | None = None) -> int:
    """`miles-async serve session`: load the tokenizer, serve (as `served_model_name`) until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        print(f"miles-async serve session: cannot read the tokenizer in {model_dir}: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve_forever(engine_urls, model_dir, host, port, served_model_name))
    return 0


__all__ = ["ChatRequest", "Checkpoint", "RequestError", "SessionServer", "TitoTokenizer",
           "main", "parse_chat_request"]
