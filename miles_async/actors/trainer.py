"""`TrainerRank`: one trainer rank as an actor, in its own process, joined to its peers by torch.distributed.

    batch ──TrainerGroup.train: plan──TrainStep (rank r's share: metadata + BlobRefs)──► TrainerRank r
                                                                                        │ reads its share's
                                        data plane (the rollout worker's shared memory) ◄┘ arrays (zero copy
                                                                                        │ on one node)
                                                  StepMetrics (new weight version) ◄────┘
    ExportWeights ──► <weights_dir>/v<version>/bucket_<i>.safetensors ──► weight pusher

Consumes: `TrainStep` (this rank's share of a batch, planned by `TrainerGroup.train` with
`packing.plan_step`: the samples' token arrays stay in the data plane until the rank reads
them), `EvalLoss` (a held-out SFT loss, no update), `ExportWeights`, `SaveCheckpoint`,
`LoadCheckpoint`. Every one of them is a collective, so
the caller sends one to every rank (`TrainerGroup` does) and each rank's reply is the same.
Produces: metrics and a weight version per step; full weights as safetensors files.

Why files for the weights: tensors never ride in messages, and gathering a full tensor from
FSDP2 shards is a collective every rank must join, so `ExportWeights` gathers the parameters one
at a time on every rank and rank 0 writes them bucket by bucket (at most one bucket of full tensors
held at a time); the reply lists each bucket's path and names. The pusher reads bucket i from its
path (safetensors is mmap-friendly; point `weights_dir` at /dev/shm for a same-node shared-memory
hand-off), so reading costs no extra round trip to the ranks.

Threads: all torch work runs on one worker thread per rank, so the actor's event loop keeps
answering heartbeats during a long step and torch.distributed sees every collective from the same
thread, in the same order on every rank (the actor handles one message at a time).

Try it: `TrainerGroup.spawn(system, TrainerConfig(model_dir=...), world_size=2)` in a script run
under `miles_async.runtime.run`; see tests/dist/test_trainer_ranks.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from miles_async.runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Failure,
    Message,
    RestartPolicy,
    handler,
)
from miles_async.runtime.messages import BlobRef
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import RankEnv, bind_to, free_port, init_distributed
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import StepMetrics, Trainer, WeightBucket
from miles_async.trajectory import Trajectory, decode_data

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("miles_async.actors.trainer")
STOP_TIMEOUT_S = 10.0
CHECKPOINT_STOP_TIMEOUT_S = 120.0  # a background save finishing before the rank stops


class CheckpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the finished folder (for a background save: where it will be once written)
    step: int
    weight_version: int
    data_cursor: int


class WeightManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The full weights of one version: read each bucket's safetensors file at `path`."""

    weight_version: int
    folder: str
    buckets: list[WeightBucket]


# -- messages -------------------------------------------------------------------------------


class TrainStep(Message[StepMetrics], frozen=True):
    """One optimizer step: this rank's share of a batch (`packing.plan_step`); `data_cursor` is
    saved with the next checkpoint."""

    samples: list[Trajectory]  # the share; their `data` in the data plane (or inline)
    advantages: list[float]  # one per sample
    num_micro_batches: int  # every rank runs this many (the most any rank has)
    denominator: float  # the whole batch's aggregation denominator
    data_cursor: int = -1  # -1 leaves the cursor as it is
    objective: str = ""  # "" = the config's; "sft" for warm-start steps before RL
    lr: float = 0.0  # 0 = the config's


class EvalLoss(Message[float], frozen=True):
    """The SFT loss of this rank's share of a batch at the current weights, no update (a
    collective like `TrainStep`; every rank replies the whole batch's loss)."""

    samples: list[Trajectory]
    num_micro_batches: int
    denominator: float


class ExportWeights(Message[WeightManifest], frozen=True):
    """Write the current full weights as buckets; `folder` "" means <weights_dir>/v<version>.
    With LoRA: the adapters alone, or with `merged` the model with its adapters merged (a plain
    Hugging Face model's weights)."""

    folder: str = ""
    merged: bool = False


class SaveCheckpoint(Message[CheckpointInfo], frozen=True):
    """Save a checkpoint (a collective: every rank). `background`: reply once the state is copied
    and write it to disk while the rank goes on (one write at a time: the next save, a load or the
    stop waits for it). `files` (name -> bytes) go into the folder with it (rank 0's); `keep` > 0
    prunes to the newest `keep` checkpoints."""

    background: bool = False
    files: dict[str, bytes] = {}
    keep: int = 0


