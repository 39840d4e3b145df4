"""The engine backend interface: one rollout engine as the loop, the evaluator and the session server use it.

    rollout workers ─┐
    evaluator ───────┼──► EngineBackend ─┬─ SGLangBackend ──HTTP (SGLang's native API)──► the embedded engine,
    session server ──┘   (generate, abort,│                                               or a real SGLang server
                          pause, resume,  └─ VllmBackend ──HTTP (vLLM's OpenAI API + RL endpoints)──► vLLM
                          flush, health)

Token ids in; output ids, the log-prob of every sampled token, the finish reason, the weight
version of every output token (spans) and, for an MoE model, the routed experts out, as one
`EngineOutput` whatever the engine. `connect(kind, url)` makes the client of a running server;
which kind a run uses is `[rollout] backend`. `GenerateParams` and `PauseMode` are defined in
engine/client.py, beside `EngineOutput`, so that engine/vllm.py needs nothing from here.

Weight updates are not here: they go through the engine's actor (`miles_async/actors/engine.py` for the
embedded engine, `miles_async/actors/external.py` for a server of another project), which owns the server
process. The external one drives them through `WeightAdmin`: SGLang's `/update_weights_from_disk`,
vLLM's in-place reload; both answer prompt log-probs for the probe that verifies an update.
`SGLangBackend` also speaks SGLang's weight-update group (join, begin, receive per bucket, end,
leave: the distributed transport, miles_async/actors/distributed.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from miles_async.engine.client import (
    EngineClient,
    EngineHTTPError,
    EngineOutput,
    GenerateParams,
    PauseMode,
    check_score_start,
    parse_output,
)

BACKENDS = ("embedded", "sglang", "vllm")
ADAPTER_NAME = "policy-lora"  # the LoRA adapter an external engine serves the trainer's adapters as
Backend = Literal["embedded", "sglang", "vllm"]


@runtime_checkable
class EngineBackend(Protocol):
    """A client of one running engine (module docstring). `version` is the engine's weight version
    when the request is sent: an engine that reports no per-token versions gets it."""

    url: str

    async def generate(self, input_ids: list[int], params: GenerateParams, *, version: int,
                       rid: str | None = None) -> EngineOutput: ...

    def generate_stream(self, input_ids: list[int], params: GenerateParams, *, version: int,
                        rid: str | None = None) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort request `rid` (every request whose id starts with it, as SGLang matches), or all."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool: ...

    async def load(self) -> int:
        """Requests the engine holds now (running and waiting)."""
        ...

    async def info(self) -> dict[str, Any]:
        """The server's own description of itself (its configuration), as it gives it."""
        ...

    async def score(self, input_ids: list[int], start: int) -> list[float]:
        """The log-prob of each of `input_ids[start:]` given the tokens before it, under the served
        weights, in one prefill-only request (nothing is generated); 1 <= start < len(input_ids)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class WeightAdmin(Protocol):
    """The weight calls an external engine's actor makes (miles_async/actors/external.py)."""

    async def reload_weights(self, folder: str, label: str, *, flush_cache: bool = True) -> None:
        """Load the safetensors files under `folder` (checkpoint names, with the model's config.json)
        into the served model and label them `label`. `flush_cache=False` leaves the prefix cache to
        the caller: SGLang fails an update whose flush finds requests held (a pause that keeps them)."""
        ...

    async def set_weight_version(self, label: str) -> None: ...

    async def reset_weights(self) -> None:
        """Overwrite every weight (the start of an update's verification); NotImplementedError where
        the engine has no such call."""
        ...

    async def prompt_logprobs(self, input_ids: list[int]) -> list[float]:
        """The log-prob of each token after the first, under the served weights."""
        ...


