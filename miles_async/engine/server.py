"""SGLang's HTTP API (0.5.23) in front of the embedded engine (aiohttp.web), and OpenAI's.

    miles-async serve engine --model DIR --port 30000
    curl -s localhost:30000/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8}}'

Endpoints, field names and answers are SGLang's (python/sglang/srt/entrypoints/http_server.py
and managers/io_struct.py; tests/e2e/test_sglang_conformance.py checks them against the wheel),
so `EngineClient` and any SGLang client work against either server:
  POST /generate                  text | input_ids (one, or a batch as a list), sampling_params,
                                  rid (a batch's "r" becomes "r_0", "r_1", ...), return_logprob,
                                  logprob_start_len, top_logprobs_num, return_text_in_logprobs,
                                  return_routed_experts, stream (SSE "data: {...}" lines, then
                                  "data: [DONE]")
                                  -> text, output_ids, meta_info {id, finish_reason,
                                  prompt_tokens, completion_tokens, cached_tokens, weight_version,
                                  weight_versions [{version (its label), start, end}] over output
                                  positions, e2e_latency, input_token_logprobs / output_token_logprobs
                                  [[logprob, id, text|null]] (the first input one's logprob null),
                                  input_top_logprobs / output_top_logprobs (per position, k of those
                                  or null), routed_experts (base64 int32, [prompt+completion-1,
                                  layers, k])}
  GET  /health, /health_generate, /model_info (/get_model_info), /server_info (/get_server_info:
       ServerArgs-like fields, flat, plus internal_states), /v1/loads, /get_load (sglang-router
       0.3.2 polls it; SGLang 0.5.23 itself has /v1/loads only)
  POST /flush_cache, /abort_request {rid (a prefix: every request whose rid starts with it),
       abort_all}, /pause_generation {mode}, /continue_generation
  Weights: /update_weights_from_disk {model_path, weight_version}, /update_weight_version
       {new_version}, /init_weights_update_group and /destroy_weights_update_group (a
       torch.distributed group whose rank 0 broadcasts), /update_weights_from_distributed {names,
       dtypes, shapes, group_name, weight_version} (buckets of one update, live once every weight
       has arrived, or at /end_weight_update after /begin_weight_update), /release_memory_occupation
       and /resume_memory_occupation {tags: "weights", "kv_cache"} (the memory given back and taken
       again; released weights come back empty: push a version), /update_weights_from_tensor
       (refused: see its handler).
OpenAI's (openai.py): GET /v1/models, /v1/models/{id}; POST /v1/completions, /v1/chat/completions
(streamed with stream: true). The model is named by its served name (`served_model_name`, the CLI's
--served-model-name; by default the model's own name: a folder's base name, a Hub id's repository).
GET /metrics: Prometheus text (metrics.py names every metric).
Errors are JSON on every route. A malformed request gets HTTP 400 naming the field,
{"error": {"message": ...}} (the weight endpoints answer as SGLang's do, {"success": false,
"message": ...}); a full queue or unavailable weights 503. The /v1 routes, unknown routes (404),
wrong methods (405) and a body too large (413) answer in OpenAI's shape, {"error": {"message",
"type", "param", "code"}}. Streamed /generate outputs are cumulative, as SGLang's are by default.
What this module shares with openai.py (keys, field checks, error shapes, AppServer) is http_base.py.
"""

from __future__ import annotations

import array
import asyncio
import base64
import datetime
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
from aiohttp import web

import miles_async
from miles_async.engine import openai
from miles_async.engine.core import PAUSE_MODES, Engine, EngineOverloadedError, WeightsUnavailableError
from miles_async.engine.http_base import (
    ENGINE_KEY,
    LATENCY_KEY,
    MODEL_NAME_KEY,
    STARTED_KEY,
    AppServer,
    BadRequest,
    body_field,
    default_served_model_name,
    native_error,
    openai_error,
    read_json,
    record_finished,
    required_field,
    submit_all,
    token_id_list,
    wait_all,
)
from miles_async.engine.metrics import CONTENT_TYPE, Histogram, Page
from miles_async.engine.request import GenerateOutput, GenerateRequest, TopLogprobs
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.weights import GroupReceiver
from miles_async.transport.errors import TransportError

