"""SGLang's native HTTP API in front of the embedded engine (aiohttp.web).

    miles-async serve engine --model DIR --port 30000
    curl -s localhost:30000/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8}}'

Endpoints and field names are SGLang's (python/sglang/srt/entrypoints/http_server.py and
managers/io_struct.py), so `EngineClient` and any SGLang client work against either server:
  POST /generate                  text | input_ids (one, or a batch as a list), sampling_params,
                                  rid, return_logprob, return_text_in_logprobs,
                                  return_routed_experts, stream (SSE "data: {...}" lines, then
                                  "data: [DONE]")
                                  -> text, output_ids, meta_info {id, finish_reason,
                                  prompt_tokens, completion_tokens, cached_tokens, weight_version,
                                  e2e_latency, output_token_logprobs [[logprob, id, text|null]],
                                  routed_experts (base64 int32, [prompt+completion-1, layers, k])}
  GET  /health, /health_generate, /get_model_info (/model_info), /get_server_info
  POST /flush_cache, /abort_request {rid, abort_all}, /pause_generation {mode},
       /continue_generation, /update_weights_from_disk {model_path, weight_version}
A malformed request gets HTTP 400 with {"error": {"message": ...}} naming the problem; a full
queue gets 503. Streamed outputs are cumulative, as SGLang's are by default.
"""

from __future__ import annotations

import abc
import array
import asyncio
import base64
import hmac
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from aiohttp import web

from miles_async.engine.core import PAUSE_MODES, Engine, EngineOverloadedError, WeightsUnavailableError
from miles_async.engine.request import GenerateOutput, GenerateRequest
from miles_async.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
MAX_BODY_BYTES = 64 * 2**20
# GenerateReqInput fields for features this engine does not have: a request that sets one gets a
# 400 instead of an answer that silently ignores it. Other unknown fields are ignored, as SGLang does.
UNSUPPORTED_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "session_params",
                      "custom_logit_processor", "return_hidden_states", "token_ids_logprob")


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400."""


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _read_json(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip() and optional:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = " or ".join(t.__name__ for t in _as_tuple(kind))
        raise BadRequest(f"{key} must be {names}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise BadRequest(f"{where} must be a list of integer token ids")
    return value


def parse_generate(body: dict[str, Any], engine: Engine) -> tuple[list[GenerateRequest], bool, bool]:
    """GenerateReqInput → engine requests; returns (requests, is_batch, return_text_in_logprobs)."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"{name} is not supported by the embedded engine")
    for name, neutral in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        if body.get(name) not in (None, neutral):
            raise BadRequest(f"{name}={body[name]!r} is not supported: the embedded engine returns output-token "
                             "log-probs only (leave it unset)")
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
        prompts = ([_token_ids(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)] if is_batch
                   else [_token_ids(input_ids, "input_ids")])
    count = len(prompts)
    params = _per_item(body.get("sampling_params"), count, is_batch, "sampling_params", dict)
    rids = _per_item(body.get("rid"), count, is_batch, "rid", str)
    return_logprob = _per_item(body.get("return_logprob"), count, is_batch, "return_logprob", bool)
    return_experts = _field(body, "return_routed_experts", bool, False)
    try:
        requests = [
            GenerateRequest(input_ids=prompt, sampling_params=SamplingParams.from_json(params[i], engine.vocab_size),
                            rid=rids[i], return_logprob=bool(return_logprob[i]), return_routed_experts=return_experts)
            for i, prompt in enumerate(prompts)]
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e)) from None
    if is_batch and rids[0] is not None and len(set(rids)) != count:
        raise BadRequest("rid must name each request of a batch once")
    return requests, is_batch, _field(body, "return_text_in_logprobs", bool, False)


