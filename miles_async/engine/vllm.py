"""vLLM as a rollout engine: its server started as a subprocess (`VllmServer`), and `VllmBackend`.

vLLM pins its own torch and transformers, so it runs from an environment of its own:
`python3 dev.py vllm` makes `.venv-vllm` (vLLM's CPU build, 0.32, over this machine's torch
2.13.0+cpu), which `VllmServer` uses unless given another Python. This side needs no vLLM.

    async with VllmServer("models/tiny", port=8000, threads=1) as server:
        backend = VllmBackend(server.url)
        out = await backend.generate([5, 6, 7], GenerateParams(max_new_tokens=8), version=0)

What we use of vLLM 0.32's HTTP API (its own definitions: `vllm/entrypoints/openai/completion/
protocol.py`, `vllm/entrypoints/rl/online/api_router.py`, `vllm/entrypoints/serve/dev/rpc/`;
tests/e2e/test_vllm.py runs all of it against the real server):
- generation: `POST /v1/completions` with a token-id prompt, `logprobs: 0` (the log-prob of each
  sampled token, under the distribution it was sampled from: the server runs with
  `--logprobs-mode processed_logprobs`), `return_token_ids`, our `request_id`, and a `cache_salt`
  per weight version, so a prefix cached under older weights is never reused;
- `POST /abort_requests {request_ids}` (all, without ids), `POST /pause?mode=abort|wait|keep`,
  `POST /resume`, `POST /reset_prefix_cache`, `GET /health`, `GET /v1/models`;
- weights (the RL endpoints, served with `VLLM_SERVER_DEV_MODE=1`): `POST /collective_rpc
  {method: "reload_weights", kwargs: {weights_path}}` reloads in place from a folder of
  safetensors in the checkpoint's names; `/update_weight_version` and `/weight_info` keep the
  label; `/weight_checker {action: "reset"}` zeroes every weight (the verification's start).
  Its weight-transfer groups (`/init_weight_transfer_engine`) are GPU-only.

vLLM reports no per-token weight version: a request is labeled with the version it was sent
under, and an update pauses the engine in `keep` mode (`in_place` and `retract` map to it), so a
request that runs across an update finishes under the new weights with the older label: its
staleness is counted from its start, never less than it is.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from miles_async.engine.client import (
    EngineHTTPError,
    EngineOutput,
    GenerateParams,
    PauseMode,
    bearer,
    check_score_start,
    error_message,
)
from miles_async.engine.process import ServerProcess
from miles_async.trajectory import VersionSpan

VENV = ".venv-vllm"  # made by `python3 dev.py vllm`, at the project's root
PYTHON_ENV = "MILES_ASYNC_VLLM_PYTHON"  # another Python to start vLLM with
MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails in the CPU wheel on its package name
SERVED_NAME = "policy"
PAUSE_MODES = {"abort": "abort", "wait": "wait", "in_place": "keep", "retract": "keep"}
# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, 0.32)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VllmUnavailable(RuntimeError):
    """No Python with vLLM was found; the message says how to make one."""


def find_python(python: str | Path | None = None) -> Path:
    """The Python that starts vLLM: `python`, else $MILES_ASYNC_VLLM_PYTHON, else `.venv-vllm` at
    the project's root (this source tree's, or the working directory's)."""
    if python:
        return Path(python)
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV])
    roots = (Path(__file__).resolve().parents[2], Path.cwd())
    for root in roots:
        candidate = root / VENV / "bin" / "python"
        if candidate.exists():
            return candidate
    raise VllmUnavailable(f"no {VENV} found (looked in {', '.join(str(r) for r in dict.fromkeys(roots))}): run "
                          f"`python3 dev.py vllm` in the project's folder to make it, or name a Python with vLLM "
                          f"in ${PYTHON_ENV} or [rollout.server] python")