log = logging.getLogger(__name__)

RECEIVER_KEY = web.AppKey("receiver", GroupReceiver)
MAX_BODY_BYTES = 64 * 2**20
# GenerateReqInput fields for features this engine does not have: a request that sets one gets a
# 400 instead of an answer that silently ignores it. Other unknown fields are ignored, as SGLang does.
UNSUPPORTED_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "session_params",
                      "custom_logit_processor", "return_hidden_states", "token_ids_logprob",
                      "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_sampling_mask")
# Our model families' transformers class names, for a checkpoint without them in its config.json.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


# ----- generation -----

def parse_generate(body: dict[str, Any], engine: Engine) -> tuple[list[GenerateRequest], bool, bool]:
    """GenerateReqInput → engine requests; returns (requests, is_batch, return_text_in_logprobs)."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"{name} is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of text and input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        if engine.tokenizer is None:
            raise BadRequest("this engine has no tokenizer: send input_ids instead of text")
        prompts = [engine.tokenizer.encode(t) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = ([token_id_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)] if is_batch
                   else [token_id_list(input_ids, "input_ids")])
    count = len(prompts)
    params = _per_item(body.get("sampling_params"), count, is_batch, "sampling_params", dict)
    rids = _per_item(body.get("rid"), count, is_batch, "rid", str)
    return_logprob = _per_item(body.get("return_logprob"), count, is_batch, "return_logprob", bool)
    starts = _per_item(body.get("logprob_start_len"), count, is_batch, "logprob_start_len", int)
    tops = _per_item(body.get("top_logprobs_num"), count, is_batch, "top_logprobs_num", int)
    return_experts = body_field(body, "return_routed_experts", bool, False)
    if body_field(body, "routed_experts_start_len", int, 0):
        raise BadRequest("routed_experts_start_len is not supported: the embedded engine returns every token's "
                         "experts (leave it 0)")
    try:
        requests = [
            GenerateRequest(input_ids=prompt, sampling_params=SamplingParams.from_json(params[i], engine.vocab_size),
                            rid=rids[i], return_logprob=bool(return_logprob[i]), return_routed_experts=return_experts,
                            logprob_start_len=-1 if starts[i] is None else starts[i],
                            top_logprobs_num=tops[i] or 0)
            for i, prompt in enumerate(prompts)]
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e)) from None
    if is_batch and rids[0] is not None and len(set(rids)) != count:
        raise BadRequest("rid must name each request of a batch once")
    return requests, is_batch, body_field(body, "return_text_in_logprobs", bool, False)


def _per_item(value: Any, count: int, is_batch: bool, name: str, kind: type) -> list[Any]:
    """SGLang lets a batch give one value for all items or a list of one per item."""
    if value is None:
        return [None] * count
    if is_batch and isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name} has {len(value)} items for a batch of {count}")
        items = value
    elif is_batch and kind is str:
        return [f"{value}_{i}" for i in range(count)]  # SGLang's rid prefix for a batch
    else:
        items = [value] * count
    for item in items:
        if item is not None and (not isinstance(item, kind) or (kind is not bool and isinstance(item, bool))):
            raise BadRequest(f"{name} must be {kind.__name__} (or a list of them for a batch), got {type(item).__name__}")
    return items


def format_output(out: GenerateOutput, engine: Engine, text_in_logprobs: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        # The version of every output token as spans [start, end) (a partial rollout spans updates);
        # before the first token, SGLang reports the current version over [0, 0).
        "weight_versions": [{"version": label, "start": s.start, "end": s.end}
                            for s, label in zip(out.weight_versions, out.weight_version_labels)]
        or [{"version": out.weight_version, "start": 0, "end": 0}],
        "e2e_latency": round(out.e2e_latency_s, 6),
    }
    if engine.config.speculative_tokens and out.spec_verify_ct:  # SGLang's speculative decoding metrics
        meta["spec_verify_ct"] = out.spec_verify_ct
        meta["spec_num_proposed_drafts"] = out.spec_draft_tokens
        meta["spec_num_correct_drafts"] = out.spec_accepted_drafts
        meta["spec_accept_rate"] = out.spec_accepted_drafts / out.spec_draft_tokens if out.spec_draft_tokens else 0.0
        meta["spec_accept_length"] = out.completion_tokens / out.spec_verify_ct
    if out.output_token_logprobs is not None:
        decode = engine.tokenizer.decode if text_in_logprobs and engine.tokenizer is not None else None

        def entries(pairs: list[tuple[float | None, int]] | TopLogprobs) -> list[list[Any]]:
            return [[lp, tid, decode([tid]) if decode else None] for lp, tid in pairs]

        meta["input_token_logprobs"] = entries(out.input_token_logprobs or [])
        meta["output_token_logprobs"] = entries(list(zip(out.output_token_logprobs, out.output_ids)))
        if out.input_top_logprobs is not None:
            meta["input_top_logprobs"] = [None if top is None else entries(top) for top in out.input_top_logprobs]
            meta["output_top_logprobs"] = [entries(top) for top in out.output_top_logprobs or []]
    if out.routed_experts_TLk is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts_TLk)
    return {"text": out.text if out.text is not None else "", "output_ids": out.output_ids, "meta_info": meta}


def encode_routed_experts(experts_TLk: torch.Tensor) -> str:
    """SGLang's wire form: base64 of a little-endian int32 C-order array."""
    values = array.array("i", experts_TLk.to(torch.int32).flatten().tolist())
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    requests, is_batch, text_in_logprobs = parse_generate(body, engine)
    stream = body_field(body, "stream", bool, False)
    if stream and is_batch:
        raise BadRequest("stream is supported for one prompt at a time, not for a batch")
    states = await submit_all(engine, requests)
    if stream:
        return await _stream(request, engine, states[0], text_in_logprobs)
    outputs = [format_output(out, engine, text_in_logprobs) for out in await wait_all(request, states)]
    return web.json_response(outputs if is_batch else outputs[0])


