"""The run's processes: where each goes (`[placement]`), starting them, and nodes that join later.

    Fleet.start ──► engines (a process each, on their nodes), trainer ranks (TrainerGroup), pushers,
                    a distillation teacher's engine (node 0) when `[teacher]` names one
    Fleet.start_sessions ──► SessionHost (agent runs)
    Fleet.start_rollout ──► rollout workers (here), the teacher's scorer (here), RefillScheduler and
                            Buffer (here, or a process on their node), engines announced to the scheduler
    Fleet.admit ──► a node that joined: its engines, the current weights, then the scheduler
    Fleet.respawn, Fleet.join ──► an engine whose process died, started again under its name (by
                            `liveness.Liveness`, under `[rollout.restart]`), joins the same way

A one-node run (`miles-async run`) is node 0 on 127.0.0.1 with a `LocalSpawner`; a multi-node
run (`miles-async launch`) hands the controller one `Node` per launcher, each with a spawner that
starts processes there (`miles_async.launch.agent.RemoteSpawner`). The controller, the rollout
workers and the weight pushers stay on node 0: they are the run's head.

Try it: `tests/unit/test_placement.py`, `tests/e2e/test_launch.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from miles_async.actors.buffer import Buffer
from miles_async.actors.engine import EngineActor, EngineStatus
from miles_async.actors.external import ExternalEngineActor
from miles_async.actors.rollout import RolloutWorker
from miles_async.actors.scheduler import AddEngine, RefillScheduler, SampleSeen
from miles_async.actors.sessions import AddSessionEngine, SessionHost, SessionsUrl
from miles_async.actors.teacher import TeacherScorer
from miles_async.actors.trainer import RankPlacement, TrainerGroup
from miles_async.actors.weights import JoinEngine, WeightPusher, WeightSyncConfig
from miles_async.engine.backend import ADAPTER_NAME
from miles_async.models.config import ModelConfig
from miles_async.runtime import Actor, ActorRef, ActorSystem, RestartPolicy, handler
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import free_port

if TYPE_CHECKING:
    from miles_async.actors.recipe import RunConfig

log = logging.getLogger("miles_async.actors.fleet")
ASK_S = 600.0
SHARED_FILE = ".run-token"  # in the run folder: what trainer ranks on other nodes must see


class RunSetupError(RuntimeError):
    """The run cannot start as configured and placed (found when its nodes are there, before any
    process starts); the message names the nodes and the fix."""


class Spawner(Protocol):
    """Starts an actor in a new process on one node (`ActorSystem.spawn(..., process=True)` on this
    one; `miles_async.launch.agent.RemoteSpawner` on another), and finds a free port there."""

    async def spawn(self, cls: type, name: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                    restart: RestartPolicy | None = None, env: dict[str, str] | None = None) -> ActorRef: ...

    async def free_port(self) -> int: ...

    async def ensure_folder(self, folder: str | Path) -> int:
        """Make the node hold `folder` (the model's) as the controller's node does; the bytes sent."""
        ...

    async def shares(self, path: str | Path) -> bool:
        """Whether the node sees the file at `path` as the controller's node does (a shared filesystem)."""
        ...


class LocalSpawner:
    """`Spawner` for the controller's own node."""

    def __init__(self, system: ActorSystem, host: str = "127.0.0.1") -> None:
        self.system = system
        self.host = host

    async def spawn(self, cls: type, name: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                    restart: RestartPolicy | None = None, env: dict[str, str] | None = None) -> ActorRef:
        return await self.system.spawn(cls, name, args=args, kwargs=kwargs, process=True, restart=restart, env=env)

    async def free_port(self) -> int:
        return free_port(self.host)

    async def ensure_folder(self, folder: str | Path) -> int:
        return 0  # this node's own files

    async def shares(self, path: str | Path) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Node:
    """One node of the run: its rank, the address its processes bind and are reached at, and how to
    start a process there. A one-node run (`miles-async run`) is node 0 on 127.0.0.1."""

    rank: int
    host: str
    spawner: Spawner
    num_gpus: int = 0  # 0: CPU only (or GPUs left to the processes: a one-node run of CPU engines)


def one_node_gpus(config: RunConfig) -> int:
    """The GPUs node 0 of a one-node run hands out (`Fleet._gpu_env`): this machine's, when its
    embedded engines go on a GPU the run picks (`rollout.engine.device` "cuda" or "auto"), so each
    engine gets one of its own after the trainer ranks'; else 0, every process seeing all GPUs (an
    engine on the CPU, or on the "cuda:N" the recipe names)."""
    if config.rollout.backend != "embedded" or config.rollout.engine.device not in ("cuda", "auto"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, slots=True)
class RunFolder:
    """Where a run keeps its files, and the model it trains."""

    run_dir: Path
    model_dir: Path
    shared_token: str  # written to SHARED_FILE: trainer ranks on other nodes check they see it

    @property
    def family(self) -> str:
        return str(json.loads((self.model_dir / "config.json").read_text())["model_type"])

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        return ModelConfig.from_hf(self.model_dir).moe_shape


class SampleRecorder(Actor):
    """In the controller's process: hands each `SampleSeen` of a scheduler on another node to the
    controller's trace (`on_sample`, as an in-process scheduler calls it)."""

    def __init__(self, on_sample: Any) -> None:
        self.on_sample = on_sample

    @handler
    def seen(self, msg: SampleSeen) -> None:
        self.on_sample(msg.sample, msg.counted)


@dataclass(frozen=True, slots=True)
class EngineHome:
    """Where an engine runs: its node, its environment (its GPU), and how often its node had
    (re)joined when it started (an engine of an earlier admission is replaced, not restarted)."""

    node: int
    env: dict[str, str] | None
    admission: int


@dataclass(slots=True)
class Fleet:
    """The run's processes and how to reach them (module docstring). `config` is the run's
    `actors.recipe.RunConfig`; `api_key` is what the engines' HTTP APIs want (multi-node runs)."""

    config: RunConfig
    folder: RunFolder
    system: ActorSystem
    nodes: dict[int, Node]
    api_key: str | None = None
    engines: list[ActorRef] = field(default_factory=list)
    engine_urls: dict[str, str] = field(default_factory=dict)
    eval_engine: ActorRef | None = None
    teacher: ActorRef | None = None  # distillation: the teacher's engine (miles_async/actors/teacher.py)
    teacher_scorer: ActorRef | None = None
    trainer: TrainerGroup | None = None
    pusher: ActorRef | None = None
    eval_pusher: ActorRef | None = None
    scheduler: ActorRef | None = None
    buffer: ActorRef | None = None
    sessions: ActorRef | None = None
    sessions_url: str = ""
    num_engines_started: int = 0
    gpus_given: dict[int, int] = field(default_factory=dict)  # per node: engines given a GPU so far
    engine_homes: dict[str, EngineHome] = field(default_factory=dict)  # where `respawn` starts each again
    node_admissions: dict[int, int] = field(default_factory=dict)  # per node: how often it (re)joined

    # ----- configs the run derives -----

    def trainer_config(self) -> TrainerConfig:
        """The recipe's `[trainer]` with what the run sets: the model, the run folder's paths, the
        seed and the sampling temperature (the trainer scores the distribution the engine sampled)."""
        cfg, run_dir = self.config, self.folder.run_dir
        temperature = cfg.rollout.sampling.temperature
        return msgspec.structs.replace(
            cfg.trainer, model_dir=str(self.folder.model_dir), seed=cfg.loop.seed,
            checkpoint_dir=str(run_dir / "checkpoints"), weights_dir=str(run_dir / "weights"),
            shared_file=str(run_dir / SHARED_FILE), shared_token=self.folder.shared_token,
            temperature=temperature if temperature > 0 else 1.0)

    def engine_config(self) -> Any:
        """The recipe's `[rollout.engine]`, its weights in shared memory for the shm transport, the
        trainer's adapters (LoRA) for the pushes to write."""
        return msgspec.structs.replace(self.config.rollout.engine, shared_weights=self.transport == "shm",
                                       lora=self.config.trainer.lora)

    def sync_config(self) -> WeightSyncConfig:
        """The recipe's `[weights]` with what the run sets: the model family, node 0's address, the
        pause mode of `rollout.partial`, the run folder's delta folder, the model folder (the
        distributed transport's probe) and the transport of "auto" (`transport_for`)."""
        cfg = self.config
        return msgspec.structs.replace(
            cfg.weights, family=self.folder.family, host=self.nodes[0].host,
            pause_mode="in_place" if cfg.rollout.partial == "continue" else "abort",
            delta_dir=str(self.folder.run_dir / "deltas"), transport=self.transport,
            model_dir=str(self.folder.model_dir))

    @property
    def transport(self) -> str:
        return resolve_transport(self.config)

    @property
    def adapter(self) -> str:
        """The LoRA adapter every request to an external engine names (`ADAPTER_NAME`: its pushes
        are the adapters), or "" (no LoRA, an embedded engine, or `rollout.server.lora = "merged"`)."""
        cfg = self.config
        external = cfg.rollout.backend != "embedded" and cfg.rollout.server.lora == "adapter"
        return ADAPTER_NAME if external and cfg.trainer.lora.enabled else ""

    # ----- starting -----

    async def start(self) -> None:
        """Engines (and a dedicated eval engine), trainer ranks and weight pushers; the first failure
        stops the others and is raised."""
        cfg = self.config
        names = [f"engine-{i}" for i in range(cfg.rollout.num_engines)]
        placed = [self.nodes[cfg.placement.engine_node(i)] for i in range(cfg.rollout.num_engines)]
        if cfg.eval.mode == "dedicated":
            names.append("eval-engine")
            placed.append(self.nodes[0])
        self.num_engines_started = cfg.rollout.num_engines
        engine_nodes = list({n.rank: n for n in placed}.values())
        await self._check_network(engine_nodes)
        await asyncio.gather(*(self._give_model(node) for node in engine_nodes))
        ranks = self._trainer_placement()
        master = self.nodes[cfg.placement.trainer_nodes(cfg.trainer.world_size)[0]]
        trainer_spawn = TrainerGroup.spawn(self.system, self.trainer_config(), cfg.trainer.world_size,
                                           master_addr=ranks[0].host or master.host,
                                           master_port=await master.spawner.free_port(), placement=ranks)
        teacher = [self._spawn_teacher()] if cfg.teacher.enabled else []
        *engines, self.trainer = await _all_or_none(*(self._spawn_engine(name, node) for name, node in zip(names, placed)),
                                                    *teacher, trainer_spawn)
        if cfg.teacher.enabled:
            self.teacher = engines.pop()
        if cfg.eval.mode == "dedicated":
            self.eval_engine = engines.pop()
        self.engines = engines
        for ref in engines + ([self.eval_engine] if self.eval_engine else []):
            self.engine_urls[ref.name] = await _engine_url(ref)
        sync = self.sync_config()
        self.pusher = await self.system.spawn(WeightPusher, "pusher", args=([e.name for e in engines], sync))
        if self.eval_engine is not None:  # its own folder: the two pushers write the same versions
            eval_sync = msgspec.structs.replace(sync, delta_dir=str(self.folder.run_dir / "deltas-eval"))
            self.eval_pusher = await self.system.spawn(WeightPusher, "eval-pusher", args=(["eval-engine"], eval_sync))

    async def _spawn_engine(self, name: str, node: Node, env: dict[str, str] | None = None) -> ActorRef:
        """Start engine `name` on `node`: with `env` (a respawn keeps its GPU), else the node's next GPU."""
        rollout = self.config.rollout
        env = env if env is not None else self._gpu_env(node)
        self.engine_homes[name] = EngineHome(node=node.rank, env=env,
                                             admission=self.node_admissions.get(node.rank, 0))
        if rollout.backend != "embedded":  # the actor starts the server (miles_async/actors/external.py)
            return await node.spawner.spawn(
                ExternalEngineActor, name, args=(rollout.backend, str(self.folder.model_dir), rollout.server),
                kwargs={"http_host": node.host, "threads": rollout.engine_threads, "api_key": self.api_key,
                        "log_dir": str(self.folder.run_dir),
                        "lora": self.config.trainer.lora if self.adapter else None}, env=env)
        return await node.spawner.spawn(EngineActor, name, args=(str(self.folder.model_dir), self.engine_config()),
                                        kwargs={"http_host": node.host, "http_port": 0,
                                                "num_threads": self.config.rollout.engine_threads,
                                                "api_key": self.api_key}, env=env)

    async def _spawn_teacher(self) -> ActorRef:
        """The distillation teacher's engine, on node 0 beside the scorer (`[teacher]`): an embedded
        engine scored over its mailbox, or a server of another backend scored over HTTP."""
        teacher, node = self.config.teacher, self.nodes[0]
        folder = str(teacher.folder())
        temperature = self.config.rollout.sampling.temperature
        if temperature != 1.0:
            log.warning("the teacher scores at temperature 1 but the student samples at %g: teacher_kl and the "
                        "distillation signal compare the student's tempered log-probs with the teacher's plain ones",
                        temperature)
        if teacher.backend != "embedded":
            return await node.spawner.spawn(
                ExternalEngineActor, "teacher", args=(teacher.backend, folder, teacher.server),
                kwargs={"http_host": node.host, "threads": teacher.threads, "api_key": self.api_key,
                        "log_dir": str(self.folder.run_dir)}, env=self._gpu_env(node))
        return await node.spawner.spawn(EngineActor, "teacher", args=(folder, teacher.engine),
                                        kwargs={"num_threads": teacher.threads}, env=self._gpu_env(node))

    async def start_teacher_scorer(self) -> str:
        """The teacher's scoring stage, in this process (it reads the workers' arrays); its name."""
        assert self.teacher is not None
        teacher = self.config.teacher
        if teacher.backend == "embedded":
            kwargs: dict[str, Any] = {"engine": self.teacher.name}
        else:
            kwargs = {"url": await _engine_url(self.teacher), "backend": teacher.backend, "api_key": self.api_key}
        self.teacher_scorer = await self.system.spawn(TeacherScorer, "teacher-scorer",
                                                      kwargs=kwargs | {"max_in_flight": teacher.max_in_flight})
        return self.teacher_scorer.name

    def _trainer_placement(self) -> list[RankPlacement]:
        """Each trainer rank's node (spawner, LOCAL_RANK there, address): `placement.trainer`. Ranks
        all on one node keep their process group on loopback (torch.distributed's sockets have no
        authentication: off loopback only when the ranks span nodes)."""
        placed = self.config.placement.trainer_nodes(self.config.trainer.world_size)
        one_node = len(set(placed)) == 1
        ranks: list[RankPlacement] = []
        per_node: dict[int, int] = {}
        for node_rank in placed:
            node = self.nodes[node_rank]
            host = "" if len(self.nodes) == 1 else "127.0.0.1" if one_node else node.host
            ranks.append(RankPlacement(spawner=node.spawner, local_rank=per_node.get(node_rank, 0), host=host))
            per_node[node_rank] = per_node.get(node_rank, 0) + 1
        return ranks

    async def start_sessions(self) -> None:
        """The session server: in this process on loopback (node 0), or a process on its node serving
        that node's address, where it wants the run's API key (and the model folder, for the tokenizer)."""
        node = self.nodes[self.config.placement.sessions]
        urls = [self.engine_urls[e.name] for e in self.engines]
        kwargs: dict[str, Any] = {"engine_api_key": self.api_key, "backend": self.config.rollout.backend,
                                  "adapter": self.adapter}
        if node.rank != 0:
            await self._give_model(node)
            kwargs |= {"host": node.host, "api_key": self.api_key}
        self.sessions = await self._place(node.rank, SessionHost, "sessions", (urls, str(self.folder.model_dir)), kwargs)
        self.sessions_url = await self.sessions.ask(SessionsUrl(), timeout_s=ASK_S)

    async def start_rollout(self, dataset: list[Any], *, version: int, first_prompt: int,
                            on_sample: Any, retry_prompts: list[int] | None = None) -> None:
        """Rollout workers, the scheduler over `dataset` (the task's items) and the buffer; then the
        engines are announced to the scheduler at weight `version`. `on_sample(trajectory, counted)`
        sees every finished sample (through a `SampleRecorder` when the scheduler is elsewhere)."""
        cfg = self.config
        workers = [f"rollout-{i}" for i in range(cfg.rollout.num_workers)]
        kwargs: dict[str, Any] = {"api_key": self.api_key, "backend": cfg.rollout.backend, "adapter": self.adapter}
        if cfg.agent.agent:
            kwargs |= {"agent": cfg.agent, "sessions": "sessions", "session_url": self.sessions_url}
        for name in workers:
            await self.system.spawn(RolloutWorker, name, args=(cfg.task, str(self.folder.model_dir)), kwargs=kwargs)
        staleness = cfg.loop.staleness
        refill = msgspec.structs.replace(cfg.scheduler, batch_groups=cfg.loop.batch_groups, max_staleness=staleness)
        buffer = msgspec.structs.replace(cfg.buffer, max_staleness=staleness)
        scheduler_kwargs: dict[str, Any] = {
            "workers": workers, "buffer": "buffer", "seed": cfg.loop.seed if cfg.rollout.seeded else None,
            "trainer_version": version, "first_prompt": first_prompt, "retry_prompts": retry_prompts or [],
            "routed_experts": self.folder.moe_shape is not None}
        if self.teacher is not None:
            scheduler_kwargs["teacher"] = await self.start_teacher_scorer()
        if cfg.placement.scheduler != 0:  # it reports each finished sample to a recorder here, for the trace
            await self.system.spawn(SampleRecorder, "sample-recorder", args=(on_sample,))
            scheduler_kwargs["sample_sink"] = "sample-recorder"
        else:
            scheduler_kwargs["on_sample"] = on_sample
        self.scheduler = await self._place(cfg.placement.scheduler, RefillScheduler, "scheduler",
                                           (refill, dataset, cfg.rollout.sampling), scheduler_kwargs)
        self.buffer = await self._place(cfg.placement.buffer, Buffer, "buffer", (buffer, "scheduler"), {})
        for ref in self.engines:
            await self.scheduler.tell(self._add_engine(ref.name, version))

    def _add_engine(self, name: str, version: int) -> AddEngine:
        rollout = self.config.rollout
        actor = name if rollout.client == "actor" and rollout.backend == "embedded" else ""
        return AddEngine(name=name, url=self.engine_urls[name], version=version, actor=actor)

    async def _place(self, node_rank: int, cls: type, name: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> ActorRef:
        """A role of `[placement]` (scheduler, buffer, session server): in this process on node 0, a
        process of its own on another node."""
        if node_rank == 0:
            return await self.system.spawn(cls, name, args=args, kwargs=kwargs)
        return await self.nodes[node_rank].spawner.spawn(cls, name, args=args, kwargs=kwargs)

    # ----- nodes -----

    async def _check_network(self, engine_nodes: list[Node]) -> None:
        """What crosses nodes, said before anything starts: a `disk_delta` transport needs the run
        folder shared with the engines' nodes (refused otherwise, naming them), and torch.distributed's
        own connections (trainer ranks on several nodes, `broadcast` to other nodes) have no
        authentication (warned: they belong on a trusted network)."""
        cfg = self.config
        remote = [n for n in engine_nodes if n.rank != 0]
        if self.transport in ("disk", "disk_delta") and remote:
            blind = [n.rank for n in remote if not await n.spawner.shares(self.folder.run_dir / SHARED_FILE)]
            if blind:
                raise RunSetupError(f'weights.transport = "{self.transport}" writes weights into the run folder '
                                    f"({self.folder.run_dir}) for the engines to read, but node(s) {blind} do not see "
                                    'it: put it on a filesystem they mount at the same path, or use "stream" (no '
                                    "shared folder needed)")
        trainer_nodes = set(cfg.placement.trainer_nodes(cfg.trainer.world_size))
        if len(trainer_nodes) > 1 or (self.transport == "broadcast" and remote):
            what = "trainer ranks on several nodes" if len(trainer_nodes) > 1 else "weights by broadcast to other nodes"
            log.warning("%s: their torch.distributed connections (gloo/NCCL and their TCPStore) have no "
                        "authentication, as torchrun's: keep these nodes on a trusted network%s", what,
                        "" if len(trainer_nodes) > 1 else ' (weights.transport = "stream" is authenticated)')

    async def _give_model(self, node: Node) -> None:
        """The model folder on `node` before its engines load it (sent if that node lacks it)."""
        sent = await node.spawner.ensure_folder(self.folder.model_dir)
        if sent:
            log.info("node %d did not hold the model folder %s: sent %.1f MiB", node.rank, self.folder.model_dir,
                     sent / 2**20)

    def _gpu_env(self, node: Node) -> dict[str, str] | None:
        """CUDA_VISIBLE_DEVICES for the next engine on `node`: its GPUs in turn, after those of the
        trainer ranks when they share the node (a rank uses GPU LOCAL_RANK). None without GPUs."""
        if node.num_gpus <= 0:
            return None
        cfg = self.config
        taken = cfg.placement.trainer_nodes(cfg.trainer.world_size).count(node.rank)
        count = self.gpus_given.get(node.rank, 0)
        self.gpus_given[node.rank] = count + 1
        return {"CUDA_VISIBLE_DEVICES": str((taken + count) % node.num_gpus)}

    async def admit(self, node: Node, version: int, push: Any) -> list[ActorRef]:
        """A node that joined the running job (a new one, or one back after it was lost): its engines
        start, under new names, and `join` the run. Call it between steps, with no weight update in flight."""
        self.nodes[node.rank] = node  # its spawner: the agent that answers now (a respawn goes through it)
        self.node_admissions[node.rank] = self.node_admissions.get(node.rank, 0) + 1  # its old engines: replaced
        count = max(1, sum(1 for n in self.config.placement.engines if n == node.rank))
        await self._give_model(node)
        started = []
        for _ in range(count):
            name = f"engine-{self.num_engines_started}"
            self.num_engines_started += 1
            ref = await self._spawn_engine(name, node)
            await self.join(ref, version, push)
            log.warning("node %d joined: %s serves from weight version %d", node.rank, name, version)
            started.append(ref)
        return started

    async def respawn(self, name: str) -> ActorRef:
        """A new process for engine `name`, whose process died: on its node, under its name, with its
        GPU. It loads the model; it serves no rollout until it `join`s the run."""
        home = self.engine_homes[name]
        return await self._spawn_engine(name, self.nodes[home.node], home.env)

    def replaced(self, name: str) -> bool:
        """Whether engine `name`'s node (re)joined since it started: the fresh engines of that
        admission take its place (a node cut off and back has its stale processes stopped)."""
        home = self.engine_homes[name]
        return home.admission < self.node_admissions.get(home.node, 0)

    async def join(self, ref: ActorRef, version: int, push: Any) -> None:
        """An engine started while the run goes on (`admit`, `respawn`) gets weight `version` through a
        pusher of its own (`await push(pusher)`, verified as any push; skipped at version 0, the
        model's own weights), then joins the run's pusher and is announced to the scheduler and the
        session server. Call it between steps, with no weight update in flight."""
        assert self.pusher is not None and self.scheduler is not None
        name = ref.name
        url = self.engine_urls[name] = await _engine_url(ref)
        if version > 0:
            pusher = await self.system.spawn(WeightPusher, f"pusher-{name}", args=([name], self.sync_config()))
            try:
                await push(pusher)
            finally:
                await self.system.stop(pusher)
        await self.pusher.ask(JoinEngine(name=name), timeout_s=ASK_S)
        self.engines.append(ref)
        await self.scheduler.tell(self._add_engine(name, version))
        if self.sessions is not None:  # agents' sessions are routed by the session server
            await self.sessions.ask(AddSessionEngine(url=url), timeout_s=ASK_S)

    async def stop_roles(self) -> None:
        """Stop the scheduler, buffer, session server and teacher scorer, then the trainer ranks (the actor system's
        close stops the rest)."""
        for ref in (self.scheduler, self.buffer, self.sessions, self.teacher_scorer):
            if ref is not None:
                try:
                    await self.system.stop(ref)
                except Exception as e:  # noqa: BLE001 - already gone (its node lost): nothing to stop
                    log.debug("stopping %s: %s", ref.name, e)
        if self.trainer is not None:
            await self.trainer.stop()


def resolve_transport(config: RunConfig) -> str:
    """`weights.transport`, "auto" resolved: "disk" for external engines (they reload files), "shm"
    for embedded engines all on node 0 with their weights in host memory, "stream" when some are
    elsewhere or on a GPU (or may be: device "auto"), which shared memory cannot reach, or when the
    engines release their memory each step (`loop.offload_engines`: a segment cannot be released)."""
    if config.weights.transport != "auto":
        return config.weights.transport
    if config.rollout.backend != "embedded":
        return "disk"
    on_host = config.rollout.engine.device == "cpu" and not config.loop.offload_engines
    return "stream" if any(n != 0 for n in config.placement.engines) or not on_host else "shm"


async def _engine_url(ref: ActorRef) -> str:
    state = await ref.ask(EngineStatus(), timeout_s=ASK_S)
    assert state.url is not None, f"engine {ref.name} serves no HTTP API"  # the fleet starts each with one
    return state.url


async def _all_or_none(*aws: Any) -> list[Any]:
    """`asyncio.gather`, except that the first failure cancels the rest (a run whose trainer cannot
    start does not wait for its engines to load) and is raised once they are gone."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
    if failed:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed[0].exception()  # the others' exceptions are retrieved above: no "never retrieved" noise
    return [task.result() for task in tasks]

