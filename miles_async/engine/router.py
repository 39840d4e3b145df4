"""sglang-router in front of several engines, and a backend that keeps routing replay (R3) working through it.

    engines = [SGLangBackend(url) for url in engine_urls]
    async with SGLangRouter(engine_urls, port=30000) as router:        # policy="cache_aware"
        backend = RoutedBackend(router.url, engines)
        out = await backend.generate(ids, GenerateParams(max_new_tokens=8), version=0)  # via the router
        out = await backend.generate(ids, GenerateParams(return_routed_experts=True), version=0)  # direct

The router is the real `sglang-router` package (0.3.2, the `[dev]` extra; a Rust binary behind a
thin Python launcher: `python -m sglang_router.launch_router --worker-urls URL... --policy P`).
tests/e2e/test_sglang_router.py runs it in front of two embedded engines.

What sglang-router 0.3.2 does, found against a server that records what it receives (and in its
source, sgl-router's protocols/generate.rs):
- Starting: it registers each worker through GET /health, /server_info and /model_info (also
  probing each URL for gRPC: an HTTP/2 preface, which aiohttp logs as a 400 "Pause on
  PRI/Upgrade" error, harmless), then loads a tokenizer from `model_path` (a local folder, else
  the Hugging Face Hub: offline that fails with a warning and nothing else); GET /workers lists
  them with `is_healthy`. It asks /get_load (not /v1/loads); it binds a Prometheus port (29000 by
  default: two routers on one machine collide, so `SGLangRouter` picks a free one).
- Routes it serves: POST /generate, /v1/completions, /v1/chat/completions (each to one worker),
  POST /flush_cache (to every worker), GET /health, /health_generate, /get_model_info,
  /get_server_info, /v1/models, /workers, /get_loads. Not served (404): /abort_request,
  /pause_generation, /continue_generation, every weight endpoint (/update_weights_from_disk, ...),
  /update_weight_version, /model_info, /server_info, /get_load. So control and weight updates go
  to each engine directly, never through the router.
- /generate requests are parsed into its own typed `GenerateRequest` and re-serialised: fields it
  does not know are DROPPED, among them `return_routed_experts` (and `routed_experts_start_len`,
  any unknown top-level field, and `custom_params` or unknown keys inside `sampling_params`). It
  forwards `input_ids` / `text`, `rid`, `stream`, `return_logprob`, `logprob_start_len`,
  `top_logprobs_num`, `return_text_in_logprobs`, `return_hidden_states`, `session_params`,
  `lora_path`, `custom_logit_processor`, and the known `sampling_params` (max_new_tokens,
  temperature, top_p, top_k, min_p, stop, stop_token_ids, ignore_eos, no_stop_trim,
  skip_special_tokens, n, sampling_seed, ...); it adds `model: null`, `log_metrics`,
  `background`, `no_logs`, `return_bytes`, `return_entropy` (false), which SGLang and the
  embedded engine ignore.
- /generate responses, streamed or not, pass through byte for byte: `meta_info` keeps
  `cached_tokens`, `weight_version`, `weight_versions` spans, log-probs, and `routed_experts`
  when an engine sends it.
- cache_aware (the default policy) keys a radix tree of characters on the request's text, or
  for token prompts on the ids written as decimals joined by spaces. A prompt whose best match
  covers more than `cache_threshold` (0.3) of those characters goes to the worker that had it;
  otherwise to the worker with the fewest requests in flight through the router, the first
  listed on a tie; load balancing overrides both only when loads differ by more than 64 requests
  and 1.5x. So prompts sent one at a time all go to the first worker, and sessions whose shared
  system prompt is over 30% of their first prompt all go to one worker (measured: 8 sessions
  with 16 of 48 tokens shared, all 2688 prompt tokens on one engine); concurrent sessions with a
  shorter shared part spread evenly, and each keeps its engine across turns.
- /v1/completions keeps unknown fields (its struct has a catch-all), so it would forward
  `return_routed_experts`, but it takes only text prompts (token ids: HTTP 422), which the loop
  does not send.

So R3 through the router silently returns no experts. `RoutedBackend` sends R3 requests straight to
an engine instead, picked by `PrefixAffinity`: the engine that last served the longest prefix of
the prompt (its prefix cache likely holds it), so a session's turns and a GRPO group's samples stay
on one engine; everything else goes through the router. The router does not see the R3 requests,
so its tree does not learn them: with an MoE model every rollout request is an R3 request and the
router carries none of them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal

import aiohttp

from miles_async.engine.backend import GenerateParams, PauseMode, SGLangBackend
from miles_async.engine.client import EngineOutput
from miles_async.engine.process import ServerProcess, ServerStartError

RouterPolicy = Literal["random", "round_robin", "cache_aware", "power_of_two"]
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


class RouterStartError(ServerStartError):
    """sglang-router exited, stayed unhealthy or did not register every worker while starting."""


def default_command() -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router"]


class SGLangRouter(ServerProcess):
    """One `sglang_router.launch_router` process on host:port in front of `worker_urls`.

    `start` returns once the router answers /health and lists every worker as healthy under
    /workers (the router adds workers in the background after it starts serving).
    `prometheus_port` None: a free one. Its defaults that would slow a test or a shutdown are
    shortened (worker checks every 1 s, not 30; 5 s grace for in-flight requests at SIGTERM, not
    180); `extra_args` come last and override them.
    """

    kind = "sglang-router"

    def __init__(self, worker_urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 30000,
                 policy: RouterPolicy = "cache_aware", prometheus_port: int | None = None,
                 command: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 stop_timeout_s: float = 30.0) -> None:
        if not worker_urls:
            raise ValueError("SGLangRouter needs at least one worker URL")
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} is not one of {', '.join(POLICIES)}")
        super().__init__(host=host, port=port, command=command if command is not None else default_command(),
                         extra_args=extra_args, env=env, log_path=log_path, stop_timeout_s=stop_timeout_s)
        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.policy = policy
        if prometheus_port is None:
            from miles_async.trainer.fsdp import free_port

            prometheus_port = free_port(host)
        self.prometheus_port = prometheus_port

    def argv(self) -> list[str]:
        return [*self.command, "--host", self.host, "--port", str(self.port), "--worker-urls", *self.worker_urls,
                "--policy", self.policy, "--prometheus-host", self.host, "--prometheus-port",
                str(self.prometheus_port), "--worker-startup-check-interval", "1",
                "--shutdown-grace-period-secs", "5", *self.extra_args]

    async def start(self, timeout_s: float = 120.0) -> str:
        """Spawn the router, wait for /health and for every worker to be registered and healthy."""
        deadline = time.monotonic() + timeout_s
        try:
            await super().start(timeout_s)
        except ServerStartError as e:
            raise RouterStartError(str(e)) from None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            while set(await self.healthy_workers(http)) != set(self.worker_urls):
                if self.returncode is not None or time.monotonic() >= deadline:
                    await self.stop()
                    raise RouterStartError(f"sglang-router on {self.url} did not register {self.worker_urls} as "
                                           f"healthy within {timeout_s} s; log tail:\n{self.log_tail()}")
                await asyncio.sleep(0.5)
        return self.url

    async def healthy_workers(self, http: aiohttp.ClientSession) -> list[str]:
        """The URLs the router lists under /workers as healthy (none while it is unreachable)."""
        try:
            async with http.get(self.url + "/workers") as response:
                if response.status != 200:
                    return []
                listing = await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return []
        return [worker["url"].rstrip("/") for worker in listing.get("workers", []) if worker.get("is_healthy")]


class PrefixAffinity:
    """Which engine a prompt goes to when the router cannot take it: a pure policy over token ids.

    Remembers, per block of `block_tokens` tokens, which engine last served a sequence with that
    block-aligned prefix (at most `capacity` prefixes, least recently used dropped first). A prompt
    goes to the engine holding its longest remembered prefix if that covers at least
    `min_match_fraction` of it; otherwise to the engine with the fewest requests in flight, then
    the fewest remembered blocks (so prompts sent one at a time alternate; sglang-router's
    cache_aware sends those all to its first worker), then the lowest index. Unrelated prompts that
    share only a system prompt shorter than that fraction still spread out.
    """

    def __init__(self, num_engines: int, *, block_tokens: int = 16, min_match_fraction: float = 0.5,
                 capacity: int = 1 << 16) -> None:
        if num_engines < 1:
            raise ValueError(f"PrefixAffinity needs at least one engine, got {num_engines}")
        if block_tokens < 1 or capacity < 1 or not 0.0 <= min_match_fraction <= 1.0:
            raise ValueError(f"bad PrefixAffinity sizes: block_tokens={block_tokens}, capacity={capacity}, "
                             f"min_match_fraction={min_match_fraction}")
        self.num_engines = num_engines
        self.block_tokens = block_tokens
        self.min_match_fraction = min_match_fraction
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> engine index
        self._num_blocks = [0] * num_engines  # keys owned per engine

    def _keys(self, ids: Sequence[int]) -> list[int]:
        """One key per whole block: a hash chained over the blocks before it (stable within a process)."""
        keys, key = [], 0
        for start in range(0, len(ids) - self.block_tokens + 1, self.block_tokens):
            key = hash((key, tuple(ids[start:start + self.block_tokens])))
            keys.append(key)
        return keys

    def choose(self, ids: Sequence[int], in_flight: Sequence[int]) -> int:
        """The engine for prompt `ids`, given each engine's number of requests in flight."""
        assert len(in_flight) == self.num_engines
        keys = self._keys(ids)
        for num_blocks in range(len(keys), 0, -1):
            engine = self._owner.get(keys[num_blocks - 1])
            if engine is not None:
                if num_blocks * self.block_tokens >= self.min_match_fraction * len(ids):
                    return engine
                break
        return min(range(self.num_engines), key=lambda i: (in_flight[i], self._num_blocks[i]))

    def record(self, ids: Sequence[int], engine: int) -> None:
        """Engine `engine` now holds `ids` (a prompt when sent, prompt + output when done)."""
        for key in self._keys(ids):
            previous = self._owner.pop(key, None)
            if previous is not None:
                self._num_blocks[previous] -= 1
            self._owner[key] = engine
            self._num_blocks[engine] += 1
        while len(self._owner) > self.capacity:
            _, evicted = self._owner.popitem(last=False)
            self._num_blocks[evicted] -= 1

    def clear(self) -> None:
        """Forget every prefix (the engines' caches were flushed)."""
        self._owner.clear()
        self._num_blocks = [0] * self.num_engines