async def _stream(request: web.Request, engine: Engine, state, text_in_logprobs: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for out in engine.stream(state):
            chunk = json.dumps(format_output(out, engine, text_in_logprobs))
            await response.write(f"data: {chunk}\n\n".encode())
        record_finished(request, [out])
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        await asyncio.shield(engine.abort(state.rid))
        raise
    await response.write_eof()
    return response


# ----- health and information -----

async def health(request: web.Request) -> web.Response:
    """200 while the engine can serve; 503 naming the reason when its weights are torn."""
    problem = request.app[ENGINE_KEY].weights.serving_error()
    return web.Response(status=200) if problem is None else native_error(503, f"weights unavailable: {problem}")


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token (SGLang's deep health check)."""
    engine = request.app[ENGINE_KEY]
    out = await engine.generate(GenerateRequest(input_ids=[0], sampling_params=SamplingParams(
        max_new_tokens=1, temperature=0.0)))
    return web.Response(status=200 if out.finish_reason and out.finish_reason["type"] != "abort" else 503)


def _hf_config(engine: Engine) -> dict[str, Any]:
    """The checkpoint's config.json (model_type, architectures), or what the model says of itself."""
    path = Path(engine.model_path or "") / "config.json"
    if engine.model_path and path.is_file():
        return json.loads(path.read_text())
    family = getattr(engine.model.config, "family", None)
    return {"model_type": family, "architectures": [ARCHITECTURES[family]] if family in ARCHITECTURES else None}


async def model_info(request: web.Request) -> web.Response:
    """SGLang's /model_info keys (whether the model is MoE is in `architectures` / `model_type`)."""
    engine = request.app[ENGINE_KEY]
    hf = _hf_config(engine)
    return web.json_response({
        "model_path": engine.model_path,
        "served_model_name": request.app[MODEL_NAME_KEY],
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": "safetensors",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
    })


async def server_info(request: web.Request) -> web.Response:
    """Flat, as SGLang's: ServerArgs fields with this engine's values, then its live state."""
    engine = request.app[ENGINE_KEY]
    config = engine.config
    return web.json_response({
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "served_model_name": request.app[MODEL_NAME_KEY],
        "skip_tokenizer_init": engine.tokenizer is None,
        "load_format": "safetensors",
        "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
        "device": next(engine.model.parameters()).device.type,
        "context_length": engine.max_seq_len,
        "page_size": config.block_size,
        "max_total_tokens": engine.cache.num_blocks * config.block_size,
        "max_running_requests": config.max_running_requests,
        "max_queued_requests": config.max_waiting_requests,
        "max_prefill_tokens": config.max_prefill_tokens,
        "chunked_prefill_size": config.max_prefill_tokens,
        "random_seed": config.seed,
        "enable_deterministic_inference": config.batch_invariant,
        "tp_size": 1,
        "dp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "weight_version": engine.weight_version,
        "startup_time": request.app[STARTED_KEY],
        "internal_states": [msgspec.to_builtins(engine.stats())],
        "version": f"miles-async {miles_async.__version__}",
    })


async def get_load(request: web.Request) -> web.Response:
    """The load sglang-router polls: one entry per DP rank (one here), in SGLang's earlier shape."""
    stats = request.app[ENGINE_KEY].stats()
    return web.json_response([{"dp_rank": 0, "num_reqs": stats.num_running + stats.num_waiting,
                               "num_waiting_reqs": stats.num_waiting, "num_tokens": stats.num_used_tokens}])


async def v1_loads(request: web.Request) -> web.Response:
    """SGLang 0.5.23's /v1/loads: its LoadSnapshot's core fields, for the one rank."""
    engine = request.app[ENGINE_KEY]
    stats = engine.stats()
    capacity = engine.cache.num_blocks * engine.config.block_size
    return web.json_response({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": f"miles-async {miles_async.__version__}",
        "accelerator": None,
        "num_accelerators": 0,
        "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": stats.num_running,
                   "num_waiting_reqs": stats.num_waiting, "num_used_tokens": stats.num_used_tokens,
                   "max_total_num_tokens": capacity, "max_running_requests": engine.config.max_running_requests,
                   "token_usage": stats.num_used_tokens / capacity if capacity else 0.0,
                   "cache_hit_rate": stats.prefix_cache_hit_rate}],
    })


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: the engine's load, token counters, KV use and weight version (metrics.py)."""
    engine = request.app[ENGINE_KEY]
    stats = engine.stats()
    capacity = engine.cache.num_blocks * engine.config.block_size
    page = Page({"model_name": request.app[MODEL_NAME_KEY]})
    page.gauge("sglang:num_running_reqs", "The number of running requests.", stats.num_running)
    page.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", stats.num_waiting)
    page.counter("sglang:prompt_tokens_total", "Number of prefill tokens processed (the prefix cache's queries).",
                 stats.num_prompt_tokens)
    page.counter("sglang:cached_tokens_total", "Number of cached prompt tokens (the prefix cache's hits).",
                 stats.num_cached_prompt_tokens)
    page.counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                 stats.num_generated_tokens)
    page.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", stats.prefix_cache_hit_rate)
    page.gauge("sglang:token_usage", "The token usage: KV cache blocks held by requests, 0-1.",
               stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0)
    page.gauge("sglang:num_used_tokens", "The number of used tokens.", stats.num_used_tokens)
    page.gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", capacity)
    page.counter("sglang:num_requests_total", "Number of requests processed.", stats.num_finished_requests)
    page.counter("sglang:num_aborted_requests_total", "Number of requests aborted.", stats.num_aborted_requests)
    page.counter("sglang:num_retracted_requests_total", "Total number of retracted requests.", stats.num_retractions)
    page.histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                   request.app[LATENCY_KEY])
    page.gauge("miles_async:weight_version", "The weight version served.", engine.weights.version)
    return web.Response(body=page.text().encode(), headers={"Content-Type": CONTENT_TYPE})


