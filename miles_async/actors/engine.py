"""`EngineActor`: one embedded rollout engine as an actor, and the engine's side of weight updates.

    WeightPusher ──PauseEngine / BeginUpdate / ReceiveBroadcast / ApplyDelta / CommitUpdate──► EngineActor
    rollout      ──Generate (or HTTP, when `http_port` is set)──────────────────────────────► EngineActor
    teacher stage ──ScoreTokens (a distillation teacher's scoring, miles_async/actors/teacher.py)──────────► EngineActor

Consumes: generation requests, and the weight-update messages of the update protocol
(`miles_async.engine.weights`): `BeginUpdate` opens an update (refused for a version not newer
than the engine's) and says where to write it (the shared segment, for the shm transport);
the transport moves the bytes (`ReceiveBroadcast` joins a broadcast, `LoadWeightsFile` and
`ApplyDelta` read from a shared folder, a pusher in another process writes the segment itself);
`CommitUpdate` verifies (if checksums come with it) and makes the version live. Produces:
`EngineState` (version, pause, torn reason, device) after each of them.

Device: the engine runs where `EngineConfig.device` says (`rollout.engine.device`; a one-node run
gives each engine on "cuda"/"auto" a GPU of its own through CUDA_VISIBLE_DEVICES). A broadcast over
NCCL lands straight in its GPU weights; over gloo, in its weights on a CPU engine, or in host
tensors then copied to the GPU.

An update is leased: if no `CommitUpdate` arrives within `BeginUpdate.lease_s` (the pusher died,
a bucket was lost), the engine aborts it and resumes generation: a double-buffered engine
serves its previous version, a single-buffered one stays torn, refusing requests and saying so
in `EngineStatus` and its HTTP health, until a complete version commits.

The engine's torch work runs on its compute thread (engine/compute.py); the actor's event loop
only moves messages. A colocated pusher (same process) finds the engine by the actor's name
(`transport.colocated`).

Try it: `pytest tests/dist/test_weight_updates.py -s`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

import msgspec
import torch

from miles_async.engine import compute
from miles_async.engine.backend import check_score_start
from miles_async.engine.client import EngineOutput
from miles_async.engine.core import Engine, EngineConfig, resolve_device
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.server import EngineServer
from miles_async.kernels.precision import auto_dtype
from miles_async.runtime import Actor, Message, handler
from miles_async.transport import colocated
from miles_async.transport.broadcast import layout_from_json, recv_buckets
from miles_async.transport.groups import WeightGroup

log = logging.getLogger("miles_async.actors.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    version: int
    label: str
    paused: str | None
    weights_error: str | None  # why nothing is served (torn weights), or None
    updating: int | None  # the version of an update in progress
    dtype: str
    num_bytes: int  # of the weights
    target_segment: str | None = None  # shm: where a pusher writes the update in progress
    url: str | None = None  # the HTTP API, when served
    pid: int = 0  # the engine's process
    device: str = "cpu"  # of its weights and KV cache (EngineConfig.device, resolved: e.g. "cuda:0")
    # the projections' format (EngineConfig.weight_format): a pusher sends them quantized in it
    weight_format: str = "none"


# -- messages -------------------------------------------------------------------------------


class Generate(Message[EngineOutput], frozen=True):
    request: GenerateRequest


class ScoreTokens(Message[list[float]], frozen=True):
    """The log-prob of each of `input_ids[start:]` given the tokens before it (`EngineBackend.score`
    over the mailbox): one prefill-only request, nothing generated."""

    input_ids: list[int]
    start: int


class EngineStatus(Message[EngineState], frozen=True):
    """The engine's state (version, pause, torn weights, URL)."""


class PauseEngine(Message[EngineState], frozen=True):
    mode: str = "in_place"


class ResumeEngine(Message[EngineState], frozen=True):
    """Resume generation after a pause."""


class ReleaseMemory(Message[EngineState], frozen=True):
    """Give back the weights' and/or the KV cache's memory (`tags`: "weights", "kv_cache"; None:
    both) while a colocated trainer uses the machine: generation is paused first (mode "abort":
    what is in flight is aborted) and stays paused; requests that arrive meanwhile queue. The
    released weights come back only with a push (`ResumeMemory`, then any transport: the same
    version may be pushed again), whose resume lets generation go on."""

    tags: list[str] | None = None