def _per_item(value: Any, count: int, is_batch: bool, name: str, kind: type) -> list[Any]:
    """SGLang lets a batch give one value for all items or a list of one per item."""
    if value is None:
        return [None] * count
    if is_batch and isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name} has {len(value)} items for a batch of {count}")
        items = value
    elif is_batch and kind is str:
        return [f"{value}-{i}" for i in range(count)]  # SGLang's rid prefix for a batch
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
        # The version of every output token as spans [start, end) (a partial rollout spans updates).
        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in out.weight_versions],
        "e2e_latency": round(out.e2e_latency_s, 6),
    }
    if out.output_token_logprobs is not None:
        decode = engine.tokenizer.decode if text_in_logprobs and engine.tokenizer is not None else None
        meta["output_token_logprobs"] = [[lp, tid, decode([tid]) if decode else None]
                                         for lp, tid in zip(out.output_token_logprobs, out.output_ids)]
    if out.routed_experts_TLk is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts_TLk)
    result: dict[str, Any] = {"text": out.text if out.text is not None else "", "output_ids": out.output_ids,
                              "meta_info": meta}
    return result


def encode_routed_experts(experts_TLk: torch.Tensor) -> str:
    """SGLang's wire form: base64 of a little-endian int32 C-order array."""
    values = array.array("i", experts_TLk.to(torch.int32).flatten().tolist())
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    requests, is_batch, text_in_logprobs = parse_generate(body, engine)
    stream = _field(body, "stream", bool, False)
    if stream and is_batch:
        raise BadRequest("stream is supported for one prompt at a time, not for a batch")
    states = []
    try:
        for item in requests:
            states.append(engine.submit(item))
    except ValueError as e:
        await _abort_all(engine, states)
        raise BadRequest(str(e)) from None
    except EngineOverloadedError:
        await _abort_all(engine, states)
        raise
    if stream:
        return await _stream(request, engine, states[0], text_in_logprobs)
    try:
        await asyncio.gather(*(s.done.wait() for s in states))
    except asyncio.CancelledError:  # the client went away
        await asyncio.shield(_abort_all(engine, states))
        raise
    outputs = [format_output(engine.snapshot(s), engine, text_in_logprobs) for s in states]
    return web.json_response(outputs if is_batch else outputs[0])


async def _abort_all(engine: Engine, states: list) -> None:
    for state in states:
        await engine.abort(state.rid)