# ----- control -----

async def flush_cache(request: web.Request) -> web.Response:
    freed = await request.app[ENGINE_KEY].flush_cache()
    return web.Response(text=f"Cache flushed ({freed} blocks freed).\n")


async def abort_request(request: web.Request) -> web.Response:
    """Every request whose rid starts with `rid` (SGLang's scheduler matches a prefix), or all.

    SGLang takes an empty rid as a prefix of every rid; here that needs `abort_all` said outright.
    """
    body = await read_json(request)
    rid = body_field(body, "rid", str, "")
    abort_all = body_field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise BadRequest("give rid (the request to abort, or a prefix of its rid) or abort_all: true")
    count = await request.app[ENGINE_KEY].abort(rid or None, abort_all=abort_all, prefix=True)
    return web.json_response({"success": True, "num_aborted": count})


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_json(request, optional=True)
    mode = body_field(body, "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    await request.app[ENGINE_KEY].pause(mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


# ----- weights -----

def _weight_answer(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def _weight_call(call: Callable[[], Awaitable[web.Response]], what: str) -> web.Response:
    """Run a weight endpoint; a failure is SGLang's {"success": false, "message"} with HTTP 400."""
    try:
        return await call()
    except (ValueError, TypeError, RuntimeError, OSError, TransportError) as e:
        log.warning("%s failed: %s: %s", what, type(e).__name__, e)
        return _weight_answer(False, f"Failed to {what}: {type(e).__name__}: {e}")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]

    async def call() -> web.Response:
        body = await read_json(request)
        model_path = required_field(body, "model_path", str)
        weight_version = body_field(body, "weight_version", str)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={body['load_format']!r} is not supported (safetensors folders only)")
        num_aborted = await engine.abort(abort_all=True) if body_field(body, "abort_all_requests", bool, False) else 0
        version = await engine.weights.update_from_disk(model_path, weight_version)
        return _weight_answer(True, f"Succeeded to update model weights (version {version}).", num_paused_requests=0,
                              num_aborted_requests=num_aborted, weight_version=version)

    return await _weight_call(call, "update weights")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]

    async def call() -> web.Response:
        body = await read_json(request)
        new_version = required_field(body, "new_version", str)
        if body_field(body, "abort_all_requests", bool, True):  # SGLang's default
            await engine.abort(abort_all=True)
        label = await engine.weights.relabel(new_version)
        return _weight_answer(True, f"Weight version updated to {label}", new_version=label)

    return await _weight_call(call, "update weight version")