class ResumeMemory(Message[EngineState], frozen=True):
    """Allocate again what `ReleaseMemory` gave back (the KV cache empty, the weights zeros until
    pushed); generation stays paused until the push's resume."""

    tags: list[str] | None = None


class BeginUpdate(Message[EngineState], frozen=True):
    version: int
    lease_s: float = 300.0  # abort the update if no CommitUpdate arrives in time


class ReceiveStream(Message[EngineState], frozen=True):
    """Fetch the update from the pusher's CURVE-authenticated stream at `address` (transport "stream")."""

    address: str
    layout_json: str
    timeout_s: float = 300.0


class ReceiveBroadcast(Message[EngineState], frozen=True):
    """Join the pusher's group (once; kept for later updates) and receive `layout` into the update."""

    host: str
    port: int
    rank: int
    world_size: int
    group_id: str  # a new id means a new group (the pusher restarted)
    layout_json: str
    backend: str = "gloo"
    timeout_s: float = 300.0


class LoadWeightsFile(Message[EngineState], frozen=True):
    """Write a safetensors file's tensors into the update in progress (the disk transports' full copy)."""

    path: str


class ApplyDelta(Message[EngineState], frozen=True):
    """Apply a disk delta written against this engine's version (no BeginUpdate needed)."""

    folder: str


class CommitUpdate(Message[EngineState], frozen=True):
    checksums: dict[str, str] | None = None  # verify against these before going live


class AbortUpdate(Message[EngineState], frozen=True):
    reason: str


class RandomFill(Message[EngineState], frozen=True):
    """Overwrite the live weights with seeded noise (the start of the verification check)."""

    seed: int


class GetChecksums(Message[dict[str, str]], frozen=True):
    """A checksum of every weight the engine serves."""


class RdmaTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where a pusher writes the update: the engine's queue pair and regions, and each tensor's place."""

    endpoint: Any  # transport.rdma.EndpointInfo (Any here: msgspec decodes it as a plain dict without pyverbs)
    tensors: dict[str, tuple[int, int, int]]  # name -> (region id, offset, nbytes), for rdma_plan.plan_writes


class ConnectRdma(Message[RdmaTarget], frozen=True):
    """Register the update's target memory and connect a queue pair to the pusher's (`[rdma]` extra)."""

    pusher: Any  # transport.rdma.EndpointInfo


def _experts_bytes(experts_TLk: torch.Tensor | None) -> bytes:
    """Routed experts as SGLang reports them: int32 little-endian, C order."""
    if experts_TLk is None:
        return b""
    return experts_TLk.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()


# -- the actor ------------------------------------------------------------------------------


class EngineActor(Actor):
    """An `Engine` over `model_dir`, with the weight-update handlers (module docstring)."""

    engine: Engine

    def __init__(self, model_dir: str, config: EngineConfig | None = None, *,
                 http_host: str = "127.0.0.1", http_port: int | None = None, num_threads: int = 0,
                 api_key: str | None = None) -> None:
        self.model_dir = model_dir
        self.config = config or EngineConfig()
        self.dtype: str = self.config.dtype  # "auto" until on_start resolves it on the engine's device
        self.http = (http_host, http_port)
        self.api_key = api_key  # required of HTTP clients (a multi-node run's engines listen off loopback)
        self.num_threads = num_threads  # torch threads of the compute thread; 0 leaves torch's default
        self.server: EngineServer | None = None
        self.group: WeightGroup | None = None
        self.group_id = ""
        self._lease: asyncio.TimerHandle | None = None
        self._rdma: Any = None  # transport.rdma.RdmaEngineSide of the update in progress

    async def on_start(self) -> None:
        if self.num_threads:
            await compute.run(torch.set_num_threads, self.num_threads)
        if self.dtype == "auto":
            self.dtype = auto_dtype("auto", resolve_device(self.config.device))
            log.info("%s: dtype auto is %s on %s", self.name, self.dtype, self.config.device)
        self.engine = await compute.run(Engine.from_pretrained, self.model_dir, config=self.config,
                                        dtype=DTYPES[self.dtype])
        await self.engine.start()
        colocated.register(self.name, self.engine.weights)
        host, port = self.http
        if port is not None:
            self.server = EngineServer(self.engine, host, port, api_key=self.api_key)
            await self.server.start()

    async def on_stop(self) -> None:
        await self._close()

    async def on_failure(self, failure: Any) -> None:
        await self._close()

    async def _close(self) -> None:
        colocated.unregister(self.name)
        self._cancel_lease()
        self._close_rdma()
        if self.server is not None:
            await self.server.stop()
        await self.engine.stop()
        if self.group is not None:
            await compute.run(self.group.close)
            self.group = None
        await compute.run(self.engine.weights.close)

    def state(self) -> EngineState:
        w = self.engine.weights
        return EngineState(
            name=self.name, version=w.version, label=w.label, paused=self.engine.stats().paused,
            weights_error=w.serving_error(), updating=w.updating, dtype=self.dtype, num_bytes=w.nbytes,
            target_segment=w.target_segment if w.updating is not None else None,
            url=self.server.url if self.server is not None else None, pid=os.getpid(),
            device=str(self.engine.device), weight_format=self.engine.weights.weight_format or "none")

    # ----- generation -----

    @handler(concurrent=True)
    async def generate(self, msg: Generate) -> EngineOutput:
        out = await self.engine.generate(msg.request)
        return EngineOutput(output_ids=out.output_ids, output_logprobs=out.output_token_logprobs or [],
                            finish_reason=(out.finish_reason or {}).get("type") or "abort",
                            text=out.text or "", weight_versions=out.weight_versions,
                            routed_experts=_experts_bytes(out.routed_experts_TLk), prompt_tokens=out.prompt_tokens,
                            cached_tokens=out.cached_tokens, spec_verify_ct=out.spec_verify_ct,
                            spec_draft_tokens=out.spec_draft_tokens, spec_accepted_drafts=out.spec_accepted_drafts)

    @handler(concurrent=True)
    async def score(self, msg: ScoreTokens) -> list[float]:
        check_score_start(msg.input_ids, msg.start)
        out = await self.engine.generate(GenerateRequest(
            input_ids=msg.input_ids, sampling_params=SamplingParams(max_new_tokens=0, temperature=0.0),
            return_logprob=True, logprob_start_len=msg.start - 1))
        if (out.finish_reason or {}).get("type") == "abort":
            raise RuntimeError(f"scoring {len(msg.input_ids)} tokens was aborted (the engine paused or stopped)")
        entries = (out.input_token_logprobs or [])[-(len(msg.input_ids) - msg.start):]
        return [float(logprob or 0.0) for logprob, _ in entries]  # (only the first entry, dropped above, is None)

    @handler(concurrent=True)  # read-only: answers even while a long transfer holds the mailbox
    async def status(self, msg: EngineStatus) -> EngineState:
        return self.state()

    @handler
    async def pause(self, msg: PauseEngine) -> EngineState:
        await self.engine.pause(msg.mode)
        return self.state()

    @handler
    async def resume(self, msg: ResumeEngine) -> EngineState:
        await self.engine.resume()
        return self.state()

    @handler
    async def release_memory(self, msg: ReleaseMemory) -> EngineState:
        await self.engine.pause("abort")
        await self.engine.release_memory_occupation(msg.tags)
        return self.state()

    @handler
    async def resume_memory(self, msg: ResumeMemory) -> EngineState:
        await self.engine.resume_memory_occupation(msg.tags)
        return self.state()

    # ----- the update protocol -----

    @handler
    async def begin_update(self, msg: BeginUpdate) -> EngineState:
        await self.engine.weights.begin_update(msg.version)
        self._cancel_lease()
        self._lease = asyncio.get_running_loop().call_later(msg.lease_s, self._lease_expired, msg.version,
                                                            msg.lease_s)
        return self.state()

    @handler
    async def receive_broadcast(self, msg: ReceiveBroadcast) -> EngineState:
        """NCCL receives straight into the engine's GPU weights; gloo into them on a CPU engine, and
        into host tensors that are then copied in on a GPU one (gloo moves host memory)."""
        device = self.engine.device
        if msg.backend == "nccl" and device.type != "cuda":
            raise ValueError(f"weights.backend = \"nccl\" moves GPU memory only, and this engine runs on {device}: "
                             "set rollout.engine.device = \"cuda\" (or \"auto\" on a GPU), or use weights.backend = "
                             "\"gloo\"")
        if self.group is None or self.group_id != msg.group_id:
            if self.group is not None:
                await compute.run(self.group.close)
            self.group = None
            self.group = await compute.run(functools.partial(
                WeightGroup.join, msg.host, msg.port, msg.rank, msg.world_size, backend=msg.backend,
                timeout_s=msg.timeout_s, local_host=self.http[0]))
            self.group_id = msg.group_id
        layout = layout_from_json(msg.layout_json)
        weights = self.engine.weights
        in_place = device.type == "cpu" or msg.backend == "nccl"
        try:
            received = await compute.run(functools.partial(
                recv_buckets, layout, self.group, out=weights.target() if in_place else None,
                device=device if in_place else "cpu"))
        except Exception:
            await compute.run(self.group.close)  # a broken collective leaves the group unusable
            self.group = None
            raise
        if in_place:
            weights.mark_written(received)
        else:
            await compute.run(weights.write, received)
        return self.state()

    @handler
    async def receive_stream(self, msg: ReceiveStream) -> EngineState:
        from miles_async.transport import stream

        layout = layout_from_json(msg.layout_json)
        names = await compute.run(stream.receive, msg.address, self.system.curve_keys, layout,
                                  self.engine.weights.target(), msg.timeout_s)
        self.engine.weights.mark_written(names)
        return self.state()

    @handler
    async def load_weights_file(self, msg: LoadWeightsFile) -> EngineState:
        from safetensors.torch import load_file

        tensors = await compute.run(load_file, msg.path)
        await compute.run(self.engine.weights.write, tensors)
        return self.state()

    @handler
    async def apply_delta(self, msg: ApplyDelta) -> EngineState:
        await self.engine.weights.apply_delta(msg.folder)
        return self.state()

    @handler
    async def connect_rdma(self, msg: ConnectRdma) -> RdmaTarget:
        from miles_async.transport.rdma import EndpointInfo, RdmaEngineSide

        if self.engine.device.type != "cpu":  # verbs register host memory; GPU memory needs GPUDirect RDMA
            raise ValueError(f"weights.transport = \"rdma\" writes into host memory, and this engine runs on "
                             f"{self.engine.device}: use \"broadcast\" or \"stream\" for an engine on a GPU")
        self._close_rdma()
        pusher = msgspec.convert(msg.pusher, EndpointInfo)
        side = await compute.run(RdmaEngineSide, self.engine.weights.target())
        self._rdma = side
        await compute.run(side.connect, pusher)
        self.engine.weights.mark_written(side.regions)  # the pusher's one-sided writes: commit checks the rest
        return RdmaTarget(endpoint=side.info(), tensors=dict(side.regions))

    def _close_rdma(self) -> None:
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None

    @handler
    async def commit_update(self, msg: CommitUpdate) -> EngineState:
        self._cancel_lease()
        self._close_rdma()
        await self.engine.weights.commit_update(msg.checksums)
        return self.state()

    @handler
    async def abort_update(self, msg: AbortUpdate) -> EngineState:
        self._cancel_lease()
        self._close_rdma()
        await self.engine.weights.abort_update(msg.reason)
        return self.state()

    @handler
    async def random_fill(self, msg: RandomFill) -> EngineState:
        await self.engine.weights.random_fill(msg.seed)
        return self.state()

    @handler
    async def checksums(self, msg: GetChecksums) -> dict[str, str]:
        return await self.engine.weights.checksums()

    # ----- the lease -----

    def _cancel_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    def _lease_expired(self, version: int, lease_s: float) -> None:
        self._lease = None
        log.warning("%s: no commit of weight version %d within %gs; aborting the update", self.name, version, lease_s)
        asyncio.get_running_loop().create_task(self._expire(version, lease_s))

    async def _expire(self, version: int, lease_s: float) -> None:
        if self.engine.weights.updating != version:
            return
        await self.engine.weights.abort_update(f"no commit within the {lease_s:g}s lease: the pusher is gone")
        await self.engine.resume()