async def _stream(request: web.Request, engine: Engine, state, text_in_logprobs: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for out in engine.stream(state):
            chunk = json.dumps(format_output(out, engine, text_in_logprobs))
            await response.write(f"data: {chunk}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        await asyncio.shield(engine.abort(state.rid))
        raise
    await response.write_eof()
    return response


async def health(request: web.Request) -> web.Response:
    """200 while the engine can serve; 503 naming the reason when its weights are torn."""
    problem = request.app[ENGINE_KEY].weights.serving_error()
    return web.Response(status=200) if problem is None else _json_error(503, f"weights unavailable: {problem}")


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token (SGLang's deep health check)."""
    engine = request.app[ENGINE_KEY]
    out = await engine.generate(GenerateRequest(input_ids=[0], sampling_params=SamplingParams(
        max_new_tokens=1, temperature=0.0)))
    return web.Response(status=200 if out.finish_reason and out.finish_reason["type"] != "abort" else 503)


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    config = engine.model.config
    return web.json_response({
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "weight_version": engine.weight_version,
        "model_type": getattr(config, "family", None),
        "max_context_length": engine.max_seq_len,
        "vocab_size": engine.vocab_size,
        "is_moe": engine.is_moe,
    })


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"engine": "miles-async embedded", "model_path": engine.model_path,
                              "config": msgspec.to_builtins(engine.config),
                              "internal_states": [msgspec.to_builtins(engine.stats())]})


async def flush_cache(request: web.Request) -> web.Response:
    freed = await request.app[ENGINE_KEY].flush_cache()
    return web.Response(text=f"Cache flushed ({freed} blocks freed).\n")


async def abort_request(request: web.Request) -> web.Response:
    body = await _read_json(request)
    rid = _field(body, "rid", str, "")
    abort_all = _field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise BadRequest("give rid (the request to abort) or abort_all: true")
    count = await request.app[ENGINE_KEY].abort(rid or None, abort_all=abort_all)
    return web.json_response({"success": True, "num_aborted": count})


async def pause_generation(request: web.Request) -> web.Response:
    body = await _read_json(request, optional=True)
    mode = _field(body, "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    await request.app[ENGINE_KEY].pause(mode)
    return web.json_response({"success": True, "message": f"Generation paused (mode {mode})."})


async def continue_generation(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"success": True, "message": "Generation continued."})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    model_path = _field(body, "model_path", str)
    if not model_path:
        raise BadRequest("model_path (the checkpoint folder to load) is required")
    weight_version = _field(body, "weight_version", str)
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise BadRequest(f"load_format={body['load_format']!r} is not supported (safetensors folders only)")
    num_aborted = 0
    if _field(body, "abort_all_requests", bool, False):
        num_aborted = await engine.abort(abort_all=True)
    try:
        version = await engine.update_weights_from_disk(model_path, weight_version)
    except Exception as e:  # a boundary: any load failure is the caller's checkpoint, reported in full
        log.exception("update_weights_from_disk(%s) failed", model_path)
        return web.json_response({"success": False, "message": f"Failed to update weights: {type(e).__name__}: {e}",
                                  "num_paused_requests": 0}, status=400)
    return web.json_response({"success": True, "message": f"Succeeded to update model weights (version {version}).",
                              "num_paused_requests": 0, "num_aborted_requests": num_aborted,
                              "weight_version": version})


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _json_error(400, str(e))
    except (EngineOverloadedError, WeightsUnavailableError) as e:
        return _json_error(503, str(e))


def create_app(engine: Engine) -> web.Application:
    """The aiohttp application; it starts the engine with itself and stops it on cleanup."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine

    async def start_engine(app: web.Application) -> None:
        await engine.start()

    async def stop_engine(app: web.Application) -> None:
        await engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    return app


def _require_key(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": {"message": "missing or wrong API key (Authorization: Bearer ...)",
                                                "type": "unauthorized"}}, status=401)
        return await handler(request)

    return check


class AppServer(abc.ABC):
    """An aiohttp application served on host:port (port 0: any free one) inside the running loop.

    Subclasses say which application (`make_app`); `start` returns the URL, `stop` closes it, and
    `async with` does both. handler_cancellation: a client that disconnects cancels its handler
    (the engine then aborts its request). `api_key`: every request must carry
    `Authorization: Bearer <api_key>` (as SGLang's `--api-key`), else HTTP 401; a multi-node run
    sets one, since its engines listen on addresses other machines reach.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self._runner: web.AppRunner | None = None

    @abc.abstractmethod
    def make_app(self) -> web.Application:
        """The application to serve."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        app = self.make_app()
        if self.api_key:
            app.middlewares.append(_require_key(self.api_key))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class EngineServer(AppServer):
    """Serve an engine on host:port (port 0: any free port) inside the running event loop.

        async with EngineServer(engine) as server:
            client = EngineClient(server.url)
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> None:
        super().__init__(host, port, api_key)
        self.engine = engine

    def make_app(self) -> web.Application:
        return create_app(self.engine)


async def serve_forever(engine: Engine, host: str, port: int, api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM; print the URL once listening (port 0 picks a free one)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EngineServer(engine, host, port, api_key=api_key) as server:
        print(f"miles-async engine: serving {engine.model_path} on {server.url}", flush=True)
        await stop.wait()


def main(model_path: str, host: str, port: int, api_key: str | None = None, **engine_config: Any) -> int:
    """`miles-async serve engine`: load the model, serve until interrupted."""
    from miles_async.engine.core import EngineConfig

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
    asyncio.run(serve_forever(engine, host, port, api_key))
    return 0