async def init_weights_update_group(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]

    async def call() -> web.Response:
        body = await read_json(request)
        group_name = body_field(body, "group_name", str, "weight_update_group")
        await receiver.init_group(required_field(body, "master_address", str), required_field(body, "master_port", int),
                                  required_field(body, "rank_offset", int), required_field(body, "world_size", int),
                                  group_name, body_field(body, "backend", str, "nccl"))
        return _weight_answer(True, f"Joined weight update group {group_name!r}.")

    return await _weight_call(call, "init weights update group")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]

    async def call() -> web.Response:
        body = await read_json(request, optional=True)
        group_name = body_field(body, "group_name", str, "weight_update_group")
        await receiver.destroy_group(group_name)
        return _weight_answer(True, f"Destroyed weight update group {group_name!r}.")

    return await _weight_call(call, "destroy weights update group")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine, receiver = request.app[ENGINE_KEY], request.app[RECEIVER_KEY]

    async def call() -> web.Response:
        body = await read_json(request)
        names, dtypes, shapes = (required_field(body, key, list) for key in ("names", "dtypes", "shapes"))
        if not all(isinstance(n, str) for n in names) or not all(isinstance(d, str) for d in dtypes):
            raise BadRequest("names and dtypes must be lists of strings")
        if not all(isinstance(s, list) and all(type(d) is int for d in s) for s in shapes):
            raise BadRequest("shapes must be a list of lists of integers")
        if body.get("load_format") not in (None, "auto"):
            raise BadRequest(f"load_format={body['load_format']!r} is not supported (plain tensors only)")
        if body_field(body, "abort_all_requests", bool, False):
            await engine.abort(abort_all=True)
        label = await receiver.receive(names, dtypes, shapes, body_field(body, "group_name", str, "weight_update_group"),
                                       body_field(body, "weight_version", str))
        if label is None:
            return _weight_answer(True, f"Received {len(names)} tensors; the update goes live when complete.")
        return _weight_answer(True, f"Succeeded to update model weights (version {label}).", weight_version=label)

    return await _weight_call(call, "update weights from distributed")