class LoadCheckpoint(Message[CheckpointInfo], frozen=True):
    """Load the checkpoint at `path` ("" = the latest under the config's checkpoint_dir)."""

    path: str = ""


# -- the actor ------------------------------------------------------------------------------


class TrainerRank(Actor):
    """One rank: joins the process group in `on_start`, then serves collectives (module docstring)."""

    trainer: Trainer  # built in on_start, once the process group is joined

    def __init__(self, config: TrainerConfig, rank: int, world_size: int, master_addr: str,
                 master_port: int, local_rank: int | None = None, host: str = "") -> None:
        self.config = config
        self.host = host  # this rank's node address (ranks on several nodes): its gloo/NCCL interface
        self.env = RankEnv(master_addr, master_port, rank, world_size, rank if local_rank is None else local_rank)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer{rank}")
        # Background checkpoint writes: a thread and a process group of their own (checkpoint.py).
        self.writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckpt{rank}")
        self.writing: asyncio.Future[Path] | None = None
        self.checkpoint_group: Any = None  # made in _build, on every rank

    async def _on_torch_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _build(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.env.export()
        if self.host:
            bind_to(self.host)
        device = init_distributed(self.config.backend, self.config.process_group_timeout_s)
        self._check_shared_folder()
        self.trainer = Trainer(self.config, device)
        self.checkpoint_group = dist.new_group(backend="gloo")

    def _check_shared_folder(self) -> None:
        """Every rank reads the controller's token file (`TrainerConfig.shared_file`), and all of them
        fail together, naming the ranks that do not see it, if any does not (a collective)."""
        cfg = self.config
        if not cfg.shared_file:
            return
        try:
            ok = Path(cfg.shared_file).read_text() == cfg.shared_token
        except OSError:
            ok = False
        seen: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(seen, (ok, self.host or self.env.master_addr))
        blind = [f"{rank} (on {host})" for rank, (rank_ok, host) in enumerate(seen) if not rank_ok]
        if blind:
            raise RuntimeError(
                f"trainer rank(s) {', '.join(blind)} do not see the run folder of node 0 ({cfg.shared_file} is "
                "missing or another run's): trainer ranks off node 0 write checkpoints and weight exports there, "
                "so put the run folder (--out) on a filesystem every trainer node mounts at the same path, or "
                "place the trainer on node 0")

    async def on_start(self) -> None:
        await self._on_torch_thread(self._build)

    async def on_stop(self) -> None:
        # Bounded: behind a collective whose peer died, the torch thread is stuck until the
        # process group's timeout; the stop must not wait for it (the process exits regardless).
        if self.writing is not None:  # a background save goes to disk first (or stays a .tmp- folder)
            try:
                await asyncio.wait_for(self._written(), CHECKPOINT_STOP_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the stop goes on; the previous checkpoint stands
                log.warning("rank %d: the checkpoint being written did not finish: %s", self.env.rank,
                            type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e)
        try:
            await asyncio.wait_for(self._on_torch_thread(self._leave), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("rank %d: leaving the process group took over %gs; exiting without it",
                        self.env.rank, STOP_TIMEOUT_S)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.writer.shutdown(wait=False, cancel_futures=True)

    def _leave(self) -> None:
        """Leave the process group, then free the model, optimizer and FSDP state while the
        interpreter is alive: left to its exit, their destruction can take down a gloo thread
        still joinable ("terminate called without an active exception", SIGABRT; seen here in
        about one exit in six under load)."""
        _destroy_process_group()
        self.__dict__.pop("trainer", None)
        gc.collect()

    async def on_failure(self, failure: Failure) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    @handler
    async def train_step(self, msg: TrainStep) -> StepMetrics:
        samples = [await self._resolve(s) for s in msg.samples]
        return await self._on_torch_thread(functools.partial(
            self.trainer.train_step, samples, msg.advantages, num_micro_batches=msg.num_micro_batches,
            denominator=msg.denominator, data_cursor=None if msg.data_cursor < 0 else msg.data_cursor,
            objective=msg.objective or None, lr=msg.lr or None))

    @handler
    async def eval_loss(self, msg: EvalLoss) -> float:
        samples = [await self._resolve(s) for s in msg.samples]
        return await self._on_torch_thread(functools.partial(
            self.trainer.eval_loss, samples, num_micro_batches=msg.num_micro_batches, denominator=msg.denominator))

    async def _resolve(self, sample: Trajectory) -> Trajectory:
        """`sample` with its token arrays inline, read from the data plane that holds them."""
        if not isinstance(sample.data, BlobRef):
            return sample
        view = await self.system.dataplane.read(sample.data)
        try:
            return msgspec.structs.replace(sample, data=decode_data(view))
        finally:
            view.release()

    @handler
    async def export_weights(self, msg: ExportWeights) -> WeightManifest:
        version = self.trainer.weight_version
        folder = msg.folder or str(Path(self.weights_dir()) / f"v{version:08d}")
        export = functools.partial(self.trainer.export_weights, merged=msg.merged)
        buckets = await self._on_torch_thread(export, folder, self.config.weight_bucket_bytes)
        return WeightManifest(weight_version=version, folder=folder, buckets=buckets)

    def weights_dir(self) -> str:
        """The config's `weights_dir`, else a temporary folder named after the run's MASTER_PORT
        (the same on every rank, different between runs on one node)."""
        if self.config.weights_dir:
            return self.config.weights_dir
        return str(Path(tempfile.gettempdir()) / f"miles-async-weights-{self.env.master_port}")

    def _after_write(self, tmp_folder: Path) -> None:
        """Runs between writing a checkpoint's parts and renaming it (tests fail a save here)."""

    @handler
    async def save_checkpoint(self, msg: SaveCheckpoint) -> CheckpointInfo:
        root = self._checkpoint_dir()
        await self._written()
        staged, meta = await self._on_torch_thread(self.trainer.stage_checkpoint)
        write = functools.partial(checkpoint.write, root, staged, meta, after_write=self._after_write,
                                  files=msg.files if self.env.rank == 0 else None, keep=msg.keep,
                                  process_group=self.checkpoint_group)
        self.writing = asyncio.wrap_future(self.writer.submit(write))
        path = checkpoint.step_folder(root, int(meta["step"]))
        if not msg.background:
            path = await self._written() or path
        return self._info(path)

    async def _written(self) -> Path | None:
        """Wait for the background save in flight, if any (its error raised here, once)."""
        writing, self.writing = self.writing, None
        return None if writing is None else await writing

    @handler
    async def load_checkpoint(self, msg: LoadCheckpoint) -> CheckpointInfo:
        await self._written()
        path = Path(msg.path) if msg.path else checkpoint.latest(self._checkpoint_dir())
        if path is None:
            raise ValueError(f"no finished checkpoint under {self._checkpoint_dir()}")
        await self._on_torch_thread(self.trainer.load_checkpoint, path)
        return self._info(path)

    def _checkpoint_dir(self) -> str:
        if not self.config.checkpoint_dir:
            raise ValueError("TrainerConfig.checkpoint_dir is empty; set it to save or load checkpoints")
        return self.config.checkpoint_dir

    def _info(self, path: Path) -> CheckpointInfo:
        t = self.trainer
        return CheckpointInfo(path=str(path), step=t.step, weight_version=t.weight_version,
                              data_cursor=t.data_cursor)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the spawning side ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one rank runs: its node's spawner (None: the spawning system's own node), its index
    among the ranks of that node (LOCAL_RANK: its GPU there), and the node's address ("" on one node)."""

    spawner: Any = None
    local_rank: int = 0
    host: str = ""


DEATH_GRACE_S = 2.0  # how long a rank's failure waits for another rank's death to be known


async def every_rank(asks: list[Awaitable[R]]) -> list[R]:
    """Every rank's reply to one collective, in rank order. When a rank fails, the root cause is
    raised: a rank whose process died (`ActorDeadError`), if one is known to within DEATH_GRACE_S,
    rather than the error its death caused in a peer's collective first (gloo's "Connection reset
    by peer"), which would name the wrong rank."""
    tasks = [asyncio.ensure_future(ask) for ask in asks]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if all(task.exception() is None for task in done) and not pending:
            return [task.result() for task in tasks]
        if pending:
            await asyncio.wait(pending, timeout=DEATH_GRACE_S)
        errors = [error for error in (task.exception() for task in tasks if task.done()) if error is not None]
        dead = [error for error in errors if isinstance(error, ActorDeadError)]
        raise (dead or errors)[0]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


class TrainerGroup:
    """The ranks of one trainer, spawned together; `ask_all` sends a collective to every rank."""

    def __init__(self, refs: list[ActorRef], config: TrainerConfig) -> None:
        self.refs = refs
        self.config = config

    @classmethod
    async def spawn(cls, system: ActorSystem, config: TrainerConfig, world_size: int | None = None, *,
                    name: str = "trainer", rank_cls: type[TrainerRank] = TrainerRank,
                    master_addr: str = "127.0.0.1", master_port: int | None = None,
                    restart: RestartPolicy | None = None, spawner: Any = None,
                    placement: list[RankPlacement] | None = None) -> TrainerGroup:
        """Spawn `world_size` ranks (default: `config.world_size`), each in its own process,
        named `<name>-<rank>`.

        They are spawned concurrently: each rank's `on_start` waits in the rendezvous for the
        others. Raises `SpawnError` if any rank fails to start. `spawner` (an object with the `spawn`
        of `actors.controller.Spawner`) starts every rank on another node; `master_addr` is then
        that node's. `placement` (one per rank) spreads them over nodes instead: each rank started
        by its own spawner (None: this system), with its LOCAL_RANK and its node's address;
        `master_addr` is rank 0's node's.
        """
        world_size = config.world_size if world_size is None else world_size
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if placement is None:
            placement = [RankPlacement(spawner=spawner, local_rank=rank) for rank in range(world_size)]
        if len(placement) != world_size:
            raise ValueError(f"placement has {len(placement)} entries for {world_size} ranks")
        port = master_port or free_port(master_addr)

        def start(rank: int, where: RankPlacement) -> Any:
            args = (config, rank, world_size, master_addr, port, where.local_rank, where.host)
            if where.spawner is None:
                return system.spawn(rank_cls, f"{name}-{rank}", process=True, restart=restart, args=args)
            return where.spawner.spawn(rank_cls, f"{name}-{rank}", restart=restart, args=args)

        results = await asyncio.gather(*(start(rank, where) for rank, where in enumerate(placement)),
                                       return_exceptions=True)
        refs = [r for r in results if isinstance(r, ActorRef)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(system.stop(ref) for ref in refs), return_exceptions=True)
            raise errors[0]
        return cls(refs, config)

    async def train(self, samples: list[Trajectory], *, objective: str = "", lr: float = 0.0, data_cursor: int = -1,
                    timeout_s: float) -> StepMetrics:
        """One optimizer step on `samples` (their `data` in the data plane, or inline): plan it
        from their metadata and send each rank only its share. Advantages are group-relative
        (`config.advantage`) for RL, none for SFT. Returns the step's metrics (the same on every rank)."""
        config = self.config
        rl = (objective or config.objective) == "rl"
        plan = plan_step(samples, len(self.refs), config.micro_batch_tokens, config.policy_loss.aggregation,
                         config.advantage if rl else None)
        steps = [TrainStep(samples=[samples[i] for i in indices], advantages=[plan.advantages[i] for i in indices],
                           num_micro_batches=plan.num_micro_batches, denominator=plan.denominator,
                           data_cursor=data_cursor, objective=objective, lr=lr) for indices in plan.per_rank]
        replies = await every_rank([ref.ask(step, timeout_s=timeout_s) for ref, step in zip(self.refs, steps)])
        return replies[0]

    async def eval_loss(self, samples: list[Trajectory], *, timeout_s: float) -> float:
        """The SFT loss of `samples` at the current weights (no update), aggregated as a step's."""
        config = self.config
        plan = plan_step(samples, len(self.refs), config.micro_batch_tokens, config.policy_loss.aggregation, None)
        asks: list[Awaitable[float]] = [
            ref.ask(EvalLoss(samples=[samples[i] for i in indices], num_micro_batches=plan.num_micro_batches,
                             denominator=plan.denominator), timeout_s=timeout_s)
            for ref, indices in zip(self.refs, plan.per_rank)]
        return (await every_rank(asks))[0]

    async def ask_all(self, msg: Message[R], timeout_s: float) -> list[R]:
        """Send `msg` to every rank; the replies in rank order (a failure of any rank raises, see `every_rank`)."""
        return await every_rank([ref.ask(msg, timeout_s=timeout_s) for ref in self.refs])

    async def ask(self, msg: Message[R], timeout_s: float) -> R:
        """`ask_all`, returning rank 0's reply (every rank's is the same for these collectives)."""
        return (await self.ask_all(msg, timeout_s))[0]

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop every rank (each leaves the process group in `on_stop`)."""
        await asyncio.gather(*(ref.stop(timeout_s=timeout_s) for ref in self.refs))
