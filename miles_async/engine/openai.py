"""OpenAI's API in front of the embedded engine, in the shapes SGLang 0.5.23 serves it
(python/sglang/srt/entrypoints/openai/protocol.py); server.py mounts these routes (`add_routes`).

    curl -s localhost:30000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "echo": true}'
    curl -s localhost:30000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    curl -sN localhost:30000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}],
        "stream": true, "stream_options": {"include_usage": true}}'

  GET  /v1/models            one card: the served model (its served name), its context length
  GET  /v1/models/{id}       that card, or 404 for another id (SGLang's and OpenAI's answer)
  POST /v1/completions       prompt: a text, token ids, or a list of either (one choice each);
                             max_tokens (16), temperature, top_p, top_k, stop, stop_token_ids, seed,
                             ignore_eos, skip_special_tokens; echo: the prompt leads the text, and
                             with logprobs its tokens lead the log-probs (the first null); logprobs k:
                             each token's log-prob and the k most likely tokens at each position
  POST /v1/chat/completions  messages rendered by the model's chat template (the engine needs a
                             tokenizer that has one), then as above; logprobs / top_logprobs in
                             OpenAI's chat shape
`model` may be omitted (or null); naming another model than the served one is a 404, "The model
`X` does not exist." (vLLM's answer), since a client that asks for a model it does not get should
know. `stream: true` answers in server-sent events, OpenAI's chunks: `text_completion` chunks (one
choice each), or `chat.completion.chunk`s (a first delta with the role, then content deltas, then
an empty delta with the finish_reason), each chunk's log-probs those of its tokens, then `data:
[DONE]`; `stream_options: {"include_usage": true}` adds, before [DONE], a chunk with no choices
and the usage (and `usage: null` on the others), as OpenAI and vLLM send it. A streamed text is the
non-streamed text, split: a chunk never ends inside a character whose bytes are still arriving (a
trailing U+FFFD of the partial decode) nor at the start of a stop string the end may cut, so the
chunks add up to the same text. A client that disconnects aborts its requests.
Not supported, refused with a 400 naming the field: n > 1, best_of, suffix, tools, response_format
and the other fields the embedded engine lacks (sampling.py's NEUTRAL_FIELDS left at their neutral
values pass). Without a tokenizer a token's text is "token_id:<id>".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from miles_async.engine.core import Engine
from miles_async.engine.http_base import (
    ENGINE_KEY,
    MODEL_NAME_KEY,
    STARTED_KEY,
    BadRequest,
    abort_all,
    body_field,
    openai_error_body,
    read_json,
    record_finished,
    submit_all,
    token_id_list,
    wait_all,
)
from miles_async.engine.request import GenerateOutput, GenerateRequest, TopLogprobs
from miles_async.engine.sampling import NEUTRAL_FIELDS, SamplingParams

log = logging.getLogger(__name__)

# Request fields this engine cannot honour: set to anything but their default, a 400.
UNSUPPORTED = {"best_of": None, "suffix": None, "tools": None, "tool_choice": None,
               "response_format": None, "return_hidden_states": False, "lora_path": None, "session_params": None,
               "custom_logit_processor": None, "return_routed_experts": False, "parallel_tool_calls": None}
# OpenAI's sampling fields under SGLang's names (sampling_params), checked by SamplingParams.from_json.
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "seed": "sampling_seed",
           "min_tokens": "min_new_tokens"}
PASSED = ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
          "no_stop_trim", *NEUTRAL_FIELDS)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_card)  # a Hub id holds a slash
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


def _card(request: web.Request) -> dict[str, Any]:
    name = request.app[MODEL_NAME_KEY]
    return {"id": name, "object": "model", "created": int(request.app[STARTED_KEY]), "owned_by": "miles-async",
            "root": name, "parent": None, "max_model_len": request.app[ENGINE_KEY].max_seq_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request)]})


async def model_card(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    if model != request.app[MODEL_NAME_KEY]:
        raise _no_such_model(model)
    return web.json_response(_card(request))


def _no_such_model(model: str) -> BadRequest:
    return BadRequest(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


def _check_model(request: web.Request, body: dict[str, Any]) -> str:
    """The served name; a request may omit `model` (or send null or ""), as vLLM allows."""
    name = request.app[MODEL_NAME_KEY]
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string (the served model, {name!r}), got {type(model).__name__}",
                         param="model")
    if model and model != name:
        raise _no_such_model(model)
    return name


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body_field(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("stream_options needs stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise BadRequest(f'stream_options must be an object, e.g. {{"include_usage": true}}, got '
                         f"{type(options).__name__}", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage must be true or false, got {include_usage!r}",
                         param="stream_options.include_usage")
    return stream, include_usage


def _sampling(body: dict[str, Any], engine: Engine, prompt_len: int, default_max: int | None) -> SamplingParams:
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default):
            raise BadRequest(f"{name} is not supported by the embedded engine's OpenAI API", param=name)
    params = {key: body[key] for key in PASSED if body.get(key) is not None}
    given = {}  # SGLang's name -> the OpenAI name the request used, to name it in an error
    for name, sglang_name in RENAMED.items():
        if body.get(name) is not None:
            params[sglang_name] = body[name]
            given[sglang_name] = name
    # Without max_tokens: OpenAI's default for completions, the rest of the context for chat (SGLang's).
    params.setdefault("max_new_tokens", default_max if default_max is not None else engine.max_seq_len - prompt_len)
    try:
        return SamplingParams.from_json(params, engine.vocab_size)
    except (ValueError, TypeError) as e:
        message = str(e)
        for sglang_name, name in given.items():
            message = message.replace(f"sampling_params.{sglang_name}", name).replace(f"$.{sglang_name}", name)
        param = next((key for key in (*given.values(), *PASSED) if key in message), None)
        raise BadRequest(message.replace("sampling_params.", "").replace("sampling_params: ", ""),
                         param=param) from None


def _token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else f"token_id:{token_id}"


def _finish(out: GenerateOutput) -> tuple[str | None, Any]:
    reason = out.finish_reason or {}
    return reason.get("type"), reason.get("matched")


def _usage(outs: Sequence[GenerateOutput]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ----- streaming -----

class StreamedText:
    """What of a growing output text may be sent: not a trailing U+FFFD (the bytes of a character
    still arriving), nor a tail that begins a stop string (the final text is cut before a matched
    stop). The final text sends the rest, so what is sent adds up to it."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.sent = ""

    def advance(self, text: str, final: bool) -> str:
        """The new part of `text` (the whole text so far) that can go now."""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self._held(text)]
        if not text.startswith(self.sent):
            # Not expected: the partial decodes and the stop holds keep what was sent a prefix.
            log.warning("streamed text %r is not a prefix of the text %r", self.sent, text)
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _held(self, text: str) -> int:
        """The length of the longest tail of `text` that a stop string starts with."""
        return max((size for stop in self.stops for size in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:size])), default=0)