class RoutedBackend:
    """`EngineBackend` over a router and the engines behind it (module docstring).

    Generation without routed experts goes through the router; with them (R3), straight to the
    engine `PrefixAffinity` picks. abort, pause, resume and flush_cache go to every engine (the
    router serves none but flush_cache); healthy means the router and every engine are.
    """

    def __init__(self, router_url: str, engines: Sequence[SGLangBackend], *, affinity: PrefixAffinity | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0) -> None:
        if not engines:
            raise ValueError("RoutedBackend needs the engines behind the router (for R3 and control)")
        self.url = router_url.rstrip("/")
        self.router = SGLangBackend(self.url, api_key=api_key, timeout_s=timeout_s)
        self.engines = list(engines)
        self.affinity = affinity if affinity is not None else PrefixAffinity(len(self.engines))
        if self.affinity.num_engines != len(self.engines):
            raise ValueError(f"the affinity policy is for {self.affinity.num_engines} engines, "
                             f"not the {len(self.engines)} given")
        self.in_flight = [0] * len(self.engines)

    def _pick(self, input_ids: list[int]) -> int:
        engine = self.affinity.choose(input_ids, self.in_flight)
        self.affinity.record(input_ids, engine)
        return engine

    async def generate(self, input_ids: list[int], params: GenerateParams, *, version: int,
                       rid: str | None = None) -> EngineOutput:
        if not params.return_routed_experts:
            return await self.router.generate(input_ids, params, version=version, rid=rid)
        engine = self._pick(input_ids)
        self.in_flight[engine] += 1
        try:
            out = await self.engines[engine].generate(input_ids, params, version=version, rid=rid)
        finally:
            self.in_flight[engine] -= 1
        self.affinity.record(input_ids + out.output_ids, engine)
        return out

    async def generate_stream(self, input_ids: list[int], params: GenerateParams, *, version: int,
                              rid: str | None = None) -> AsyncIterator[EngineOutput]:
        if not params.return_routed_experts:
            async for out in self.router.generate_stream(input_ids, params, version=version, rid=rid):
                yield out
            return
        engine = self._pick(input_ids)
        self.in_flight[engine] += 1
        output_ids: list[int] = []
        try:
            async for out in self.engines[engine].generate_stream(input_ids, params, version=version, rid=rid):
                output_ids = out.output_ids
                yield out
        finally:
            self.in_flight[engine] -= 1
        self.affinity.record(input_ids + output_ids, engine)

    async def abort(self, rid: str | None = None) -> None:
        await asyncio.gather(*(engine.abort(rid) for engine in self.engines))

    async def pause(self, mode: PauseMode = "abort") -> None:
        await asyncio.gather(*(engine.pause(mode) for engine in self.engines))

    async def resume(self) -> None:
        await asyncio.gather(*(engine.resume() for engine in self.engines))

    async def flush_cache(self) -> None:
        await asyncio.gather(*(engine.flush_cache() for engine in self.engines))
        self.affinity.clear()

    async def health(self) -> bool:
        return all(await asyncio.gather(self.router.health(), *(engine.health() for engine in self.engines)))

    async def close(self) -> None:
        await asyncio.gather(self.router.close(), *(engine.close() for engine in self.engines))
