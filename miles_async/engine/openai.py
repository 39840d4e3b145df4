"""OpenAI's API in front of the embedded engine, in the shapes SGLang 0.5.23 serves it
(python/sglang/srt/entrypoints/openai/protocol.py); server.py mounts these routes.

    curl -s localhost:30000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "echo": true}'
    curl -s localhost:30000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

  GET  /v1/models            one card: the served model (its path), its context length
  POST /v1/completions       prompt: a text, token ids, or a list of either (one choice each);
                             max_tokens (16), temperature, top_p, top_k, stop, stop_token_ids, seed,
                             ignore_eos, skip_special_tokens; echo: the prompt leads the text, and
                             with logprobs its tokens lead the log-probs (the first null); logprobs k:
                             each token's log-prob and the k most likely tokens at each position
  POST /v1/chat/completions  messages rendered by the model's chat template (the engine needs a
                             tokenizer that has one), then as above; logprobs / top_logprobs in
                             OpenAI's chat shape
Not supported, refused with a 400 naming the field: stream, n > 1, best_of, suffix, tools,
response_format and the other fields the embedded engine lacks (sampling.py's NEUTRAL_FIELDS
left at their neutral values pass). Without a tokenizer a token's text is "token_id:<id>".
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from miles_async.engine.core import Engine
from miles_async.engine.request import GenerateOutput, GenerateRequest, TopLogprobs
from miles_async.engine.sampling import NEUTRAL_FIELDS, SamplingParams
from miles_async.engine.server import (
    ENGINE_KEY,
    STARTED_KEY,
    BadRequest,
    _field,
    _read_json,
    _token_ids,
    served_model_name,
    submit_all,
    wait_all,
)

# Request fields this engine cannot honour: set to anything but their default, a 400.
UNSUPPORTED = {"stream": False, "best_of": None, "suffix": None, "tools": None, "tool_choice": None,
               "response_format": None, "return_hidden_states": False, "lora_path": None, "session_params": None,
               "custom_logit_processor": None, "return_routed_experts": False, "parallel_tool_calls": None}
# OpenAI's sampling fields under SGLang's names (sampling_params), checked by SamplingParams.from_json.
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "seed": "sampling_seed",
           "min_tokens": "min_new_tokens"}
PASSED = ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
          "no_stop_trim", *NEUTRAL_FIELDS)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    name = served_model_name(engine)
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(request.app[STARTED_KEY]), "owned_by": "miles-async",
        "root": name, "parent": None, "max_model_len": engine.max_seq_len}]})


def _sampling(body: dict[str, Any], engine: Engine, prompt_len: int, default_max: int | None) -> SamplingParams:
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default):
            raise BadRequest(f"{name} is not supported by the embedded engine's OpenAI API")
    params = {key: body[key] for key in PASSED if body.get(key) is not None}
    for name, sglang_name in RENAMED.items():
        if body.get(name) is not None:
            params[sglang_name] = body[name]
    # Without max_tokens: OpenAI's default for completions, the rest of the context for chat (SGLang's).
    params.setdefault("max_new_tokens", default_max if default_max is not None else engine.max_seq_len - prompt_len)
    try:
        return SamplingParams.from_json(params, engine.vocab_size)
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e).replace("sampling_params.max_new_tokens", "max_tokens")
                         .replace("sampling_params.", "")) from None


def _token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else f"token_id:{token_id}"


def _finish(out: GenerateOutput) -> tuple[str | None, Any]:
    reason = out.finish_reason or {}
    return reason.get("type"), reason.get("matched")


def _usage(outs: list[GenerateOutput]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ----- /v1/completions -----

def _prompts(value: Any, engine: Engine) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) of each prompt: a text, token ids, or a list of either."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(x) is int for x in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest("prompt must be a text, a list of token ids, or a non-empty list of either")
    ids, texts = [], []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if engine.tokenizer is None:
                raise BadRequest("this engine has no tokenizer: send prompt as token ids")
            ids.append(engine.tokenizer.encode(item))
            texts.append(item)
        else:
            ids.append(_token_ids(item, f"prompt[{i}]"))
            texts.append(None)
    return ids, texts


async def completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    prompts, texts = _prompts(body.get("prompt"), engine)
    echo = _field(body, "echo", bool, False)
    top_k = _field(body, "logprobs", int)  # None: no log-probs
    if top_k is not None and top_k < 0:
        raise BadRequest(f"logprobs must be >= 0, got {top_k}")
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests = [GenerateRequest(input_ids=ids, sampling_params=_sampling(body, engine, len(ids), 16), rid=f"{rid}_{i}",
                                return_logprob=top_k is not None,
                                logprob_start_len=0 if echo and top_k is not None else -1, top_logprobs_num=top_k or 0)
                for i, ids in enumerate(prompts)]
    outs = await wait_all(engine, await submit_all(engine, requests))
    choices = []
    for i, (out, ids, text) in enumerate(zip(outs, prompts, texts)):
        reason, matched = _finish(out)
        shown = out.text or ""
        if echo:
            prompt_text = text if text is not None else (engine.tokenizer.decode(ids) if engine.tokenizer else "")
            shown = prompt_text + shown
        choices.append({"index": i, "text": shown, "finish_reason": reason, "matched_stop": matched,
                        "logprobs": None if top_k is None else _completion_logprobs(engine, out, echo, top_k)})
    return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                              "model": served_model_name(engine), "choices": choices, "usage": _usage(outs)})


def _completion_logprobs(engine: Engine, out: GenerateOutput, echo: bool, top_k: int) -> dict[str, Any]:
    """OpenAI's LogProbs: per token its text, offset in the choice's text, log-prob and top-k."""
    pairs: list[tuple[float | None, int]] = list(zip(out.output_token_logprobs or [], out.output_ids))
    tops: list[TopLogprobs | None] = list(out.output_top_logprobs or [None] * len(pairs))
    if echo:
        prompt_pairs = out.input_token_logprobs or []
        pairs = list(prompt_pairs) + pairs
        tops = list(out.input_top_logprobs or [None] * len(prompt_pairs)) + tops
    tokens = [_token_text(engine, t) for _, t in pairs]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [None if t is None else {_token_text(engine, tid): lp for lp, tid in t} for t in tops] if top_k else []
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top, "text_offset": offsets}


# ----- /v1/chat/completions -----

def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, a list of text parts, or null")
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
        raise BadRequest(f"messages: the chat template cannot render them: {e}") from None
    return engine.tokenizer.encode(text)


async def chat_completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    ids = _render(engine, _messages(body.get("messages")))
    want_logprobs = _field(body, "logprobs", bool, False)
    top_k = _field(body, "top_logprobs", int, 0)
    if top_k and not want_logprobs:
        raise BadRequest("top_logprobs needs logprobs: true")
    if top_k < 0:
        raise BadRequest(f"top_logprobs must be >= 0, got {top_k}")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = _sampling(body, engine, len(ids), None)
    [out] = await wait_all(engine, await submit_all(engine, [GenerateRequest(
        input_ids=ids, sampling_params=params, rid=rid, return_logprob=want_logprobs, top_logprobs_num=top_k)]))
    reason, matched = _finish(out)
    logprobs = None
    if want_logprobs:
        tops = out.output_top_logprobs or [[] for _ in out.output_ids]
        logprobs = {"content": [
            {**_chat_token(engine, lp, tid), "top_logprobs": [_chat_token(engine, v, t) for v, t in top]}
            for lp, tid, top in zip(out.output_token_logprobs or [], out.output_ids, tops)]}
    choice = {"index": 0, "message": {"role": "assistant", "content": out.text or "", "reasoning_content": None},
              "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
    return web.json_response({"id": rid, "object": "chat.completion", "created": int(time.time()),
                              "model": served_model_name(engine), "choices": [choice], "usage": _usage([out])})


def _chat_token(engine: Engine, logprob: float, token_id: int) -> dict[str, Any]:
    text = _token_text(engine, token_id)
    return {"token": text, "bytes": list(text.encode()), "logprob": logprob}