async def _follow(engine: Engine, states: list) -> AsyncIterator[list[tuple[int, GenerateOutput]]]:
    """The latest output of every request that moved on, by index, until all are final (outputs
    are cumulative, so a slow reader gets the latest, not a backlog)."""
    latest: dict[int, GenerateOutput] = {}
    moved = asyncio.Event()

    async def follow(index: int, state: Any) -> None:
        async for out in engine.stream(state):
            latest[index] = out
            moved.set()

    tasks = [asyncio.create_task(follow(i, s)) for i, s in enumerate(states)]
    for task in tasks:
        task.add_done_callback(lambda _: moved.set())
    try:
        num_open = len(states)
        while num_open:
            await moved.wait()
            moved.clear()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            batch = sorted(latest.items())
            latest.clear()
            num_open -= sum(out.finish_reason is not None for _, out in batch)
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()


async def _send_events(request: web.Request, states: list, events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """Server-sent events: each of `events`, then [DONE]. A client that goes away aborts `states`."""
    engine = request.app[ENGINE_KEY]
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        await asyncio.shield(abort_all(engine, states))
        raise
    except ConnectionResetError:  # it went away while we wrote: nobody to answer
        await abort_all(engine, states)
        return response
    except Exception as e:  # the headers went out: the error becomes an event, OpenAI's shape (as vLLM sends it)
        log.exception("%s %s failed while streaming", request.method, request.path)
        await abort_all(engine, states)
        error = openai_error_body(500, f"the stream failed inside the server: {type(e).__name__}: {e}")
        await response.write(f"data: {json.dumps(error)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# ----- /v1/completions -----

def _prompts(value: Any, engine: Engine) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) of each prompt: a text, token ids, or a list of either."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(x) is int for x in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest("prompt must be a text, a list of token ids, or a non-empty list of either", param="prompt")
    ids, texts = [], []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if engine.tokenizer is None:
                raise BadRequest("this engine has no tokenizer: send prompt as token ids", param="prompt")
            ids.append(engine.tokenizer.encode(item))
            texts.append(item)
        else:
            ids.append(token_id_list(item, f"prompt[{i}]"))
            texts.append(None)
    return ids, texts


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    name = _check_model(request, body)
    stream, include_usage = _stream_options(body)
    prompts, texts = _prompts(body.get("prompt"), engine)
    echo = body_field(body, "echo", bool, False)
    top_k = body_field(body, "logprobs", int)  # None: no log-probs
    if top_k is not None and top_k < 0:
        raise BadRequest(f"logprobs must be >= 0, got {top_k}", param="logprobs")
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests = [GenerateRequest(input_ids=ids, sampling_params=_sampling(body, engine, len(ids), 16), rid=f"{rid}_{i}",
                                return_logprob=top_k is not None,
                                logprob_start_len=0 if echo and top_k is not None else -1, top_logprobs_num=top_k or 0)
                for i, ids in enumerate(prompts)]
    states = await submit_all(engine, requests)
    shown_prompts = [(text if text is not None else _decode(engine, ids)) if echo else "" for ids, text in
                     zip(prompts, texts)]
    if stream:
        chunks = _completion_chunks(request, states, rid, name, shown_prompts, echo, top_k, include_usage,
                                    requests[0].sampling_params.stop)
        return await _send_events(request, states, chunks)
    outs = await wait_all(request, states)
    choices = []
    for i, (out, shown) in enumerate(zip(outs, shown_prompts)):
        reason, matched = _finish(out)
        logprobs = None
        if top_k is not None:
            logprobs, _ = _completion_logprobs(engine, _scored_tokens(out, 0, echo), top_k, 0)
        choices.append({"index": i, "text": shown + (out.text or ""), "finish_reason": reason, "matched_stop": matched,
                        "logprobs": logprobs})
    return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                              "model": name, "choices": choices, "usage": _usage(outs)})