def check_model(model_dir: str | Path) -> None:
    """Refuse, naming the fix, a model vLLM's CPU build cannot run (its attention has fixed head sizes)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"{model_dir}: head_dim {head_dim} is not one vLLM's CPU attention supports "
                         f"({', '.join(map(str, CPU_HEAD_SIZES))}); use a model with one of those")


TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # Debian/Ubuntu's libtcmalloc-minimal4, gperftools
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """The system's TCMalloc, which vLLM's CPU docs strongly recommend preloading (`apt-get install
    libtcmalloc-minimal4`); None when it is not installed."""
    for folder in LIBRARY_DIRS:
        for name in TCMALLOC_NAMES:
            if (path := Path(folder) / name).exists():
                return str(path)
    return None


def cpu_env(threads: int = 1, cpus: str = "", reserved_cpus: int | None = 0,
            preload: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a vLLM CPU process: where its model worker's OpenMP threads run, and what it preloads.

    `reserved_cpus=0` (ours): no core reserved, `threads` OpenMP threads unbound, or bound to
    `cpus` ("0-1") when given. `reserved_cpus=None`: vLLM's own placement (`VLLM_CPU_OMP_THREADS_BIND=auto`
    and its default reservation, one core kept for the API server and the engine core when it
    serves; `threads` and `cpus` are not used). `reserved_cpus=k`: auto binding with k cores kept.
    `preload`: libraries put before LD_PRELOAD (vLLM adds torch's libgomp itself)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    if reserved_cpus is None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    else:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus or ("nobind" if reserved_cpus == 0 else "auto")
        if reserved_cpus == 0 and not cpus:
            env["OMP_NUM_THREADS"] = str(max(threads, 1))
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD", "")])])
    return env


class VllmServer(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server` serving `model_path` on host:port, on CPU.

    `threads`: the OpenMP threads of its model worker (`OMP_NUM_THREADS`, with
    `VLLM_CPU_OMP_THREADS_BIND=nobind` and no reserved core: vLLM reserves one by default), or
    `cpus` ("0-1") to bind them to those cores instead; `reserved_cpus=None` leaves the placement to
    vLLM (`cpu_env`). `kv_cache_bytes`: its KV cache (`--kv-cache-memory-bytes`). `dtype` should be
    the trainer's (float32 on CPU). `api_key`: what clients of its /v1 routes must send
    (`--api-key`). `torch_compile`: vLLM's default, torch.compile with inductor (25-85 s to start on two
    CPU cores against ~20 eager, and a C compiler); off (`--enforce-eager`) unless asked, so that a rollout starts in
    seconds. `max_num_seqs`: its batch limit (0: vLLM's default). `preload`: libraries to
    LD_PRELOAD (`find_tcmalloc`).
    """

    kind = "vLLM"

    def __init__(self, model_path: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
                 python: str | Path | None = None, dtype: str = "float32", threads: int = 1, cpus: str = "",
                 reserved_cpus: int | None = 0, torch_compile: bool = False, max_num_seqs: int = 0,
                 preload: Sequence[str] = (),
                 kv_cache_bytes: int = 64 * 2**20, max_model_len: int = 0, api_key: str | None = None,
                 extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 stop_timeout_s: float = 30.0) -> None:
        check_model(model_path)
        server_env = cpu_env(threads, cpus, reserved_cpus, preload)
        super().__init__(host=host, port=port, command=[str(find_python(python)), "-m", MODULE],
                         extra_args=extra_args, env={**server_env, **(env or {})}, log_path=log_path,
                         stop_timeout_s=stop_timeout_s)
        self.model_path = str(model_path)
        self.dtype = dtype
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.torch_compile = torch_compile
        self.max_num_seqs = max_num_seqs

    def argv(self) -> list[str]:
        argv = [*self.command, "--model", self.model_path, "--served-model-name", SERVED_NAME,
                "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
                "--kv-cache-memory-bytes", str(int(self.kv_cache_bytes)),
                # the log-probs are those of the distribution sampled from (temperature, top-p/k
                # applied), as our trainer scores
                "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
                "--enable-server-load-tracking"]  # /load counts requests only with it
        if not self.torch_compile:
            argv.append("--enforce-eager")
        if self.max_num_seqs:
            argv += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.api_key:  # required of /v1 clients (a multi-node run's engines listen off loopback)
            argv += ["--api-key", self.api_key]
        return [*argv, *self.extra_args]


