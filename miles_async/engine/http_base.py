"""What the embedded engine's HTTP faces share (server.py's SGLang routes, openai.py's OpenAI
ones): the application's keys, request parsing that names the bad field, the error shapes,
submitting and awaiting engine requests on behalf of a client, and `AppServer`, an aiohttp
application served inside the running loop (the session server is one too).
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from miles_async.engine.core import Engine, EngineOverloadedError
from miles_async.engine.metrics import Histogram
from miles_async.engine.request import GenerateOutput, GenerateRequest

if TYPE_CHECKING:
    from typing_extensions import Self

ENGINE_KEY = web.AppKey("engine", Engine)
STARTED_KEY = web.AppKey("started_s", float)
MODEL_NAME_KEY = web.AppKey("served_model_name", str)
LATENCY_KEY = web.AppKey("e2e_latency_s", Histogram)  # of the requests this server answered


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` (400 unless said), and for OpenAI's error shape
    the field at fault (`param`) and an error code (`code`)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def native_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def openai_error_body(status: int, message: str, *, param: str | None = None, code: str | None = None
                      ) -> dict[str, Any]:
    """OpenAI's error shape, its `type` as OpenAI's API (and SGLang's) names the kinds: a client's
    fault (4xx) "invalid_request_error", the server's (5xx) "server_error"."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(openai_error_body(status, message, param=param, code=code), status=status,
                             headers=headers)


async def read_json(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
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


def body_field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = " or ".join(t.__name__ for t in _as_tuple(kind))
        raise BadRequest(f"{key} must be {names}, got {type(value).__name__}", param=key)
    return value


def required_field(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body_field(body, key, kind)
    if value is None:
        raise BadRequest(f"{key} is required", param=key)
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def token_id_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise BadRequest(f"{where} must be a list of integer token ids", param=where)
    return value


def default_served_model_name(model_path: str | None) -> str:
    """The name a model is served under when none is given: a folder's base name, or for a snapshot
    in a Hugging Face cache (.../models--ORG--NAME/snapshots/COMMIT) its Hub id ORG/NAME."""
    if not model_path:
        return "miles-async-embedded"
    path = Path(model_path)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return (path.resolve().name if path.name in ("", ".", "..") else path.name) or "miles-async-embedded"


# ----- engine requests on behalf of a client -----

async def submit_all(engine: Engine, requests: list[GenerateRequest]) -> list:
    """Submit every request, or none (a refused one aborts those submitted before it)."""
    states: list = []
    try:
        for item in requests:
            states.append(engine.submit(item))
    except ValueError as e:
        await abort_all(engine, states)
        raise BadRequest(str(e)) from None
    except EngineOverloadedError:
        await abort_all(engine, states)
        raise
    return states


async def wait_all(request: web.Request, states: list) -> list[GenerateOutput]:
    """The final outputs (timed for /metrics); a client that goes away (the handler is cancelled)
    aborts them."""
    engine = request.app[ENGINE_KEY]
    try:
        await asyncio.gather(*(s.done.wait() for s in states))
    except asyncio.CancelledError:
        await asyncio.shield(abort_all(engine, states))
        raise
    outs = [engine.snapshot(s) for s in states]
    record_finished(request, outs)
    return outs


def record_finished(request: web.Request, outs: list[GenerateOutput]) -> None:
    """Time the finished requests of an answer (sglang:e2e_request_latency_seconds)."""
    latency = request.app[LATENCY_KEY]
    for out in outs:
        if out.finish_reason is not None:
            latency.observe(out.e2e_latency_s)


async def abort_all(engine: Engine, states: list) -> None:
    for state in states:
        await engine.abort(state.rid)


# ----- serving -----

def require_key(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return openai_error(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
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
            app.middlewares.append(require_key(self.api_key))
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