def _decode(engine: Engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""


def _scored_tokens(out: GenerateOutput, start: int, with_prompt: bool
                   ) -> list[tuple[float | None, int, TopLogprobs | None]]:
    """(log-prob, token id, top-k) of the output tokens from `start` on, after the prompt's if asked."""
    pairs: list[tuple[float | None, int]] = list(zip((out.output_token_logprobs or [])[start:], out.output_ids[start:]))
    tops: list[TopLogprobs | None] = list((out.output_top_logprobs or [None] * len(out.output_ids))[start:])
    if with_prompt:
        prompt_pairs = out.input_token_logprobs or []
        pairs = list(prompt_pairs) + pairs
        tops = list(out.input_top_logprobs or [None] * len(prompt_pairs)) + tops
    return [(lp, tid, top) for (lp, tid), top in zip(pairs, tops)]


def _completion_logprobs(engine: Engine, scored: list[tuple[float | None, int, TopLogprobs | None]], top_k: int,
                         offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's LogProbs: per token its text, offset in the choice's text (from `offset`), log-prob
    and top-k; and the offset after them."""
    tokens = [_token_text(engine, tid) for _, tid, _ in scored]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [None if t is None else {_token_text(engine, tid): lp for lp, tid in t} for _, _, t in scored] if top_k else []
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in scored], "top_logprobs": top,
            "text_offset": offsets}, offset


async def _completion_chunks(request: web.Request, states: list, rid: str, name: str, shown_prompts: list[str],
                             echo: bool, top_k: int | None, include_usage: bool,
                             stops: Sequence[str]) -> AsyncIterator[dict[str, Any]]:
    """`text_completion` chunks, one choice each, then the usage if asked for."""
    engine = request.app[ENGINE_KEY]
    created = int(time.time())
    texts = [StreamedText(stops) for _ in states]
    started = [False] * len(states)  # the first chunk of a choice leads with the echoed prompt
    num_sent = [0] * len(states)  # output tokens whose log-probs went out
    offsets = [0] * len(states)
    finals: list[GenerateOutput] = []
    async for batch in _follow(engine, states):
        for i, out in batch:
            final = out.finish_reason is not None
            delta = texts[i].advance(out.text or "", final)
            lead = "" if started[i] else shown_prompts[i]
            if not (delta or final or lead):
                continue  # nothing new to show yet: its tokens go with the text they make
            logprobs = None
            if top_k is not None:
                scored = _scored_tokens(out, num_sent[i], echo and not started[i])
                logprobs, offsets[i] = _completion_logprobs(engine, scored, top_k, offsets[i])
            started[i], num_sent[i] = True, len(out.output_ids)
            reason, matched = _finish(out)
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": name,
                     "choices": [{"index": i, "text": lead + delta, "logprobs": logprobs,
                                  "finish_reason": reason, "matched_stop": matched}]}
            if include_usage:
                chunk["usage"] = None
            if final:
                finals.append(out)
            yield chunk
    record_finished(request, finals)
    if include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [],
               "usage": _usage(finals)}


# ----- /v1/chat/completions -----

def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported",
                                 param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, a list of text parts, or null",
                             param=f"messages[{i}].content")
        messages.append({**message, "content": content})
    return messages


def _render(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    render = getattr(engine.tokenizer, "apply_chat_template", None)
    if engine.tokenizer is None or render is None or getattr(engine.tokenizer, "chat_template", "") is None:
        raise BadRequest("/v1/chat/completions needs the model's chat template and this engine's tokenizer has "
                         "none: use /v1/completions")
    import jinja2  # the tokenizer renders with it

    try:
        text = render(messages, add_generation_prompt=True)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
        raise BadRequest(f"messages: the chat template cannot render them: {e}", param="messages") from None
    return engine.tokenizer.encode(text)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    name = _check_model(request, body)
    stream, include_usage = _stream_options(body)
    ids = _render(engine, _messages(body.get("messages")))
    want_logprobs = body_field(body, "logprobs", bool, False)
    top_k = body_field(body, "top_logprobs", int, 0)
    if top_k and not want_logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if top_k < 0:
        raise BadRequest(f"top_logprobs must be >= 0, got {top_k}", param="top_logprobs")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = _sampling(body, engine, len(ids), None)
    states = await submit_all(engine, [GenerateRequest(
        input_ids=ids, sampling_params=params, rid=rid, return_logprob=want_logprobs, top_logprobs_num=top_k)])
    if stream:
        chunks = _chat_chunks(request, states, rid, name, want_logprobs, include_usage, params.stop)
        return await _send_events(request, states, chunks)
    [out] = await wait_all(request, states)
    reason, matched = _finish(out)
    logprobs = {"content": _chat_logprobs(engine, out, 0)} if want_logprobs else None
    choice = {"index": 0, "message": {"role": "assistant", "content": out.text or "", "reasoning_content": None},
              "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
    return web.json_response({"id": rid, "object": "chat.completion", "created": int(time.time()),
                              "model": name, "choices": [choice], "usage": _usage([out])})


def _chat_logprobs(engine: Engine, out: GenerateOutput, start: int) -> list[dict[str, Any]]:
    """OpenAI's chat log-probs of the output tokens from `start` on."""
    tops = out.output_top_logprobs or [[] for _ in out.output_ids]
    return [{**_chat_token(engine, lp, tid), "top_logprobs": [_chat_token(engine, v, t) for v, t in top]}
            for lp, tid, top in zip((out.output_token_logprobs or [])[start:], out.output_ids[start:], tops[start:])]


def _chat_token(engine: Engine, logprob: float, token_id: int) -> dict[str, Any]:
    text = _token_text(engine, token_id)
    return {"token": text, "bytes": list(text.encode()), "logprob": logprob}


async def _chat_chunks(request: web.Request, states: list, rid: str, name: str, want_logprobs: bool,
                       include_usage: bool, stops: Sequence[str]) -> AsyncIterator[dict[str, Any]]:
    """`chat.completion.chunk`s: the role, content deltas, an empty delta with the finish reason,
    then the usage if asked for."""
    engine = request.app[ENGINE_KEY]
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": choices}
        if include_usage:
            event["usage"] = usage
        return event

    def choice(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}

    yield chunk([choice({"role": "assistant", "content": ""})])
    text, num_sent, out = StreamedText(stops), 0, None
    async for batch in _follow(engine, states):
        [(_, out)] = batch  # one request
        final = out.finish_reason is not None
        delta = text.advance(out.text or "", final)
        if delta or (final and len(out.output_ids) > num_sent and want_logprobs):
            logprobs = {"content": _chat_logprobs(engine, out, num_sent)} if want_logprobs else None
            num_sent = len(out.output_ids)
            yield chunk([choice({"content": delta}, logprobs)])
    assert out is not None and out.finish_reason is not None, "a request's stream ends with its final output"
    record_finished(request, [out])
    reason, matched = _finish(out)
    yield chunk([choice({}, finish=reason, matched_stop=matched)])
    if include_usage:
        yield chunk([], _usage([out]))