class SGLangBackend:
    """`EngineBackend` over SGLang's native HTTP API: the embedded engine's server, or SGLang's own.
    `adapter`: a LoRA adapter loaded on the server (`load_adapter`) that every request names
    (SGLang's `lora_path`), so generation and scoring run base + adapter."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0, adapter: str = "") -> None:
        self.url = url.rstrip("/")
        self.client = EngineClient(self.url, timeout_s=timeout_s, api_key=api_key)
        self.lora = {"lora_path": adapter} if adapter else {}

    async def generate(self, input_ids: list[int], params: GenerateParams, *, version: int,
                       rid: str | None = None) -> EngineOutput:
        out = await self.client.generate(input_ids=input_ids, sampling_params=params.sglang(), rid=rid,
                                         return_logprob=True, return_routed_experts=params.return_routed_experts,
                                         **self.lora)
        return parse_output(out, version=version)

    async def generate_stream(self, input_ids: list[int], params: GenerateParams, *, version: int,
                              rid: str | None = None) -> AsyncIterator[EngineOutput]:
        async for out in self.client.generate_stream(input_ids=input_ids, sampling_params=params.sglang(), rid=rid,
                                                     return_logprob=True,
                                                     return_routed_experts=params.return_routed_experts, **self.lora):
            yield parse_output(out, version=version)

    async def abort(self, rid: str | None = None) -> None:
        await self.client.abort(rid, abort_all=rid is None)

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.client.pause(mode)

    async def resume(self) -> None:
        await self.client.resume()

    async def flush_cache(self) -> None:
        await self.client.flush_cache()

    async def health(self) -> bool:
        return await self.client.health()

    async def load(self) -> int:
        """From /v1/loads: running and waiting requests over its data-parallel ranks."""
        loads = (await self.client.loads())["loads"]
        return sum(int(rank["num_running_reqs"]) + int(rank["num_waiting_reqs"]) for rank in loads)

    async def info(self) -> dict[str, Any]:
        return dict(await self.client.server_info())

    async def close(self) -> None:
        await self.client.close()

    # ----- WeightAdmin -----

    async def reload_weights(self, folder: str, label: str, *, flush_cache: bool = True) -> None:
        _succeeded(await self.client.update_weights_from_disk(folder, weight_version=label, flush_cache=flush_cache),
                   "/update_weights_from_disk")

    async def set_weight_version(self, label: str) -> None:
        await self.client.update_weight_version(label, abort_all_requests=False)

    async def reset_weights(self) -> None:
        raise NotImplementedError("SGLang has no call that overwrites its weights")

    async def prompt_logprobs(self, input_ids: list[int]) -> list[float]:
        return await self.score(input_ids, 1)

    async def score(self, input_ids: list[int], start: int) -> list[float]:
        check_score_start(input_ids, start)
        # SGLang scores from `logprob_start_len` on, its first entry without a log-prob: start one
        # token early and keep the tail (max_new_tokens 0: prefill only).
        out = await self.client.generate(input_ids=input_ids, sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                                         return_logprob=True, logprob_start_len=start - 1, **self.lora)
        entries = out["meta_info"]["input_token_logprobs"][-(len(input_ids) - start):]
        return [float(entry[0]) for entry in entries]

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter folder `path` as LoRA adapter `name`, replacing the one of that name:
        SGLang's /unload_lora_adapter (an adapter not loaded yet is not an error) then /load_lora_adapter."""
        try:
            _succeeded(await self.client.unload_lora_adapter(name), "/unload_lora_adapter")
        except EngineHTTPError as e:
            if "not" not in e.message.lower():  # "... has not been loaded" is expected the first time
                raise
        _succeeded(await self.client.load_lora_adapter(name, path), "/load_lora_adapter")

    # ----- SGLang's weight-update group: the distributed transport (miles_async/actors/distributed.py) -----

    async def group_ranks(self) -> int:
        """The ranks this server puts in a weight-update group: one per tensor-parallel rank."""
        return int((await self.client.server_info()).get("tp_size", 1))

    async def join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str) -> None:
        """/init_weights_update_group: returns once the server has joined (the caller joins concurrently)."""
        _succeeded(await self.client.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name=group_name, backend=backend),
            "/init_weights_update_group")

    async def leave_weight_group(self, group_name: str) -> None:
        _succeeded(await self.client.destroy_weights_update_group(group_name), "/destroy_weights_update_group")

    async def begin_weight_update(self) -> None:
        _succeeded(await self.client.begin_weight_update(), "/begin_weight_update")

    async def receive_weights(self, request: Mapping[str, Any], group_name: str) -> None:
        """/update_weights_from_distributed for one bucket (`request`: names, dtypes, shapes,
        weight_version, flush_cache); returns once the server has received what the caller broadcasts."""
        _succeeded(await self.client.update_weights_from_distributed(
            request["names"], request["dtypes"], request["shapes"], group_name=group_name,
            weight_version=request.get("weight_version"), flush_cache=request.get("flush_cache", False)),
            "/update_weights_from_distributed")

    async def end_weight_update(self) -> None:
        _succeeded(await self.client.end_weight_update(), "/end_weight_update")


def _succeeded(reply: Any, path: str) -> None:
    """SGLang's weight endpoints answer {"success": false, "message"} (mostly with HTTP 400, which
    the client raises already): raise that too."""
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineHTTPError(400, str(reply.get("message")), path)


def connect(kind: Backend, url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
            adapter: str = "") -> EngineBackend:
    """The client of the running `kind` engine at `url`; `adapter`: the LoRA adapter every request
    names (an external engine taking LoRA pushes as adapters, `ADAPTER_NAME`)."""
    if kind in ("embedded", "sglang"):
        return SGLangBackend(url, api_key=api_key, timeout_s=timeout_s, adapter=adapter)
    if kind == "vllm":
        from miles_async.engine.vllm import VllmBackend

        return VllmBackend(url, api_key=api_key, timeout_s=timeout_s, adapter=adapter)
    raise ValueError(f"engine backend {kind!r} is not one of {', '.join(BACKENDS)}")