class VllmBackend:
    """`EngineBackend` over vLLM's OpenAI and RL endpoints (module docstring), plus the weight calls
    the engine's actor makes (`reload_weights`, `set_weight_version`, `reset_weights`, `prompt_logprobs`)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0, adapter: str = "") -> None:
        self.url = url.rstrip("/")
        self.adapter = adapter  # a LoRA adapter every request names as its model (`load_adapter`)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10.0)
        self._headers = bearer(api_key)
        self._http: aiohttp.ClientSession | None = None
        self._model: str | None = None
        self._ids = itertools.count()
        self._inflight: set[str] = set()  # request ids sent and not answered yet

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers,
                                               connector=aiohttp.TCPConnector(limit=1024))
        return self._http

    async def _request(self, method: str, path: str, payload: Any = None, params: dict[str, str] | None = None) -> Any:
        async with self._session().request(method, self.url + path, json=payload, params=params) as response:
            body = await response.read()
            if response.status >= 400:
                raise EngineHTTPError(response.status, error_message(body), path)
            if not body:
                return None
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                return body.decode(errors="replace")

    async def model(self) -> str:
        """The model requests name: the LoRA adapter, or the served model's name (the first of
        /v1/models: a server we attach to may use any)."""
        if self.adapter:
            return self.adapter
        if self._model is None:
            models = await self._request("GET", "/v1/models")
            self._model = str(models["data"][0]["id"])
        return self._model

    # ----- generation -----

    def _payload(self, input_ids: list[int], params: GenerateParams, version: int, rid: str) -> dict[str, Any]:
        if params.return_routed_experts:
            raise ValueError("routed experts (R3) are not read from vLLM yet: use the embedded engine or SGLang "
                             "for a mixture-of-experts model")
        payload: dict[str, Any] = {
            "prompt": input_ids, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "logprobs": 0, "return_token_ids": True, "request_id": rid,
            "cache_salt": f"weights-v{version}", "skip_special_tokens": True}
        if params.top_k > 0:
            payload["top_k"] = params.top_k
        if params.seed is not None:
            payload["seed"] = params.seed
        if params.stop:
            payload["stop"] = list(params.stop)
        return payload

    async def generate(self, input_ids: list[int], params: GenerateParams, *, version: int,
                       rid: str | None = None) -> EngineOutput:
        rid = rid or f"miles-{os.getpid()}-{next(self._ids)}"
        payload = {"model": await self.model(), **self._payload(input_ids, params, version, rid)}
        self._inflight.add(rid)
        try:
            reply = await self._request("POST", "/v1/completions", payload)
        finally:
            self._inflight.discard(rid)
        return parse_completion(reply["choices"][0], version=version)

    async def generate_stream(self, input_ids: list[int], params: GenerateParams, *, version: int,
                              rid: str | None = None) -> AsyncIterator[EngineOutput]:
        """Cumulative outputs, as SGLang streams them (vLLM's SSE chunks carry the new tokens only)."""
        rid = rid or f"miles-{os.getpid()}-{next(self._ids)}"
        payload = {"model": await self.model(), **self._payload(input_ids, params, version, rid), "stream": True}
        ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        self._inflight.add(rid)
        try:
            async with self._session().post(self.url + "/v1/completions", json=payload) as response:
                if response.status >= 400:
                    raise EngineHTTPError(response.status, error_message(await response.read()), "/v1/completions")
                async for line in response.content:
                    data = line.decode().strip().removeprefix("data:").strip()
                    if not data or data == "[DONE]":
                        continue
                    choice = json.loads(data)["choices"][0]
                    ids += [int(t) for t in choice.get("token_ids") or []]
                    logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                    text += choice.get("text") or ""
                    yield EngineOutput(output_ids=list(ids), output_logprobs=list(logprobs),
                                       finish_reason=choice.get("finish_reason") or "", text=text,
                                       weight_versions=[VersionSpan(version, 0, len(ids))] if ids else [],
                                       prompt_tokens=len(input_ids))
        finally:
            self._inflight.discard(rid)

    async def abort(self, rid: str | None = None) -> None:
        """Abort request `rid` and every request of ours whose id starts with it (None: every request
        the server runs). An aborted request answers what it generated so far, finish reason "abort"."""
        if rid is None:
            await self._request("POST", "/abort_requests", {})
            return
        # vLLM's id of our one-prompt request: "cmpl-{request_id}-{prompt index}" (completion/serving.py)
        ids = [f"cmpl-{r}-0" for r in self._inflight if r.startswith(rid)]
        if ids:
            await self._request("POST", "/abort_requests", {"request_ids": ids})

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause", params={"mode": PAUSE_MODES[mode]})

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def flush_cache(self) -> None:
        reply = await self._request("POST", "/reset_prefix_cache")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineHTTPError(409, "vLLM did not reset its prefix cache: blocks are still held by running "
                                  "requests (retry when they finish)", "/reset_prefix_cache")

    async def health(self) -> bool:
        try:
            async with self._session().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def load(self) -> int:
        """vLLM's `/load`: the generation requests it is serving."""
        return int((await self._request("GET", "/load"))["server_load"])

    async def info(self) -> dict[str, Any]:
        """vLLM's `/server_info` (dev mode): its configuration as JSON, and its environment."""
        return dict(await self._request("GET", "/server_info", params={"config_format": "json"}))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ----- weights (the engine's actor) -----

    async def reload_weights(self, folder: str | Path, label: str, *, flush_cache: bool = True) -> None:
        """Load the safetensors files under `folder` (checkpoint names) into the served model, in place.
        (`flush_cache` is not needed: requests salt their prefix cache with the version, `cache_salt`.)"""
        await self._request("POST", "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        await self.set_weight_version(label)

    async def reset_weights(self) -> None:
        """Zero every weight (a tensor an update then skips shows in the verification)."""
        await self._request("POST", "/weight_checker", {"action": "reset"})

    async def set_weight_version(self, label: str) -> None:
        await self._request("POST", "/update_weight_version", {"new_version": label})

    async def weight_version(self) -> str:
        return str((await self._request("GET", "/weight_info"))["weight_version"])

    async def prompt_logprobs(self, input_ids: list[int]) -> list[float]:
        """The log-prob of each prompt token after the first, under the served weights."""
        return await self.score(input_ids, 1)

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter folder `path` as LoRA adapter `name`, in place of the one of that
        name (/v1/load_lora_adapter with load_inplace; the server runs with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
        await self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                               "load_inplace": True})

    async def score(self, input_ids: list[int], start: int) -> list[float]:
        """`EngineBackend.score`: vLLM's prompt log-probs cover the whole prompt (it has no start
        position); the tail from `start` is kept. A cache salt of its own keeps the prefix cache out."""
        check_score_start(input_ids, start)
        reply = await self._request("POST", "/v1/completions", {
            "model": await self.model(), "prompt": input_ids, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0, "cache_salt": f"probe-{next(self._ids)}", "return_token_ids": True})
        entries = reply["choices"][0]["prompt_logprobs"][start:]
        return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, input_ids[start:])]


def parse_completion(choice: dict[str, Any], *, version: int) -> EngineOutput:
    """One choice of vLLM's /v1/completions reply (with `return_token_ids`, `logprobs: 0`) -> `EngineOutput`."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise ValueError(f"vLLM answered {len(ids)} token ids but {len(logprobs)} log-probs (was `logprobs` sent?)")
    prompt = choice.get("prompt_token_ids") or []
    return EngineOutput(output_ids=ids, output_logprobs=logprobs, finish_reason=choice.get("finish_reason") or "abort",
                        text=choice.get("text") or "",
                        weight_versions=[VersionSpan(version, 0, len(ids))] if ids else [],
                        prompt_tokens=len(prompt))
