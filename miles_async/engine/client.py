"""`EngineClient`: an async client of SGLang's native HTTP API, for the embedded engine and SGLang alike.

    async with EngineClient("http://127.0.0.1:30000") as client:
        await client.wait_healthy(timeout_s=60)
        out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8},
                                    return_logprob=True)
        out["output_ids"], out["meta_info"]["output_token_logprobs"]

Every call has a timeout; an HTTP error status raises `EngineHTTPError` carrying the server's
message. Responses are SGLang's JSON, returned as dicts (see miles_async.engine.server);
`parse_output` reads one into an `EngineOutput`, the one form the rollout side consumes (the
embedded engine's actor answers `Generate` with it directly). `GenerateParams`, `PauseMode` and
`check_score_start` are the request side every backend shares (engine/backend.py, engine/vllm.py
and engine/router.py import them from here, so no backend imports another).
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import msgspec
import torch

from miles_async.trajectory import VersionSpan

if TYPE_CHECKING:
    from typing_extensions import Self

# How a weight update pauses generation (EngineBackend.pause).
PauseMode = Literal["abort", "retract", "in_place", "wait"]
# One SSE line holds the cumulative output so far; aiohttp reads lines up to twice this.
READ_BUFFER_BYTES = 4 * 2**20


class EngineHTTPError(RuntimeError):
    """The engine answered with an error status; `message` is its explanation."""

    def __init__(self, status: int, message: str, path: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


class GenerateParams(msgspec.Struct, frozen=True, kw_only=True):
    """What one generation asks of an engine, in its user's terms (SGLang's names)."""

    max_new_tokens: int = 128  # SGLang's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()  # strings that end the generation (trimmed from the text)
    seed: int | None = None  # a sampling seed of its own (the engine's shared generator otherwise)
    return_routed_experts: bool = False  # MoE: the experts every token was routed to (R3)

    @classmethod
    def from_sglang(cls, sampling_params: Mapping[str, Any], *, return_routed_experts: bool = False) -> GenerateParams:
        """From SGLang's `sampling_params` (the keys this struct has; `sampling_seed` is `seed`)."""
        fields = {k: v for k, v in sampling_params.items() if k in ("max_new_tokens", "temperature", "top_p", "top_k")}
        stop = sampling_params.get("stop") or ()
        return cls(**fields, stop=(stop,) if isinstance(stop, str) else tuple(stop),
                   seed=sampling_params.get("sampling_seed"), return_routed_experts=return_routed_experts)

    def sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params`."""
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One finished generation, as the rollout side consumes it from any engine.

    `weight_versions`: the version of every output token, as spans over output positions.
    `routed_experts`: MoE (when asked): int32 little-endian [prompt + output tokens - 1, MoE layers,
    top_k], SGLang's layout.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_versions: list[VersionSpan]
    text: str = ""
    routed_experts: bytes = b""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding (SGLang's meta_info `spec_verify_ct`, `spec_num_proposed_drafts`,
    # `spec_num_correct_drafts`, which our engine writes too): decoding steps, draft tokens proposed
    # and accepted; 0 without speculation.
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0


def version_of(label: Any, default: int) -> int:
    """Our integer version from SGLang's `weight_version` label (any text): an integer's text is
    the pusher's version; any other label (SGLang's "default", a name) is `default`."""
    try:
        return int(str(label).strip())
    except ValueError:
        return default


def parse_output(out: dict[str, Any], *, version: int) -> EngineOutput:
    """SGLang's /generate JSON (one item) -> `EngineOutput`. `version` is the engine's weight
    version when the request was sent. SGLang's `weight_versions` spans carry labels (text), read
    by `version_of`; an engine that reports no spans (only its `weight_version` label) gets one span
    over the whole output. Empty spans (SGLang reports the current version over [0, 0) before the
    first token) are dropped."""
    meta = out.get("meta_info") or {}
    output_ids = [int(t) for t in out.get("output_ids") or []]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    spans = [VersionSpan(version=version_of(s["version"], version), start=int(s["start"]), end=int(s["end"]))
             for s in meta.get("weight_versions") or [] if int(s["end"]) > int(s["start"])]
    if not spans and output_ids:
        spans = [VersionSpan(version=version_of(meta.get("weight_version", ""), version), start=0,
                             end=len(output_ids))]
    experts = base64.b64decode(meta["routed_experts"]) if meta.get("routed_experts") else b""
    return EngineOutput(output_ids=output_ids, output_logprobs=logprobs,
                        finish_reason=(meta.get("finish_reason") or {}).get("type", "abort"), weight_versions=spans,
                        text=out.get("text", ""), routed_experts=experts,
                        prompt_tokens=int(meta.get("prompt_tokens", 0)), cached_tokens=int(meta.get("cached_tokens", 0)),
                        spec_verify_ct=int(meta.get("spec_verify_ct", 0)),
                        spec_draft_tokens=int(meta.get("spec_num_proposed_drafts", 0)),
                        spec_accepted_drafts=int(meta.get("spec_num_correct_drafts", 0)))


def check_score_start(input_ids: list[int], start: int) -> None:
    if not 1 <= start < len(input_ids):
        raise ValueError(f"score: start must be in [1, {len(input_ids)}) for {len(input_ids)} tokens (the first "
                         f"token has nothing before it), got {start}")


def bearer(api_key: str | None) -> dict[str, str] | None:
    """The HTTP headers that carry `api_key` (None without one): the engines' and session server's."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


class EngineClient:
    """One connection pool to one engine; use as an async context manager (or call close())."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 max_connections: int = 1024, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = bearer(api_key)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, read_bufsize=READ_BUFFER_BYTES, headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        async with self._http().request(method, self.base_url + path, json=payload) as response:
            body = await response.read()
            if response.status >= 400:
                raise EngineHTTPError(response.status, error_message(body), path)
            if response.content_type == "application/json":
                return json.loads(body)
            return body.decode(errors="replace")

    # ----- generation -----

    async def generate(self, *, input_ids: list[int] | list[list[int]] | None = None,
                       text: str | list[str] | None = None, sampling_params: dict[str, Any] | None = None,
                       rid: str | None = None, return_logprob: bool = False, return_routed_experts: bool = False,
                       **extra: Any) -> Any:
        """POST /generate; returns SGLang's output dict (a list of them for a batch)."""
        payload = _generate_payload(input_ids, text, sampling_params, rid, return_logprob, return_routed_experts,
                                    extra)
        return await self._request("POST", "/generate", payload)

    async def generate_stream(self, *, input_ids: list[int] | None = None, text: str | None = None,
                              sampling_params: dict[str, Any] | None = None, rid: str | None = None,
                              return_logprob: bool = False, **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream: yields each cumulative output; the last has a finish_reason."""
        payload = _generate_payload(input_ids, text, sampling_params, rid, return_logprob, False, extra)
        payload["stream"] = True
        async with self._http().post(self.base_url + "/generate", json=payload) as response:
            if response.status >= 400:
                raise EngineHTTPError(response.status, error_message(await response.read()), "/generate")
            async for raw_line in response.content:  # lines up to 2 x read_bufsize bytes
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)

    # ----- health and information -----

    async def health(self) -> bool:
        try:
            async with self._http().get(self.base_url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_healthy(self, timeout_s: float, interval_s: float = 0.25) -> None:
        """Poll /health until it answers 200; raise TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url} was not healthy within {timeout_s} s")
            await asyncio.sleep(interval_s)

    async def model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/model_info")

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info: flat ServerArgs fields, and `internal_states` (one per DP rank)."""
        return await self._request("GET", "/server_info")

    async def loads(self) -> dict[str, Any]:
        """GET /v1/loads: {"loads": [one per DP rank: num_running_reqs, num_waiting_reqs, ...], ...}."""
        return await self._request("GET", "/v1/loads")

    # ----- control -----

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """POST /abort_request: every request whose rid starts with `rid` (SGLang matches a prefix), or all."""
        if rid is None and not abort_all:
            raise ValueError("give rid (the request to abort) or abort_all=True")
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        """POST /pause_generation; SGLang's modes are "abort", "retract" and "in_place"."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self._request("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       **extra: Any) -> dict[str, Any]:
        payload = {"model_path": model_path, **extra}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._request("POST", "/update_weights_from_disk", payload)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True) -> dict[str, Any]:
        """POST /update_weight_version: relabel the weights being served."""
        return await self._request("POST", "/update_weight_version",
                                   {"new_version": new_version, "abort_all_requests": abort_all_requests})

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """POST /load_lora_adapter: serve the PEFT adapter folder `lora_path` as `lora_name` (a
        request naming it in `lora_path` runs base + adapter; the server needs --enable-lora)."""
        return await self._request("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter."""
        return await self._request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    # The distributed path: the caller is rank 0 of a group it opens at master_address:master_port
    # and broadcasts each tensor named in update_weights_from_distributed, in order.

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        """POST /init_weights_update_group; returns once the engine has joined (so the caller joins concurrently)."""
        return await self._request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None,
                                              flush_cache: bool = True) -> dict[str, Any]:
        """POST /update_weights_from_distributed; returns once the engine has received every tensor
        named (the caller broadcasts them concurrently). SGLang 0.5.23 takes it only inside
        /begin_weight_update .. /end_weight_update, and fails it when `flush_cache` finds requests held."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._request("POST", "/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> dict[str, Any]:
        return await self._request("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        return await self._request("POST", "/end_weight_update", {})


def _generate_payload(input_ids: Any, text: Any, sampling_params: dict[str, Any] | None, rid: str | None,
                      return_logprob: bool, return_routed_experts: bool, extra: dict[str, Any]) -> dict[str, Any]:
    if (input_ids is None) == (text is None):
        raise ValueError("give exactly one of input_ids and text")
    payload: dict[str, Any] = {"sampling_params": sampling_params or {}, **extra}
    payload["input_ids" if input_ids is not None else "text"] = input_ids if input_ids is not None else text
    if rid is not None:
        payload["rid"] = rid
    if return_logprob:
        payload["return_logprob"] = True
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def error_message(body: bytes) -> str:
    """An engine's error reply as text: OpenAI's {"error": {"message"}} (SGLang's, ours), SGLang's
    {"message"}, FastAPI's {"detail"} (vLLM's RL endpoints), {"error": "..."}, or the body."""
    text = body.decode(errors="replace")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if key in parsed:
                return str(parsed[key])
    return text.strip()


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> torch.Tensor:
    """meta_info["routed_experts"] → int32 tensor [tokens, num_layers, top_k] (SGLang's layout)."""
    values = array.array("i")
    values.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":
        values.byteswap()
    return torch.tensor(values, dtype=torch.int32).view(-1, num_layers, top_k)
