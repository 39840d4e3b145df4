"""`WeightPusher`: moves each new weight version from the trainer into every engine.

    TrainerRank ──ExportWeights──► WeightManifest ──PushWeights──► WeightPusher ──(transport)──► EngineActor x N
                                   (or an in-process source)             │
                                                                         └── PushReport (version, seconds, GB/s)

One push, whatever the transport (`WeightSyncConfig.transport`):
  1. load the version (the trainer's exported bucket files, or the in-process source) and convert
     names and layouts to the engine's (`transport.buckets.convert`, one table per family), then
     to the engines' dtype; engines that hold their projections in a quantized format
     (`EngineConfig.weight_format`) get them quantized here, once, from the trainer's precision
     (`engine_weights`), and every transport below moves the format's tensors;
  2. before the first push, if verifying: overwrite every engine's weights with random values
     (`RandomFill`), so a tensor the transport skips cannot pass by still holding the right bytes;
  3. pause the engines (`pause_mode`; "none" keeps generating: fine for double-buffered engines);
  4. move the bytes, bucket by bucket (`bucket_mib`):
     - colocated: hand the tensors to the engine in this process (no copy where the dtype matches);
     - broadcast: `BeginUpdate`, then a torch.distributed broadcast from this actor (rank 0) to
       the engines of its own group (gloo on CPU, NCCL on GPU; joined once, kept);
     - shm: `BeginUpdate` returns the engine's target segment; the shards are written straight into it;
     - disk: the whole version as a folder under `delta_dir` (`full_v<version>/model.safetensors`,
       the checkpoint's names), which every engine loads (`LoadWeightsFile`): the path of external
       engines (miles_async/actors/external.py: vLLM reloads it in place);
     - disk_delta: the changed elements since the last pushed version, written under `delta_dir`,
       which every engine reads (`ApplyDelta`); the first push, or an engine that missed one,
       gets the whole version as one file there (`LoadWeightsFile`);
     - rdma: `BeginUpdate`, queue pairs exchanged by `ConnectRdma`, then one-sided writes into the
       engine's registered target (`[rdma]` extra; runs only where an RDMA device is);
     - stream: `BeginUpdate`, then each engine fetches the version from this actor's ZeroMQ socket
       (`ReceiveStream`), CURVE-authenticated with the run's key when the run has one (multi-node);
     - distributed (SGLang servers only): `BeginUpdate`, then SGLang's own weight-update group: this
       actor is rank 0 and broadcasts one tensor at a time while each server's actor posts the
       bucket's `/update_weights_from_distributed` (miles_async/actors/distributed.py); verified by the probe,
       whose expected log-probs this actor computes from what it sends (`model_dir`);
  5. commit: each engine verifies the per-tensor checksums it is sent (when verifying), then makes
     the version live (bump); 6. resume the engines.
A failure midway aborts the update on every engine (a double-buffered engine keeps serving its
previous version; a single-buffered one refuses requests until a complete version arrives) and
resumes them; if this actor dies instead, each engine's update lease runs out and does the same.
An engine found dead is dropped and the push goes on to the rest; with none left, nothing is
pushed and the push still succeeds (an engine that comes back gets the current version first).

The heavy work (casting, checksums, sending) runs on this actor's own worker thread.
Try it: `pytest tests/dist/test_weight_updates.py -s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch

from miles_async.actors.distributed import DistributedPush
from miles_async.actors.engine import (
    DTYPES,
    AbortUpdate,
    ApplyDelta,
    BeginUpdate,
    CommitUpdate,
    EngineState,
    EngineStatus,
    GetChecksums,
    LoadWeightsFile,
    PauseEngine,
    RandomFill,
    ReceiveBroadcast,
    ResumeEngine,
)
from miles_async.actors.external import ProbeReference
from miles_async.actors.trainer import WeightManifest
from miles_async.engine.core import PAUSE_MODES
from miles_async.engine.weights import StaleVersionError
from miles_async.kernels import quant
from miles_async.models import is_projection
from miles_async.runtime import Actor, ActorDeadError, ActorRef, AskTimeoutError, Failure, Message, handler
from miles_async.transport import colocated
from miles_async.transport.broadcast import layout_of, layout_to_json, send_buckets
from miles_async.transport.buckets import CONVERTERS, convert, split_buckets
from miles_async.transport.errors import TransportError
from miles_async.transport.groups import BACKENDS, WeightGroup
from miles_async.transport.verify import checksums, compare

T = TypeVar("T")
log = logging.getLogger("miles_async.actors.weights")
TRANSPORTS = ("colocated", "broadcast", "shm", "disk", "disk_delta", "rdma", "stream", "distributed")
AUTO = "auto"  # a recipe's: the run picks (miles_async/actors/fleet.py, Fleet.sync_config)
VERIFY = ("never", "first", "always")
Source = Callable[[], Mapping[str, torch.Tensor]]
Probe = tuple[list[int], list[float]]  # the probe's token ids and their expected log-probs
NO_ENGINE_LEFT = "NoEngineLeft"  # the cause of the ActorDeadError that ends a push with every engine dead


class WeightSyncConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How weights reach the engines (the recipe's `[weights]` table; a run sets `family`, `host`,
    `pause_mode` and `delta_dir` itself)."""

    family: str = ""  # the model family: picks the name/layout converter (required by a pusher)
    # How the bytes move (module docstring): "shm" (the engines' weights in shared memory, the fastest on
    # one node), "broadcast", "stream", "disk", "disk_delta", "rdma", "distributed", "colocated"; or
    # "auto", a recipe's default: the run picks "shm" for embedded engines on its node with their weights
    # in host memory, "stream" for engines elsewhere or on a GPU, "disk" for vLLM and SGLang servers.
    transport: str = "shm"
    bucket_mib: float = 64.0  # MiB of weights moved per bucket of a push
    pause_mode: str = "in_place"  # an engine pause mode, or "none" (double-buffered engines)
    verify: str = "first"  # never | first (random-fill check on the first push) | always
    verify_seed: int = 0  # seed of the random values verification first fills the engines' weights with
    delta_dir: str = ""  # disk, disk_delta: a folder every engine can read
    keep_deltas: int = 2  # disk, disk_delta: how many pushed versions stay on disk
    backend: str = "gloo"  # broadcast, distributed: gloo on CPU, nccl on GPU
    host: str = "127.0.0.1"  # broadcast: where this actor's group store listens
    lease_s: float = 300.0  # an engine aborts an update not committed within this
    timeout_s: float = 600.0  # for each engine step of a push
    model_dir: str = ""  # distributed: the model folder, for the probe's reference (the run sets it)

    def __post_init__(self) -> None:
        checks = (("transport", (*TRANSPORTS, AUTO)), ("verify", VERIFY), ("backend", BACKENDS),
                  ("pause_mode", (*PAUSE_MODES, "none")), ("family", tuple(CONVERTERS)))
        for field, allowed in checks:
            if getattr(self, field) not in allowed and not (field == "family" and self.family == ""):
                raise ValueError(f"WeightSyncConfig.{field}={getattr(self, field)!r} is not one of "
                                 f"{', '.join(allowed)}")
        if self.bucket_mib <= 0:
            raise ValueError(f"WeightSyncConfig.bucket_mib must be > 0, got {self.bucket_mib}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mib * 2**20)


class PushReport(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    transport: str
    seconds: float  # pause to resume
    num_bytes: int  # of the engine-dtype weights, per engine
    bytes_per_s: float
    verified: bool
    engines: list[EngineState]


class PushWeights(Message[PushReport], frozen=True):
    """Push `version`: from the trainer's exported files (`manifest`), or from the in-process source."""

    version: int
    manifest: WeightManifest | None = None


class JoinEngine(Message[None], frozen=True):
    """Push to this engine too from the next version on (it already holds the current one: a node
    that joined, or an engine restarted after its process died; `Fleet.admit`)."""

    name: str


class ForgetEngine(Message[None], frozen=True):
    name: str


class WeightPusher(Actor):
    """Pushes versions to the engines named `engines` (module docstring)."""

    def __init__(self, engines: list[str], config: WeightSyncConfig, source: Source | None = None) -> None:
        if not engines:
            raise ValueError("WeightPusher needs at least one engine name")
        if not config.family:
            raise ValueError(f"WeightSyncConfig.family is empty: give the model family ({', '.join(CONVERTERS)})")
        if config.transport == AUTO:
            raise ValueError(f'WeightSyncConfig.transport = "auto" is a recipe\'s: give the pusher one of '
                             f"{', '.join(TRANSPORTS)}")
        if config.transport in ("disk", "disk_delta") and not config.delta_dir:
            raise ValueError(f"WeightSyncConfig.delta_dir is required for transport {config.transport!r} "
                             "(a folder every engine can read)")
        if config.transport == "distributed" and not config.model_dir and config.verify != "never":
            raise ValueError('WeightSyncConfig.model_dir is required for transport "distributed" when verifying '
                             "(the probe's reference model is built from it)")
        if config.transport == "rdma":
            from miles_async.transport.rdma import require_pyverbs

            require_pyverbs()  # fail at spawn, naming the [rdma] extra
        self.engine_names = list(engines)
        self.config = config
        self.source = source
        self.refs: list[ActorRef] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-pusher")
        self.group: WeightGroup | None = None
        self.group_id = ""
        self._store: Any = None
        self._verified_once = False
        self._base: dict[str, torch.Tensor] | None = None  # disk_delta: the engines' current version
        self._base_version = -1
        self._distributed = DistributedPush(config.host, config.backend, config.timeout_s, self._on_thread)
        self._probe_reference = ProbeReference(config.model_dir)

    async def on_start(self) -> None:
        self.refs = [await self.system.lookup(name, timeout_s=self.config.timeout_s) for name in self.engine_names]

    async def on_stop(self) -> None:
        await self._close_group()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def on_failure(self, failure: Any) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _ask_all(self, msg: Message) -> list[Any]:
        """Every engine's reply, in `self.refs` order. An engine found dead is forgotten (the push goes
        on with the others; the refill scheduler hears of it from the controller); any other failure raises."""
        results = await asyncio.gather(*(ref.ask(msg, timeout_s=self.config.timeout_s) for ref in self.refs),
                                       return_exceptions=True)
        dead = [ref.name for ref, r in zip(self.refs, results) if isinstance(r, ActorDeadError)]
        for error in results:
            if isinstance(error, BaseException) and not isinstance(error, ActorDeadError):
                raise error
        if dead:
            log.warning("engines %s are dead: pushing to the others", ", ".join(dead))
            results = [r for ref, r in zip(self.refs, results) if ref.name not in dead]
            await self._forget(dead)
            if not self.refs:
                raise _no_engine_left(dead[0])
        return list(results)

    @handler
    async def join_engine(self, msg: JoinEngine) -> None:
        if msg.name in self.engine_names:
            return
        self.refs.append(await self.system.lookup(msg.name, timeout_s=self.config.timeout_s))
        self.engine_names.append(msg.name)
        await self._close_group()  # the next broadcast forms a group with the newcomer in it

    @handler
    async def forget_engine(self, msg: ForgetEngine) -> None:
        """Stop pushing to an engine that died (the controller saw it go)."""
        await self._forget([msg.name])

    async def _forget(self, names: list[str]) -> None:
        """Push no more to these engines. The broadcast group is closed: one with a gone member would
        hang, and the next push forms a new one with the rest."""
        if not names:
            return
        keep = [i for i, name in enumerate(self.engine_names) if name not in names]
        self.engine_names = [self.engine_names[i] for i in keep]
        self.refs = [self.refs[i] for i in keep]
        await self._close_group()

    # ----- one push -----

    @handler
    async def push(self, msg: PushWeights) -> PushReport:
        """Push a version to every engine (module docstring). With no engine left (all dead, before
        or during the push) nothing is pushed, which is no error: an engine that comes back gets
        the current version from a pusher of its own before it joins this one (`Fleet.admit`)."""
        try:
            return await self._push(msg) if self.refs else self._nothing_pushed(msg.version)
        except ActorDeadError as e:
            if self.refs or e.cause.type != NO_ENGINE_LEFT:
                raise
            log.warning("every engine died during the push of version %d: nothing left to push to", msg.version)
            return self._nothing_pushed(msg.version)

    def _nothing_pushed(self, version: int) -> PushReport:
        return PushReport(version=version, transport=self.config.transport, seconds=0.0, num_bytes=0,
                          bytes_per_s=0.0, verified=False, engines=[])

    async def _push(self, msg: PushWeights) -> PushReport:
        cfg = self.config
        converted = await self._on_thread(self._load, msg.manifest)
        states = await self._ask_all(EngineStatus())
        for state in states:  # before pausing anything; each engine checks again when the update begins
            # (an engine whose weights are torn or released may get its own version again)
            if state.version > msg.version or (state.version == msg.version and state.weights_error is None):
                raise StaleVersionError(f"weight version {msg.version} is not newer than the engine's {state.version} "
                                        f"({state.name}); the update is rejected (push a newer version)")
        kinds = {(s.dtype, s.weight_format) for s in states}
        if len(kinds) != 1:
            raise ValueError(f"the engines hold different dtypes or weight formats ({', '.join(sorted(map(str, kinds)))})"
                             "; one pusher per kind")
        dtype_name, weight_format = kinds.pop()
        cast = await self._on_thread(engine_weights, converted, DTYPES[dtype_name], weight_format)
        verify = cfg.verify == "always" or (cfg.verify == "first" and not self._verified_once)
        if verify and not self._verified_once:
            await self._ask_all(RandomFill(seed=cfg.verify_seed))
        expected = await self._on_thread(checksums, cast) if verify else None
        probe = None
        if verify and cfg.transport == "distributed":  # before pausing: the engines keep generating meanwhile
            probe = await self._on_thread(self._probe_expected, cast)
        start = time.perf_counter()
        before = list(self.engine_names)
        try:
            await self._attempt(msg.version, converted, cast, expected, probe)
        except Exception:
            # An engine that died mid-push (its node cut off or killed) breaks a broadcast for all:
            # find the dead (some may have been dropped on the way already), forget them, and push
            # once more to the rest. Anything else is raised.
            await self._find_dead()
            dead = [name for name in before if name not in self.engine_names]
            if not dead:
                raise
            if not self.refs:
                raise _no_engine_left(dead[0]) from None
            log.warning("engines %s died during the push of version %d: pushing again to %s", ", ".join(dead),
                        msg.version, ", ".join(self.engine_names))
            await self._attempt(msg.version, converted, cast, expected, probe)
        seconds = time.perf_counter() - start
        self._verified_once = self._verified_once or verify
        num_bytes = sum(t.numel() * t.element_size() for t in cast.values())
        return PushReport(version=msg.version, transport=cfg.transport, seconds=seconds, num_bytes=num_bytes,
                          bytes_per_s=num_bytes / max(seconds, 1e-9), verified=verify,
                          engines=await self._ask_all(EngineStatus()))

    async def _attempt(self, version: int, converted: dict[str, torch.Tensor], cast: dict[str, torch.Tensor],
                       expected: dict[str, str] | None, probe: Probe | None = None) -> None:
        """Pause the engines, move the weights, commit; on failure each engine aborts the update."""
        cfg = self.config
        if cfg.pause_mode != "none":
            await self._ask_all(PauseEngine(mode=cfg.pause_mode))
        try:
            await self._move(version, converted, cast, expected, probe)
        except BaseException as e:
            await asyncio.gather(*(ref.ask(AbortUpdate(reason=f"the pusher failed: {type(e).__name__}: {e}"),
                                           timeout_s=cfg.timeout_s) for ref in self.refs), return_exceptions=True)
            raise
        finally:
            if cfg.pause_mode != "none":
                await asyncio.gather(*(ref.ask(ResumeEngine(), timeout_s=cfg.timeout_s) for ref in self.refs),
                                     return_exceptions=True)

    async def _find_dead(self) -> list[str]:
        """Forget (and name) the engines that no longer answer: dead, or silent past the runtime's
        heartbeat timeout (a node cut off). The group they were in is closed."""
        wait_s = self.system.config.heartbeat_timeout_s + 5.0
        results = await asyncio.gather(*(ref.ask(EngineStatus(), timeout_s=wait_s) for ref in self.refs),
                                       return_exceptions=True)
        dead = [ref.name for ref, r in zip(self.refs, results) if isinstance(r, (ActorDeadError, AskTimeoutError))]
        await self._forget(dead)
        return dead

    def _load(self, manifest: WeightManifest | None) -> dict[str, torch.Tensor]:
        if manifest is not None:
            from safetensors.torch import load_file

            named: dict[str, torch.Tensor] = {}
            for bucket in manifest.buckets:
                named.update(load_file(bucket.path))
        elif self.source is not None:
            named = dict(self.source())
        else:
            raise ValueError("PushWeights without a manifest needs a pusher built with an in-process source")
        return convert(self.config.family, named)

    async def _move(self, version: int, converted: dict[str, torch.Tensor], cast: dict[str, torch.Tensor],
                    expected: dict[str, str] | None, probe: Probe | None = None) -> None:
        transport = self.config.transport
        if transport == "colocated":  # as converted (the engine casts, or takes them as they are), quantized ones cast
            handed = converted if cast.keys() == converted.keys() else cast
            for name in self.engine_names:
                await colocated.handoff(name, handed, version, expected)
            return
        if transport == "disk_delta":
            await self._push_delta(version, cast, expected)
            return
        if transport == "disk":
            await self._push_file(version, cast, expected)
            return
        states = await self._ask_all(BeginUpdate(version=version, lease_s=self.config.lease_s))
        buckets = split_buckets(cast, self.config.bucket_bytes)
        if transport == "shm":
            segments = [s.target_segment for s in states]
            await self._on_thread(_write_segments, segments, buckets)
        elif transport == "rdma":
            for ref in self.refs:
                await self._rdma_write(ref, buckets)
        elif transport == "stream":
            await self._stream(buckets)
        elif transport == "distributed":  # the servers' probe verifies (checksums need the bytes there)
            await self._distributed.push(self.refs, buckets, probe)
            await self._ask_all(CommitUpdate())
            return
        else:
            await self._broadcast(buckets)
        await self._ask_all(CommitUpdate(checksums=expected))

    # ----- stream -----

    async def _stream(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Every engine fetches the version from a CURVE-authenticated socket of this actor."""
        from miles_async.actors.engine import ReceiveStream
        from miles_async.transport.stream import StreamServer

        cfg = self.config
        server = StreamServer(cfg.host, self.system.curve_keys, buckets)
        serving = asyncio.ensure_future(self._on_thread(server.serve, len(self.refs), cfg.timeout_s))
        try:
            layout_json = layout_to_json(layout_of(buckets))
            results = await asyncio.gather(*(ref.ask(ReceiveStream(address=server.address, layout_json=layout_json,
                                                                   timeout_s=cfg.timeout_s), timeout_s=cfg.timeout_s)
                                             for ref in self.refs), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:  # an engine declared lost is forgotten (see _broadcast); the push is then redone
                await self._forget([ref.name for ref, r in zip(self.refs, results) if isinstance(r, ActorDeadError)])
                raise errors[0]
        finally:
            server.stop()
            await asyncio.gather(serving, return_exceptions=True)
            server.close()

    # ----- broadcast -----

    async def _broadcast(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        cfg = self.config
        world_size = len(self.refs) + 1
        if self.group is None:
            self._store = await self._on_thread(WeightGroup.open_store, cfg.host, world_size, cfg.timeout_s)
            self.group_id = uuid.uuid4().hex
        layout_json = layout_to_json(layout_of(buckets))
        receives = [ref.ask_future(ReceiveBroadcast(
            host=cfg.host, port=self._store.port, rank=rank, world_size=world_size, group_id=self.group_id,
            layout_json=layout_json, backend=cfg.backend, timeout_s=cfg.timeout_s), timeout_s=cfg.timeout_s)
            for rank, ref in enumerate(self.refs, start=1)]
        try:
            if self.group is None:
                self.group = await self._on_thread(functools.partial(
                    WeightGroup.join, cfg.host, self._store.port, 0, world_size, backend=cfg.backend, local_host=cfg.host,
                    timeout_s=cfg.timeout_s, store=self._store))
            device = "cuda" if cfg.backend == "nccl" else "cpu"  # NCCL moves device memory only
            await self._on_thread(functools.partial(send_buckets, buckets, self.group, device=device))
        except BaseException:
            await self._close_group()
            raise
        finally:
            results = await asyncio.gather(*receives, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._close_group()
            # An engine declared lost while the broadcast ran (its node went silent past the
            # heartbeat timeout) is forgotten even if it answers again later: the controller has
            # forgotten it too, and a node that comes back is admitted afresh.
            await self._forget([ref.name for ref, r in zip(self.refs, results) if isinstance(r, ActorDeadError)])
            raise errors[0]

    def _probe_expected(self, cast: dict[str, torch.Tensor]) -> Probe:
        expected = self._probe_reference.logprobs(cast)  # loads the model and draws the ids at first use
        return list(self._probe_reference.ids), expected

    async def _close_group(self) -> None:
        await self._distributed.close()
        if self.group is not None:
            group, self.group = self.group, None
            await self._on_thread(group.close)
        self._store = None

    # ----- rdma -----

    async def _rdma_write(self, ref: ActorRef, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Queue pairs exchanged through actor messages, then one-sided writes into the engine's target.

        A fresh pair per update: the engine's target alternates between its two buffers and a
        queue pair connects to one peer. Registering memory per update costs a little time; an
        engine that kept both buffers registered would save it.
        """
        from miles_async.actors.engine import ConnectRdma
        from miles_async.transport.rdma import EndpointInfo, RdmaPusherSide
        from miles_async.transport.rdma_plan import plan_writes

        slot_bytes = max(sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets)
        side = await self._on_thread(RdmaPusherSide, slot_bytes)
        try:
            target = await ref.ask(ConnectRdma(pusher=side.info()), timeout_s=self.config.timeout_s)
            await self._on_thread(side.connect, msgspec.convert(target.endpoint, EndpointInfo))
            sizes = [[(name, t.numel() * t.element_size()) for name, t in bucket] for bucket in buckets]
            plan = plan_writes(sizes, target.tensors)
            await self._on_thread(functools.partial(side.write, plan, buckets, timeout_s=self.config.timeout_s))
        finally:
            await self._on_thread(side.close)

    # ----- disk -----

    async def _push_file(self, version: int, cast: dict[str, torch.Tensor], expected: dict[str, str] | None) -> None:
        """The whole version as a folder every engine loads (`full_v<version>/model.safetensors`)."""
        cfg = self.config
        root = Path(cfg.delta_dir)
        path = root / f"full_v{version:08d}" / "model.safetensors"
        await self._on_thread(_save_file, cast, path)
        await self._ask_all(BeginUpdate(version=version, lease_s=cfg.lease_s))
        await self._ask_all(LoadWeightsFile(path=str(path)))
        await self._ask_all(CommitUpdate(checksums=expected))
        await self._on_thread(_prune, root, cfg.keep_deltas)

    # ----- disk delta -----

    async def _push_delta(self, version: int, cast: dict[str, torch.Tensor], expected: dict[str, str] | None) -> None:
        from miles_async.transport.disk_delta import write_delta

        cfg = self.config
        root = Path(cfg.delta_dir)
        states = await self._ask_all(EngineStatus())
        fits = [self._base is not None and s.version == self._base_version for s in states]
        if any(fits):
            stats = await self._on_thread(write_delta, root, self._base, cast, self._base_version, version)
            results = await asyncio.gather(*(ref.ask(ApplyDelta(folder=str(stats.folder)), timeout_s=cfg.timeout_s)
                                             for ref, fit in zip(self.refs, fits) if fit), return_exceptions=True)
            applied = iter(results)
            fits = [fit and not isinstance(next(applied), BaseException) for fit in fits]
        if not all(fits):  # the whole version as one file, for engines the delta does not fit
            path = root / f"full_v{version:08d}.safetensors"
            await self._on_thread(_save_file, cast, path)
            for ref in (ref for ref, fit in zip(self.refs, fits) if not fit):
                await ref.ask(BeginUpdate(version=version, lease_s=cfg.lease_s), timeout_s=cfg.timeout_s)
                await ref.ask(LoadWeightsFile(path=str(path)), timeout_s=cfg.timeout_s)
                await ref.ask(CommitUpdate(checksums=expected), timeout_s=cfg.timeout_s)
        if expected is not None:  # a delta checks the tensors it holds; this catches one it left out
            for ref in (ref for ref, fit in zip(self.refs, fits) if fit):
                bad = compare(expected, await ref.ask(GetChecksums(), timeout_s=cfg.timeout_s))
                if bad:
                    raise TransportError(f"engine {ref.name}: verification failed after the delta to version "
                                         f"{version}: {len(bad)} tensor(s) differ, e.g. {', '.join(bad[:4])}")
        self._base, self._base_version = cast, version
        await self._on_thread(_prune, root, cfg.keep_deltas)


def _no_engine_left(name: str) -> ActorDeadError:
    return ActorDeadError(name, Failure(type=NO_ENGINE_LEFT, message="every engine is dead"))


def engine_weights(named: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   weight_format: str = "none") -> dict[str, torch.Tensor]:
    """The weights as the engines hold them: in their dtype, and with a weight format the
    projections quantized (from the trainer's precision, once for every engine) into the format's
    tensors, which keep their own dtypes."""
    if weight_format == "none":
        return {name: t.detach().to(dtype).contiguous() for name, t in named.items()}
    out = quant.quantize_named({n: t.detach() for n, t in named.items()}, weight_format, is_projection)
    return {name: t.contiguous() if name not in named else t.to(dtype).contiguous() for name, t in out.items()}


def _write_segments(segments: list[str | None], buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    from miles_async.transport.shm import SharedWeights

    for name in segments:
        if name is None:
            raise ValueError("an engine has no shared segment: start it with EngineConfig(shared_weights=True) "
                             "to use the shm transport")
        try:
            handle = SharedWeights.attach(name)
        except TransportError as e:  # its engine died and took the segment along: the commit will tell
            log.warning("%s", e)
            continue
        try:
            handle.write(item for bucket in buckets for item in bucket)
        finally:
            handle.close()


def _save_file(named: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    save_file(dict(named), str(tmp))
    tmp.rename(path)


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` pushed versions (delta folders and full files) under root."""
    entries = sorted((p for p in root.iterdir() if p.name.startswith(("delta_", "full_v"))),
                     key=lambda p: p.stat().st_mtime)
    for path in entries[:-keep] if keep > 0 else entries:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