async def begin_weight_update(request: web.Request) -> web.Response:
    await request.app[RECEIVER_KEY].begin_session()
    return _weight_answer(True, "Weight update session opened: it goes live at /end_weight_update.")


async def end_weight_update(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER_KEY]

    async def call() -> web.Response:
        label = await receiver.end_session()
        return _weight_answer(True, f"Weight update session closed (version {label}).", weight_version=label)

    return await _weight_call(call, "end weight update")


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """Refused. SGLang's body is `serialized_named_tensors`: pickles (its MultiprocessingSerializer)
    of tensors shared by handle (CUDA IPC, or file descriptors) from a trainer colocated with the
    engine's scheduler. The embedded engine serves from another process than any trainer, so the
    handles cannot be opened here, and unpickling a request body would run whatever it holds.
    The colocated handoff is in-process instead (`WeightStore.adopt_weights`, the engine actor's)."""
    return _weight_answer(False, "update_weights_from_tensor is not supported by the embedded engine: SGLang's "
                          "serialized_named_tensors are pickled tensor handles for a colocated trainer, which this "
                          "server can neither open nor safely unpickle; use /update_weights_from_distributed or "
                          "/update_weights_from_disk")


async def memory_occupation(request: web.Request) -> web.Response:
    """/release_memory_occupation and /resume_memory_occupation {tags}: give back (or allocate
    again) the weights' and/or the KV cache's memory (`Engine.release_memory_occupation`); an
    engine with requests in flight refuses (400). SGLang answers with an empty JSON body too."""
    body = await read_json(request, optional=True)  # a malformed body is still a 400
    tags = body_field(body, "tags", list)
    if tags is not None and not all(isinstance(t, str) for t in tags):
        raise BadRequest("tags must be a list of strings (\"weights\", \"kv_cache\")")
    engine = request.app[ENGINE_KEY]
    try:
        if request.path == "/release_memory_occupation":
            await engine.release_memory_occupation(tags)
        else:
            await engine.resume_memory_occupation(tags)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return web.json_response(None)


# ----- the application -----

