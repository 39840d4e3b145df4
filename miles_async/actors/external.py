"""`ExternalEngineActor`: an inference server of another project (vLLM, SGLang) as one of the run's engines.

    WeightPusher ──PauseEngine / BeginUpdate / LoadWeightsFile / CommitUpdate / ResumeEngine──► ExternalEngineActor
    rollout workers, evaluator, session server ──HTTP (engine/backend.py)──────────────────────► the server
                                                                                                  ▲
                                           ExternalEngineActor ──starts, reloads, probes────────┘

The actor starts the server (`VllmServer`, from `.venv-vllm` or the Python the recipe names;
`SGLangServer`, on a GPU machine with SGLang) or attaches to one already running
(`ServerConfig.url`: any server speaking SGLang's API, our embedded engine's included), and
talks to it through its `EngineBackend`, which is also its `WeightAdmin` (engine/backend.py).
It answers the same update protocol as
`EngineActor` (miles_async/actors/engine.py), so the weight pusher, the scheduler and the liveness checks
treat both alike. Generation never passes through it: clients reach the server's HTTP API at
`EngineState.url`.

An update comes as a file (the pusher's `disk` transport: one folder per version, the model's
safetensors in checkpoint names) and is atomic from the loop's point of view: nothing reaches
the server before `CommitUpdate`, which (1) checks the file against the pusher's checksums when
it sends them (verification on), (2) has the server reload it in place (vLLM: `reload_weights`
through `/collective_rpc`; SGLang: `/update_weights_from_disk`, the model's config.json copied
beside the file), (3) when verifying, runs a probe: the server's log-probs of a fixed
token sequence must match, within `PROBE_TOLERANCE`, those our own model computes from the same
file (a tensor the server skipped, or left zeroed by `RandomFill`, shows there), and (4) makes the
version live (`/update_weight_version`). The probe needs the server running: a paused one is
resumed for it (its requests go on under the new weights a moment before the pusher's
`ResumeEngine`, as they would after it). A failed probe pauses the server (aborting what it
runs) and keeps it paused (`weights_error`), as a torn embedded engine refuses requests, until a
good version commits.

LoRA (`trainer.lora`, with `ServerConfig.lora = "adapter"`): the server starts with LoRA on (vLLM:
`--enable-lora` and runtime adapter loading; SGLang: `--enable-lora` with the target modules), and
serves the trainer's adapters as one adapter, `ADAPTER_NAME`, that every client request names
(`connect(..., adapter=)`): a zero adapter (the base) from the start, then each pushed file of
adapters written as a PEFT folder and loaded in place of the previous (vLLM's
/v1/load_lora_adapter with load_inplace; SGLang's /unload_lora_adapter then /load_lora_adapter),
probed like any update. The base is never pushed again, so the random-fill check does not
overwrite it. With `"merged"` the pushes are whole models with the adapters merged, as without LoRA.

An SGLang server can take its updates through its own weight-update group instead (the pusher's
`distributed` transport, miles_async/actors/distributed.py, which gives the design): `JoinWeightGroup` has it
join the pusher's group (leaving the one it held), `ReceiveDistributed` posts each bucket's
`/update_weights_from_distributed` inside `/begin_weight_update` .. `/end_weight_update` while the
pusher broadcasts, and `CommitUpdate` then runs the probe against the log-probs the pusher computed
from the tensors it sent, and makes the version live. A failure midway leaves the server torn:
paused, with `weights_error`, until a version commits.

Try it: `pytest tests/e2e/test_vllm.py -s` (after `python3 dev.py vllm`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import torch

from miles_async.actors.engine import (
    AbortUpdate,
    BeginUpdate,
    CommitUpdate,
    EngineState,
    EngineStatus,
    LoadWeightsFile,
    PauseEngine,
    RandomFill,
    ResumeEngine,
)
from miles_async.engine.backend import ADAPTER_NAME
from miles_async.engine.client import EngineHTTPError
from miles_async.engine.weights import StaleVersionError
from miles_async.models.lora import LoraConfig, add_lora, lora_state, write_peft_adapter
from miles_async.runtime import Actor, Message, handler
from miles_async.transport.broadcast import layout_from_json
from miles_async.transport.errors import TransportError
from miles_async.transport.verify import checksums, compare

log = logging.getLogger("miles_async.actors.external")
T = TypeVar("T")

PROBE_LENGTH = 48
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank choices
PROBE_TOLERANCE = 2e-3  # max |log-prob difference| on the probe, float32 (measured: ~5e-7 for vLLM on CPU)


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a run gets an external engine (the recipe's `[rollout.server]`, for `rollout.backend` other
    than "embedded"): started by the run from `python` (vLLM's default: `.venv-vllm`, made by
    `python3 dev.py vllm`; SGLang's: this Python), or attached to the running server at `url` (one
    engine)."""

    url: str = ""  # attach to this server instead of starting one
    python: str = ""  # the Python to start the server with ("" = the backend's default)
    extra_args: list[str] = []  # more command-line arguments for the server
    env: dict[str, str] = {}  # more environment variables for the server
    cpus: str = ""  # bind the server's worker threads to these cores ("0-1"); "" = rollout.engine_threads, unbound
    kv_cache_mib: int = 64  # vLLM: its KV cache, MiB (--kv-cache-memory-bytes); SGLang sizes its own
    max_model_len: int = 0  # 0 = the model's
    start_timeout_s: float = 600.0  # a started server not healthy within this many seconds fails the run
    # With trainer.lora: "adapter" serves the trainer's adapters through the server's own LoRA
    # endpoint (started with LoRA on; each push moves the adapters alone), "merged" pushes whole
    # models with the adapters merged in (a server without LoRA support, e.g. one attached by url).
    lora: Literal["adapter", "merged"] = "adapter"

    def __post_init__(self) -> None:
        if self.kv_cache_mib < 1 or self.start_timeout_s <= 0:
            raise ValueError(f"rollout.server.kv_cache_mib must be >= 1 and start_timeout_s > 0, got "
                             f"{self.kv_cache_mib} and {self.start_timeout_s}")