@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as JSON (module docstring), and the server keeps serving."""
    openai_route = request.path.startswith("/v1/")
    try:
        return await handler(request)
    except BadRequest as e:
        if openai_route:
            return openai_error(e.status, str(e), param=e.param, code=e.code)
        return native_error(e.status, str(e))
    except (EngineOverloadedError, WeightsUnavailableError) as e:
        return openai_error(503, str(e)) if openai_route else native_error(503, str(e))
    except web.HTTPException as e:  # aiohttp's own: no such route (404), wrong method (405), body too large (413)
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return openai_error(e.status, f"{request.method} {request.path}: {e.reason}", headers=allow)
    except ConnectionResetError:  # the client went away: nobody to answer
        raise
    except Exception:  # the HTTP boundary: a fault of ours, with its traceback in the log, not the client's
        log.exception("%s %s failed", request.method, request.path)
        return openai_error(500, f"{request.method} {request.path} failed inside the server (its log says why)")


def create_app(engine: Engine, served_model_name: str | None = None) -> web.Application:
    """The aiohttp application; it starts the engine with itself and stops it on cleanup.
    `served_model_name`: what the OpenAI routes and /metrics call the model (default: its own name,
    `default_served_model_name`)."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[RECEIVER_KEY] = receiver = GroupReceiver(engine.weights)
    app[STARTED_KEY] = time.time()
    app[MODEL_NAME_KEY] = served_model_name or default_served_model_name(engine.model_path)
    app[LATENCY_KEY] = Histogram()

    async def start_engine(app: web.Application) -> None:
        await engine.start()

    async def stop_engine(app: web.Application) -> None:
        await receiver.close()
        await engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    routes = app.router
    routes.add_post("/generate", generate)
    routes.add_get("/health", health)
    routes.add_get("/health_generate", health_generate)
    routes.add_get("/metrics", metrics)
    for path, handler in (("/model_info", model_info), ("/get_model_info", model_info),
                          ("/server_info", server_info), ("/get_server_info", server_info),
                          ("/get_load", get_load), ("/v1/loads", v1_loads)):
        routes.add_get(path, handler)
    routes.add_route("*", "/flush_cache", flush_cache)
    for path, handler in (("/abort_request", abort_request), ("/pause_generation", pause_generation),
                          ("/continue_generation", continue_generation),
                          ("/update_weights_from_disk", update_weights_from_disk),
                          ("/update_weight_version", update_weight_version),
                          ("/init_weights_update_group", init_weights_update_group),
                          ("/destroy_weights_update_group", destroy_weights_update_group),
                          ("/update_weights_from_distributed", update_weights_from_distributed),
                          ("/begin_weight_update", begin_weight_update), ("/end_weight_update", end_weight_update),
                          ("/update_weights_from_tensor", update_weights_from_tensor)):
        routes.add_post(path, handler)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        routes.add_get(path, memory_occupation)
        routes.add_post(path, memory_occupation)
    openai.add_routes(app)
    return app


class EngineServer(AppServer):
    """Serve an engine on host:port (port 0: any free port) inside the running event loop.

        async with EngineServer(engine) as server:
            client = EngineClient(server.url)
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 served_model_name: str | None = None) -> None:
        super().__init__(host, port, api_key)
        self.engine = engine
        self.served_model_name = served_model_name

    def make_app(self) -> web.Application:
        return create_app(self.engine, self.served_model_name)


async def serve_forever(engine: Engine, host: str, port: int, api_key: str | None = None,
                        served_model_name: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM; print the URL once listening (port 0 picks a free one)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    name = served_model_name or default_served_model_name(engine.model_path)
    async with EngineServer(engine, host, port, api_key=api_key, served_model_name=name) as server:
        print(f"miles-async engine: serving {engine.model_path} as {name!r} on {server.url}", flush=True)
        await stop.wait()


def main(model_path: str, host: str, port: int, api_key: str | None = None, served_model_name: str | None = None,
         **engine_config: Any) -> int:
    """`miles-async serve engine`: load the model, serve (as `served_model_name`) until interrupted."""
    from miles_async.engine.config import EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine.from_pretrained(model_path, config=EngineConfig(**engine_config))
    except (OSError, ValueError) as e:
        print(f"miles-async serve engine: cannot serve {model_path}: {e}", file=sys.stderr)
        return 2
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logging.getLogger("miles_async.engine").warning(
            "serving on %s without --api-key: anyone who reaches this address can generate and replace the weights",
            host)
    asyncio.run(serve_forever(engine, host, port, api_key, served_model_name))
    return 0