class WeightGroupRanks(Message[int], frozen=True):
    """How many ranks the server joins a weight-update group with (its tensor-parallel size)."""


class JoinWeightGroup(Message[EngineState], frozen=True):
    """Have the server join the pusher's group `group_name` (SGLang's /init_weights_update_group;
    the pusher, rank 0, joins concurrently), leaving the group it held before."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"


class ReceiveDistributed(Message[EngineState], frozen=True):
    """Have the server receive the update the pusher is broadcasting in `group_name`, bucket by bucket
    (`layout_json`: transport.broadcast's layout); `expected`: the probe's log-probs of `probe_ids`
    under the pushed weights, checked at CommitUpdate (empty: not verified)."""

    group_name: str
    layout_json: str
    probe_ids: list[int] = []
    expected: list[float] = []


def bucket_requests(layout_json: str, label: str, flush_cache: bool) -> list[dict[str, Any]]:
    """The /update_weights_from_distributed fields of each bucket of an update, in order: the last
    one carries the version label and the cache flush (miles_async/actors/distributed.py says why)."""
    layout = layout_from_json(layout_json)
    requests = [{"names": [s.name for s in bucket], "dtypes": [s.dtype for s in bucket],
                 "shapes": [list(s.shape) for s in bucket], "flush_cache": False} for bucket in layout if bucket]
    if requests:
        requests[-1] |= {"weight_version": label, "flush_cache": flush_cache}
    return requests


class ProbeReference:
    """Our own model of `model_dir`, for the probe: the log-probs of a fixed token sequence
    (PROBE_LENGTH tokens, seeded) under given weights (checkpoint names). Loaded at first use."""

    def __init__(self, model_dir: str, lora: LoraConfig | None = None) -> None:
        self.model_dir = model_dir
        self.lora = lora if lora is not None and lora.enabled else None  # the tensors are adapters on the base
        self.model: Any = None
        self.ids: list[int] = []

    def logprobs(self, tensors: dict[str, torch.Tensor]) -> list[float]:
        """The log-prob of each probe token after the first; TransportError when a weight is missing."""
        if self.model is None:
            from miles_async.models import load_pretrained

            self.model = load_pretrained(self.model_dir)
            if self.lora is not None:
                add_lora(self.model, self.lora)
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(3, self.model.config.vocab_size, (PROBE_LENGTH,), generator=generator).tolist()
        model = self.model
        state = lora_state(model) if self.lora is not None else model.state_dict()
        missing = [n for n in state if n not in tensors and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing:
            raise TransportError(f"the update lacks {len(missing)} tensor(s), e.g. {missing[:4]}")
        with torch.no_grad():
            for name, target in state.items():
                if name in tensors:
                    target.data.copy_(tensors[name])
            ids = torch.tensor([self.ids])
            out = model(ids)
            logits = out[0] if isinstance(out, tuple) else out  # an MoE model adds its routing
            logp = torch.log_softmax(logits.float(), dim=-1)[0]
        return logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1).tolist()


class ExternalEngineActor(Actor):
    """One external engine of kind `kind` serving `model_dir` (module docstring)."""

    def __init__(self, kind: Literal["vllm", "sglang"], model_dir: str, config: ServerConfig | None = None, *,
                 http_host: str = "127.0.0.1", threads: int = 1, dtype: str = "float32",
                 api_key: str | None = None, log_dir: str = "", lora: LoraConfig | None = None) -> None:
        if kind not in ("vllm", "sglang"):
            raise ValueError(f"ExternalEngineActor serves vllm or sglang, not {kind!r}")
        self.kind = kind
        self.model_dir = model_dir
        self.config = config or ServerConfig()
        self.host = http_host
        self.threads = threads
        self.dtype = dtype
        self.api_key = api_key
        self.log_dir = log_dir
        self.server: Any = None  # VllmServer or SGLangServer (engine.process.ServerProcess), if this actor started it
        self.backend: Any = None  # VllmBackend or SGLangBackend: an EngineBackend and a WeightAdmin
        self.url = ""
        self.version = 0
        self.label = "0"
        self.paused: str | None = None
        self.weights_error: str | None = None
        self.updating: int | None = None
        self.pending: Path | None = None  # the update's file
        self.num_bytes = 0
        self._lease: asyncio.TimerHandle | None = None
        # LoRA pushed as adapters: the server serves base + ADAPTER_NAME, reloaded at each update
        self.lora = lora if lora is not None and lora.enabled else None
        self._reference = ProbeReference(model_dir, self.lora)
        self.group_name = ""  # the weight-update group the server holds (the distributed transport)
        self.received: tuple[list[int], list[float]] | None = None  # a distributed update in, and its probe
        self.tied = False  # the model's embeddings and output projection are one tensor

    async def on_start(self) -> None:
        from miles_async.engine.backend import connect

        cfg = self.config
        self.tied = bool(json.loads((Path(self.model_dir) / "config.json").read_text()).get("tie_word_embeddings"))
        if cfg.url:
            self.url = cfg.url.rstrip("/")
        else:
            self.server = self._server(Path(self.log_dir or tempfile.mkdtemp(prefix=f"miles-{self.kind}-")))
            log.info("%s: starting %s (%s), log %s", self.name, self.server.kind, " ".join(self.server.argv()),
                     self.server.log_path)
            self.url = await self.server.start(cfg.start_timeout_s)
        self.backend = connect(self.kind, self.url, api_key=self.api_key, adapter=ADAPTER_NAME if self.lora else "")
        if not await _in_task(self.backend.health()):
            raise RuntimeError(f"{self.name}: the {self.kind} server at {self.url} does not answer /health")
        if self.lora is not None:  # the adapter every request names exists from the start: B = 0, the base
            folder = Path(self.log_dir or tempfile.mkdtemp(prefix=f"miles-{self.kind}-")) / f"{self.name}-adapter-0"
            await asyncio.to_thread(self._zero_adapter, folder)
            await _in_task(self.backend.load_adapter(ADAPTER_NAME, str(folder)))
        await _in_task(self.backend.set_weight_version(self.label))
        self.num_bytes = sum(f.stat().st_size for f in Path(self.model_dir).glob("*.safetensors"))

    def _zero_adapter(self, folder: Path) -> None:
        from miles_async.models import load_pretrained

        assert self.lora is not None
        model = load_pretrained(self.model_dir)
        add_lora(model, self.lora)
        write_peft_adapter(folder, {n: t.detach() for n, t in lora_state(model).items()}, self.lora)

    def _lora_args(self) -> list[str]:
        """The server's LoRA flags (vLLM's max rank is one of its sizes: the smallest that holds ours)."""
        if self.lora is None:
            return []
        if self.kind == "sglang":
            return ["--enable-lora", "--max-lora-rank", str(self.lora.rank), "--max-loras-per-batch", "1",
                    "--lora-target-modules", *self.lora.targets]
        rank = min(r for r in VLLM_LORA_RANKS if r >= self.lora.rank)
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]

    def _server(self, folder: Path) -> Any:
        from miles_async.trainer.fsdp import free_port

        cfg = self.config
        port = free_port(self.host)
        log_path = folder / f"{self.name}-{self.kind}.log"
        if self.kind == "sglang":
            from miles_async.engine.sglang import SGLangServer, default_command

            command = [cfg.python, "-m", "sglang.launch_server"] if cfg.python else default_command()
            return SGLangServer(self.model_dir, host=self.host, port=port, command=command,
                                extra_args=["--dtype", self.dtype, *(["--api-key", self.api_key] if self.api_key else []),
                                            *self._lora_args(), *cfg.extra_args], env=dict(cfg.env), log_path=log_path)
        from miles_async.engine.vllm import VllmServer

        served = untied_view(self.model_dir, folder / f"{self.name}-model") if self.tied else Path(self.model_dir)
        lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.lora else {}
        return VllmServer(served, host=self.host, port=port, python=cfg.python or None, dtype=self.dtype,
                          threads=self.threads, cpus=cfg.cpus, kv_cache_bytes=cfg.kv_cache_mib * 2**20,
                          max_model_len=cfg.max_model_len, api_key=self.api_key,
                          extra_args=[*self._lora_args(), *cfg.extra_args], env={**lora_env, **cfg.env},
                          log_path=log_path)

    async def on_stop(self) -> None:
        await self._close()

    async def on_failure(self, failure: Any) -> None:
        await self._close()

    async def _close(self) -> None:
        self._cancel_lease()
        if self.backend is not None:
            await self.backend.close()
        if self.server is not None:
            await self.server.stop()

    def state(self) -> EngineState:
        return EngineState(name=self.name, version=self.version, label=self.label, paused=self.paused,
                           weights_error=self.weights_error, updating=self.updating, dtype=self.dtype,
                           num_bytes=self.num_bytes, url=self.url,
                           pid=self.server.pid if self.server is not None and self.server.pid else os.getpid())

    @handler(concurrent=True)
    async def status(self, msg: EngineStatus) -> EngineState:
        if self.server is not None and self.server.returncode is not None:
            raise RuntimeError(f"{self.name}: the {self.kind} server exited with status {self.server.returncode}; log "
                               f"tail:\n{self.server.log_tail()}")
        return self.state()

    @handler
    async def pause(self, msg: PauseEngine) -> EngineState:
        await _in_task(self.backend.pause(msg.mode))
        self.paused = msg.mode
        return self.state()

    @handler
    async def resume(self, msg: ResumeEngine) -> EngineState:
        if self.weights_error is not None and self.updating is None:  # a failed probe: serve nothing
            log.warning("%s: not resumed: %s", self.name, self.weights_error)
            return self.state()
        await _in_task(self.backend.resume())
        self.paused = None
        return self.state()

    # ----- the update protocol -----

    @handler
    async def begin_update(self, msg: BeginUpdate) -> EngineState:
        if msg.version <= self.version:
            raise StaleVersionError(f"weight version {msg.version} is not newer than {self.name}'s {self.version}")
        self.updating, self.pending, self.received = msg.version, None, None
        self._cancel_lease()
        self._lease = asyncio.get_running_loop().call_later(msg.lease_s, self._lease_expired, msg.version)
        return self.state()

    @handler
    async def load_weights_file(self, msg: LoadWeightsFile) -> EngineState:
        if self.updating is None:
            raise TransportError(f"{self.name}: LoadWeightsFile without BeginUpdate")
        path = Path(msg.path)
        if not path.is_file():
            raise TransportError(f"{self.name}: no weights file at {path}")
        self.pending = path
        return self.state()

    @handler
    async def commit_update(self, msg: CommitUpdate) -> EngineState:
        self._cancel_lease()
        if self.updating is not None and self.received is not None:
            return await self._commit_distributed(self.updating, *self.received)
        if self.updating is None or self.pending is None:
            raise TransportError(f"{self.name}: CommitUpdate with no update file (BeginUpdate, LoadWeightsFile first)")
        version, path = self.updating, self.pending
        self.updating = self.pending = None
        # the file is what the pusher meant (verifying); LoRA's adapters are read in any case
        tensors = await self._checked_file(path, msg.checksums, version) \
            if msg.checksums is not None or self.lora is not None else None
        if self.lora is not None:  # written as a PEFT folder beside the file, served in place of the last
            assert tensors is not None
            folder = await asyncio.to_thread(write_peft_adapter, path.parent / "adapter", tensors, self.lora)
            await _in_task(self.backend.load_adapter(ADAPTER_NAME, str(folder)))
        else:
            if self.kind == "vllm" and self.tied and not self.config.url:  # it serves the untied view
                await asyncio.to_thread(_write_lm_head, path)
            await asyncio.to_thread(shutil.copyfile, Path(self.model_dir) / "config.json", path.parent / "config.json")
            # flushed only when the pause aborted everything: SGLang fails the update when the flush finds
            # requests held (rollout.partial = "continue" keeps them in place)
            await _in_task(self.backend.reload_weights(str(path.parent), str(version),
                                                       flush_cache=self.paused == "abort"))
        if msg.checksums is not None and tensors is not None:
            expected = await asyncio.to_thread(self._reference_logprobs, tensors)
            await self._probe(self._reference.ids, expected, version)
        self.weights_error = None
        self.version, self.label = version, str(version)
        return self.state()

    async def _checked_file(self, path: Path, expected: dict[str, str] | None, version: int) -> dict[str, torch.Tensor]:
        """The update file's tensors, compared with the pusher's checksums when it sent them."""
        tensors = await asyncio.to_thread(_read, path)
        if expected is not None:
            bad = compare(expected, await asyncio.to_thread(checksums, tensors))
            if bad:
                raise TransportError(f"{self.name}: the update file {path} differs from what was pushed in "
                                     f"{len(bad)} tensor(s), e.g. {', '.join(bad[:4])}; version {version} not loaded")
        return tensors

    async def _commit_distributed(self, version: int, probe_ids: list[int], expected: list[float]) -> EngineState:
        """The server holds the version (ReceiveDistributed): probe it when the pusher sent the
        expected log-probs, then make it live."""
        self.updating = self.received = None
        if expected:
            await self._probe(probe_ids, expected, version)
        self.weights_error = None
        self.version, self.label = version, str(version)
        return self.state()

    @handler
    async def abort_update(self, msg: AbortUpdate) -> EngineState:
        self._cancel_lease()
        self.updating = self.pending = self.received = None  # disk: nothing reached the server before the commit
        log.warning("%s: update aborted: %s", self.name, msg.reason)
        return self.state()

    @handler
    async def random_fill(self, msg: RandomFill) -> EngineState:
        """vLLM's own reset (zeros, not noise): a tensor the next update skips shows in its probe.
        SGLang has no such call: its probe alone verifies. Nor does a server taking LoRA adapters:
        its base is never pushed again, so it must not be overwritten."""
        if self.lora is not None:
            log.info("%s: LoRA adapters: the probe alone verifies the first update (the base stays)", self.name)
            return self.state()
        try:
            await _in_task(self.backend.reset_weights())
        except NotImplementedError as e:
            log.info("%s: no overwrite before the first verified update (%s)", self.name, e)
            return self.state()
        self.weights_error = "weights zeroed for the verification of the next update"
        return self.state()

    async def _probe(self, probe_ids: list[int], expected: list[float], version: int) -> None:
        """The server's log-probs of the probe sequence against our model's on the pushed weights
        (`expected`). A paused server answers nothing: it is resumed for the probe."""
        if self.paused is not None:
            await _in_task(self.backend.resume())
            self.paused = None
        served = await _in_task(self.backend.prompt_logprobs(probe_ids))
        worst = max(abs(a - b) for a, b in zip(served, expected))
        if worst > PROBE_TOLERANCE:
            await self._torn(f"weight version {version} failed the probe: the server's log-probs differ from "
                             f"the pushed weights' by up to {worst:.3g} (tolerance {PROBE_TOLERANCE:g})")
            raise TransportError(f"{self.name}: {self.weights_error}")
        log.info("%s: version %d verified by the probe (max log-prob difference %.2g)", self.name, version, worst)

    async def _torn(self, why: str) -> None:
        """The server holds weights that are not a pushed version: pause it (aborting what it runs)
        and keep it paused until a version commits."""
        self.weights_error = why
        await _in_task(self.backend.pause("abort"))
        self.paused = "abort"

    def _reference_logprobs(self, tensors: dict[str, torch.Tensor]) -> list[float]:
        try:
            return self._reference.logprobs(tensors)
        except TransportError as e:
            raise TransportError(f"{self.name}: {e}") from e

    # ----- SGLang's weight-update group (the distributed transport) -----

    def _group_backend(self) -> Any:
        if self.kind != "sglang":
            raise TransportError(f"{self.name}: the distributed transport is SGLang's; a {self.kind} server has no "
                                 'weight-update group (weights.transport = "disk")')
        return self.backend

    @handler
    async def group_ranks(self, msg: WeightGroupRanks) -> int:
        return await _in_task(self._group_backend().group_ranks())

    @handler
    async def join_weight_group(self, msg: JoinWeightGroup) -> EngineState:
        backend = self._group_backend()
        if self.group_name:  # the pusher formed a new group: leave the old (a restarted server holds none)
            old, self.group_name = self.group_name, ""
            try:
                await _in_task(backend.leave_weight_group(old))
            except EngineHTTPError as e:
                log.info("%s: leaving weight-update group %s: %s", self.name, old, e.message)
        await _in_task(backend.join_weight_group(msg.host, msg.port, msg.rank_offset, msg.world_size,
                                                 msg.group_name, msg.backend))
        self.group_name = msg.group_name
        return self.state()

    @handler
    async def receive_distributed(self, msg: ReceiveDistributed) -> EngineState:
        """Post every bucket inside one weight-update session while the pusher broadcasts it."""
        backend = self._group_backend()
        if self.updating is None:
            raise TransportError(f"{self.name}: ReceiveDistributed without BeginUpdate")
        if msg.group_name != self.group_name:
            raise TransportError(f"{self.name}: the server is not in weight-update group {msg.group_name} "
                                 f"(it holds {self.group_name or 'none'}): JoinWeightGroup first")
        requests = bucket_requests(msg.layout_json, str(self.updating), flush_cache=self.paused == "abort")
        await _in_task(backend.begin_weight_update())
        num_sent = 0
        try:
            for request in requests:
                num_sent += 1
                await _in_task(backend.receive_weights(request, msg.group_name))
        except BaseException as e:
            if num_sent:
                await self._torn(f"the server holds a partial update to version {self.updating} (bucket "
                                 f"{num_sent} of {len(requests)} failed: {e})")
            raise  # the pusher forms a new group: JoinWeightGroup leaves this one
        finally:
            try:
                await _in_task(backend.end_weight_update())  # SGLang opens no session while one is open
            except EngineHTTPError as e:
                log.warning("%s: /end_weight_update: %s", self.name, e.message)
        self.received = (msg.probe_ids, msg.expected)
        return self.state()

    # ----- the lease -----

    def _cancel_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    def _lease_expired(self, version: int) -> None:
        self._lease = None
        if self.updating == version:
            log.warning("%s: no commit of weight version %d in time: the update is dropped", self.name, version)
            self.updating = self.pending = self.received = None
            asyncio.get_running_loop().create_task(self._resume_after_lease())

    async def _resume_after_lease(self) -> None:
        try:
            await _in_task(self.backend.resume())
            self.paused = None
        except Exception as e:  # noqa: BLE001 - the server is gone: its status says so
            log.warning("%s: could not resume after the lease: %s", self.name, e)


async def _in_task(coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` in a task of its own: a handler's first step runs outside any task
    (runtime/eager.py), and aiohttp's timeouts refuse to run there."""
    return await asyncio.ensure_future(coro)


EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def untied_view(model_dir: str | Path, out: Path) -> Path:
    """The model at `model_dir` with its output projection as a tensor of its own (`out`: links to its
    files, a config.json saying `tie_word_embeddings: false` and lm_head.safetensors).

    vLLM 0.32's CPU build keeps the output projection of a tied model as a processed copy that its
    in-place reload does not refresh (the reload finds no `lm_head` weights in a tied checkpoint and
    puts the old ones back: "ParallelLMHead: Failed to load weights"), so updates would leave the
    first version's projection in place; untied, each update carries it (`_write_lm_head`).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        link = out / entry.name
        if entry.name not in ("config.json", "model.safetensors.index.json") and not link.exists():
            link.symlink_to(entry.resolve())
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    index_path = source / "model.safetensors.index.json"
    files = sorted(source.glob("*.safetensors"))
    if index_path.exists():  # a sharded checkpoint: vLLM reads only the files its index names
        index = json.loads(index_path.read_text())
        files = [source / index["weight_map"][EMBED]]
        index["weight_map"][LM_HEAD] = "lm_head.safetensors"
        (out / index_path.name).write_text(json.dumps(index, indent=2))
    for file in files:
        with safe_open(str(file), "pt") as handle:
            if EMBED in handle.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                save_file({LM_HEAD: handle.get_tensor(EMBED).clone()}, str(out / "lm_head.safetensors"))
                return out
    raise ValueError(f"{model_dir}: tied embeddings, but no {EMBED} in its safetensors files")


def _write_lm_head(path: Path) -> None:
    """Beside an update's file: its embedding again as `lm_head.weight` (see `untied_view`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        embed = handle.get_tensor(EMBED)
    save_file({LM_HEAD: embed}, str(path.parent / "lm_head.safetensors"))


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
