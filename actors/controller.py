"""The controller: the one place that wires rollout -> buffer -> trainer -> weights, and owns the loop.

    dataset ──► RefillScheduler ──Rollout──► RolloutWorker(s) ──HTTP──► EngineActor(s)  [own processes]
                   ▲   │ n samples of a prompt                              ▲
                   │   ▼                                                    │ weights (shm | broadcast | ...)
                   │  Buffer ──GetBatch──► controller ──TrainStep──► TrainerRank × N  [own processes]
                   │                          │  ExportWeights ──► WeightPusher ──┘
                   └── TrainerStepped, WeightVersionChanged ◄┘

Who consumes, produces and waits for what:
- `RefillScheduler` consumes the dataset and the events on its left; produces rollout requests;
  waits for free slots and for admission (`policies.staleness`: at most `max_staleness` versions ahead).
- `RolloutWorker`s consume requests; produce scored samples; wait for their engine.
- `Buffer` consumes complete groups; produces batches; a full buffer keeps the scheduler's put
  waiting, and an empty one keeps the controller's `GetBatch` waiting.
- The controller (this file), per step: waits for a batch (`wait_data_s`), trains it on every
  rank (`train_s`), exports the new weights and has the pusher move them into the engines
  (`update_s`), then tells the scheduler (the trained prompts leave the admission count; engines
  hold a new version). Generation runs on meanwhile: that overlap is the fully asynchronous mode.
  `loop.mode = "sync"` (max_staleness 0) makes the same loop lockstep; "one_step_off" is 1.
- Before RL, an SFT warm start (`[sft]`) trains on the task's answers until sampled accuracy on a
  held-out probe set reaches `sft.target_accuracy` (a start of 0.1-0.3 is where GRPO learns best).
- Evaluation (`[eval]`): "shared" holds new rollouts while the engines answer the eval prompts;
  "dedicated" pushes the weights to an engine of its own, so rollouts go on; "command" runs an
  external command on a checkpoint folder (config, tokenizer and `model.safetensors`).

Outputs in the run folder: metrics.jsonl (one row per step), trace.jsonl (every sample, step,
update and eval: the simulator's input), checkpoints/, config.json (the resolved recipe).
Ctrl-C (or SIGTERM) stops after the current step, saves a checkpoint, and stops every actor and
child process; `resume=True` continues from the latest checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shlex
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import msgspec

from miles_async.actors.buffer import Batch, Buffer, BufferStats, GetBatch
from miles_async.actors.engine import EngineActor, EngineStatus
from miles_async.actors.recipe import RunConfig, dump_recipe
from miles_async.actors.rollout import RewardInput, RolloutWorker, SampleOut, load_object, load_reward
from miles_async.actors.scheduler import (
    AddEngine,
    GetSchedulerState,
    RefillScheduler,
    SampleSeen,
    TrainerStepped,
    WeightVersionChanged,
)
from miles_async.actors.sessions import (
    AddSessionEngine,
    CloseSessions,
    RemoveSessionEngine,
    SessionHost,
    SessionsUrl,
)
from miles_async.actors.trainer import (
    ExportWeights,
    LoadCheckpoint,
    RankPlacement,
    SaveCheckpoint,
    TrainerGroup,
    TrainStep,
)
from miles_async.actors.weights import PushWeights, WeightPusher, WeightSyncConfig
from miles_async.engine.client import EngineClient, bearer
from miles_async.models import init_model, load_tokenizer
from miles_async.observe import (
    TRACE_SCHEMA,
    EvalTrace,
    MetricsLog,
    Progress,
    RunTrace,
    SampleTrace,
    StepTrace,
    TraceLog,
    UpdateTrace,
)
from miles_async.policies.refill import RefillConfig
from miles_async.runtime import Actor, ActorRef, ActorSystem, RestartPolicy, RuntimeConfig, handler
from miles_async.tasks import calculator
from miles_async.tasks.reverse import Prompt, is_correct, prompts, sft_examples
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import free_port
from miles_async.trainer.packing import TrainSample

log = logging.getLogger("miles_async.actors.controller")
ASK_S = 600.0
SHARED_FILE = ".run-token"  # in the run folder: what trainer ranks on other nodes must see
WAIT_REPORT_S = 30.0  # a step waiting this long for data says what the buffer holds and dropped


class RunSetupError(RuntimeError):
    """The run cannot start as configured and placed (found when its nodes are there, before any
    process starts); the message names the nodes and the fix."""


class RunLostError(RuntimeError):
    """A process the run cannot go on without died (the scheduler, the buffer or the session
    server: e.g. their node was lost). The message names it, its node, the cause, the step, and
    the checkpoint `--resume` continues from."""


class TrainerLostError(RunLostError):
    """A trainer rank died or failed: the run cannot go on (the ranks train together). The message
    names the rank, its error, the step, and the checkpoint `--resume` continues from."""


ROLES = {"scheduler": "the refill scheduler", "buffer": "the buffer", "sessions": "the session server",
         "sample-recorder": "the sample recorder"}  # the processes a run cannot go on without


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    num_steps: int
    sft_steps: int
    sft_probe_accuracy: float | None
    reward_first: float | None  # mean reward of the first 5 RL steps
    reward_last: float | None  # of the last 5
    eval_scores: list[tuple[int, float]]
    samples_per_s: float  # trained samples over the RL phase's wall time
    trainer_idle_fraction: float
    wall_s: float
    interrupted: bool
    resumed_from: str | None = None  # the checkpoint this run continued from


def to_train_sample(sample: SampleOut, group: int) -> TrainSample:
    if sample.tokens:  # a multi-turn trajectory: its own mask (generated tokens only) and log-probs
        return TrainSample(tokens=sample.tokens, loss_mask=sample.loss_mask, rollout_logprobs=sample.token_logprobs,
                           reward=sample.reward, weight_version=min(sample.versions), group=group,
                           routed_experts=sample.routed_experts)
    tokens = sample.prompt_ids + sample.output_ids
    return TrainSample(tokens=tokens, loss_mask=[0] * len(sample.prompt_ids) + [1] * len(sample.output_ids),
                       rollout_logprobs=[0.0] * len(sample.prompt_ids) + sample.output_logprobs,
                       reward=sample.reward, weight_version=min(sample.versions), group=group,
                       routed_experts=sample.routed_experts)


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
    num_gpus: int = 0  # 0: CPU only (or GPUs left to the processes: a one-node run)


@dataclass(slots=True)
class _Launched:
    """A step whose batch is training: what the controller writes down when it finishes."""

    step: int
    start_s: float
    batch: Batch
    samples: list[TrainSample]
    prompt_ids: list[int]
    train: asyncio.Future
    issued: float  # perf_counter when the TrainStep was sent


def _payload(record: Any) -> SampleOut:
    payload = record.payload
    return payload if isinstance(payload, SampleOut) else msgspec.convert(payload, SampleOut)


class SampleRecorder(Actor):
    """In the controller's process: hands each `SampleSeen` of a scheduler on another node to the
    controller's trace (`on_sample`, as an in-process scheduler calls it)."""

    def __init__(self, on_sample: Any) -> None:
        self.on_sample = on_sample

    @handler
    def seen(self, msg: SampleSeen) -> None:
        sample = msg.sample if isinstance(msg.sample, SampleOut) else msgspec.convert(msg.sample, SampleOut)
        self.on_sample(sample, msg.counted)


class Controller:
    """One run (module docstring): `await Controller(config, run_dir).run()`."""

    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 runtime: RuntimeConfig | None = None, system: ActorSystem | None = None,
                 nodes: dict[int, Node] | None = None, engine_api_key: str | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.show_progress = progress
        self.runtime = runtime or RuntimeConfig(ask_timeout_s=ASK_S, spawn_timeout_s=120.0)
        self.stop = asyncio.Event()
        self.start_time = time.time()
        self.system: ActorSystem | None = system  # given: a multi-node run's (the launcher owns it)
        self.nodes = nodes
        self.engine_api_key = engine_api_key  # required by the engines' HTTP API (multi-node: off loopback)
        missing = sorted(config.placement.nodes - set(nodes or {0: None}))
        if missing:
            raise ValueError(f"placement puts work on node(s) {missing} but the run's nodes are "
                             f"{sorted(nodes or {0: None})}: launch that many nodes or change [placement]")
        self.engines: list[ActorRef] = []
        self.engine_urls: dict[str, str] = {}
        self.eval_engine: ActorRef | None = None
        self.trainer: TrainerGroup | None = None
        self.pusher: ActorRef | None = None
        self.eval_pusher: ActorRef | None = None
        self.scheduler: ActorRef | None = None
        self.buffer: ActorRef | None = None
        self.version = 0
        self.step = 0
        self.eval_scores: list[tuple[int, float]] = []
        self.resumed_from: str | None = None
        self.update_task: asyncio.Future | None = None  # the weight push in flight
        self.joins: asyncio.Queue[Node] = asyncio.Queue()  # nodes (re)joining the running job
        self.num_engines_started = 0
        self._gpus_given: dict[int, int] = {}  # per node: engines given a GPU so far
        self.rollout_rewards: list[float] = []  # of every sample finished since the last step
        self.role_lost: asyncio.Future | None = None  # set to the death of a process the run needs

    # ----- setup -----

    def _prepare(self) -> None:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(dump_recipe(cfg), indent=2))
        self.shared_token = secrets.token_hex(16)  # trainer ranks check they see the run folder (other nodes)
        (self.run_dir / SHARED_FILE).write_text(self.shared_token)
        if cfg.model.path:
            self.model_dir = Path(cfg.model.path)
        else:
            self.model_dir = self.run_dir / "model"
            if not (self.model_dir / "config.json").is_file():
                init_model(cfg.model.family, cfg.model.preset, self.model_dir, seed=cfg.model.seed)
        model_config = json.loads((self.model_dir / "config.json").read_text())
        self.family = model_config.get("model_type", cfg.model.family)
        self.is_moe = int(model_config.get("num_experts") or 0) > 0  # the rollouts record routed experts (R3)
        self.tokenizer = load_tokenizer(self.model_dir)
        num_probe = max(cfg.sft.num_probe, cfg.eval.num_prompts)
        self.agentic = bool(cfg.agent.agent)
        if self.agentic:  # multi-turn: tasks for an agent, driven through the TITO session server
            self.dataset = calculator.problems(cfg.task.calculator, cfg.task.num_prompts, "train")
            self.probe = calculator.problems(cfg.task.calculator, num_probe, "probe")
        else:
            self.dataset = prompts(cfg.task.reverse, cfg.task.num_prompts, self.tokenizer, split="train")
            self.probe = prompts(cfg.task.reverse, num_probe, self.tokenizer, split="probe")
        self.sessions: ActorRef | None = None  # the TITO session server's host (agent runs)
        self.sessions_url = ""
        self.prompt_tokens_sent = 0
        self.cached_tokens = 0
        self.reward_fn = load_reward(cfg.task.reward)
        self.metrics = MetricsLog(self.run_dir)
        self.trace = TraceLog(self.run_dir)

    def _now(self) -> float:
        return time.time() - self.start_time

    def _trainer_config(self) -> TrainerConfig:
        t, s = self.config.trainer, self.config.rollout.sampling
        return TrainerConfig(
            model_dir=str(self.model_dir), world_size=t.world_size, lr=t.lr, grad_clip=t.grad_clip,
            micro_batch_tokens=t.micro_batch_tokens, num_threads=t.num_threads, seed=self.config.loop.seed,
            checkpoint_dir=str(self.run_dir / "checkpoints"), weights_dir=str(self.run_dir / "weights"),
            shared_file=str(self.run_dir / SHARED_FILE), shared_token=self.shared_token,
            policy_loss=t.policy_loss, advantage=t.advantage, old_logprobs=t.old_logprobs,
            temperature=s.temperature if s.temperature > 0 else 1.0)

    def _trainer_placement(self) -> list[RankPlacement]:
        """Each trainer rank's node (spawner, LOCAL_RANK there, address): `placement.trainer`. Ranks
        all on one node of a multi-node run keep their process group on loopback (torch.distributed's
        sockets have no authentication: off loopback only when the ranks span nodes)."""
        assert self.nodes is not None
        placed = self.config.placement.trainer_nodes(self.config.trainer.world_size)
        one_node = len(set(placed)) == 1
        ranks, per_node = [], {}
        for node_rank in placed:
            node = self.nodes[node_rank]
            host = "" if len(self.nodes) == 1 else "127.0.0.1" if one_node else node.host
            ranks.append(RankPlacement(spawner=node.spawner, local_rank=per_node.get(node_rank, 0), host=host))
            per_node[node_rank] = per_node.get(node_rank, 0) + 1
        return ranks

    async def _spawn(self, system: ActorSystem) -> None:
        cfg = self.config
        r, w = cfg.rollout, cfg.weights
        engine_cfg = msgspec.structs.replace(r.engine, shared_weights=w.transport == "shm",
                                             double_buffer=w.double_buffer)
        nodes = self.nodes
        assert nodes is not None
        names = [f"engine-{i}" for i in range(r.num_engines)]
        placed = [nodes[cfg.placement.engine_node(i)] for i in range(r.num_engines)]
        if cfg.eval.mode == "dedicated":
            names.append("eval-engine")
            placed.append(nodes[0])
        self.num_engines_started = r.num_engines
        self.engine_cfg = engine_cfg
        engine_nodes = list({n.rank: n for n in placed}.values())
        await self._check_network(engine_nodes)
        await asyncio.gather(*(self._give_model(node) for node in engine_nodes))
        spawns = [node.spawner.spawn(EngineActor, name, args=(str(self.model_dir), engine_cfg),
                                     kwargs={"http_host": node.host, "http_port": 0, "num_threads": r.engine_threads,
                                             "api_key": self.engine_api_key}, env=self._gpu_env(node))
                  for name, node in zip(names, placed)]
        ranks = self._trainer_placement()
        master = nodes[cfg.placement.trainer_nodes(cfg.trainer.world_size)[0]]
        trainer_spawn = TrainerGroup.spawn(system, self._trainer_config(), cfg.trainer.world_size,
                                           master_addr=ranks[0].host or master.host,
                                           master_port=await master.spawner.free_port(), placement=ranks)
        *engines, self.trainer = await _all_or_none(*spawns, trainer_spawn)
        if cfg.eval.mode == "dedicated":
            self.eval_engine = engines.pop()
        self.engines = engines
        for ref in engines + ([self.eval_engine] if self.eval_engine else []):
            state = await ref.ask(EngineStatus(), timeout_s=ASK_S)
            self.engine_urls[ref.name] = state.url
        sync = WeightSyncConfig(family=self.family, transport=w.transport, bucket_mib=w.bucket_mib, verify=w.verify,
                                host=nodes[0].host,
                                pause_mode="in_place" if r.partial == "continue" else "abort",
                                delta_dir=str(self.run_dir / "deltas"))
        self.sync_config = sync
        self.pusher = await system.spawn(WeightPusher, "pusher", args=([e.name for e in engines], sync))
        if self.eval_engine is not None:
            self.eval_pusher = await system.spawn(WeightPusher, "eval-pusher", args=(["eval-engine"], sync))

    async def _spawn_rollout(self, system: ActorSystem, first_prompt: int) -> None:
        cfg = self.config
        r, loop = cfg.rollout, cfg.loop
        workers = [f"rollout-{i}" for i in range(r.num_workers)]
        agent_kwargs: dict[str, Any] = {"api_key": self.engine_api_key}
        if self.agentic:
            assert self.sessions is not None
            agent_kwargs |= {"agent": cfg.agent.agent, "environment": cfg.agent.environment,
                            "session_url": self.sessions_url, "sandbox": cfg.agent.sandbox,
                            "rollout": cfg.agent.rollout}
        for name in workers:
            await system.spawn(RolloutWorker, name, args=(cfg.task.reward,), kwargs=agent_kwargs)
        buffer_cfg = msgspec.structs.replace(cfg.buffer, max_staleness=loop.staleness)
        refill = RefillConfig(target_in_flight=r.target_in_flight, group_size=r.group_size,
                              batch_groups=loop.batch_groups, max_staleness=loop.staleness,
                              max_in_flight_per_engine=r.max_in_flight_per_engine, refill=r.refill)
        kwargs: dict[str, Any] = {"workers": workers, "buffer": "buffer", "seed": loop.seed if r.seeded else None,
                                  "trainer_version": self.version, "first_prompt": first_prompt,
                                  "routed_experts": self.is_moe}
        if cfg.placement.scheduler != 0:  # it reports each finished sample to a recorder here, for the trace
            await system.spawn(SampleRecorder, "sample-recorder", args=(self._trace_sample,))
            kwargs["sample_sink"] = "sample-recorder"
        else:
            kwargs["on_sample"] = self._trace_sample
        self.scheduler = await self._place(system, cfg.placement.scheduler, RefillScheduler, "scheduler",
                                           (refill, self.dataset, r.sampling), kwargs)
        self.buffer = await self._place(system, cfg.placement.buffer, Buffer, "buffer", (buffer_cfg, "scheduler"), {})
        for ref in self.engines:
            actor = ref.name if r.client == "actor" else ""
            await self.scheduler.tell(AddEngine(name=ref.name, url=self.engine_urls[ref.name], version=self.version,
                                                actor=actor))

    async def _place(self, system: ActorSystem, node_rank: int, cls: type, name: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> ActorRef:
        """A role of `[placement]` (scheduler, buffer, session server): in this process on node 0, a
        process of its own on another node."""
        assert self.nodes is not None
        if node_rank == 0:
            return await system.spawn(cls, name, args=args, kwargs=kwargs)
        return await self.nodes[node_rank].spawner.spawn(cls, name, args=args, kwargs=kwargs)

    async def _spawn_sessions(self, system: ActorSystem) -> None:
        """The session server: in this process on loopback (node 0), or a process on its node serving
        that node's address, where it wants the run's API key (and the model folder, for the tokenizer)."""
        assert self.nodes is not None
        node = self.nodes[self.config.placement.sessions]
        urls = [self.engine_urls[e.name] for e in self.engines]
        kwargs: dict[str, Any] = {"engine_api_key": self.engine_api_key}
        if node.rank != 0:
            await self._give_model(node)
            kwargs |= {"host": node.host, "api_key": self.engine_api_key}
        self.sessions = await self._place(system, node.rank, SessionHost, "sessions", (urls, str(self.model_dir)), kwargs)
        self.sessions_url = await self.sessions.ask(SessionsUrl(), timeout_s=ASK_S)

    def _trace_sample(self, sample: SampleOut, counted: bool) -> None:
        if counted and not sample.aborted:
            self.rollout_rewards.append(sample.reward)
        self.prompt_tokens_sent += sample.prompt_tokens_sent
        self.cached_tokens += sample.cached_tokens
        self.trace.write(SampleTrace(
            prompt_id=sample.prompt_index, index=sample.index, attempt=sample.attempt, engine=sample.engine,
            submit_s=sample.submit_s - self.start_time, end_s=sample.end_s - self.start_time,
            prompt_tokens=len(sample.prompt_ids), output_tokens=len(sample.output_ids), versions=sample.versions,
            reward=sample.reward, finish_reason=sample.finish_reason, dropped="" if counted else "engine_lost"))

    # ----- weights -----

    async def _push(self, pusher: ActorRef | None = None) -> float:
        """Export the trainer's weights and push them; return the seconds it took."""
        assert self.trainer is not None
        start = self._now()
        manifest = await self.trainer.ask(ExportWeights(), ASK_S)
        await self._push_manifest(manifest, pusher)
        return self._now() - start

    async def _push_manifest(self, manifest: Any, pusher: ActorRef | None = None) -> None:
        """Push an exported version to the engines, trace it, and delete the export (it is consumed)."""
        start = self._now()
        try:
            report = await (pusher or self.pusher).ask(PushWeights(version=manifest.weight_version,
                                                                   manifest=manifest), timeout_s=ASK_S)
        finally:
            await asyncio.to_thread(shutil.rmtree, manifest.folder, True)
        self.trace.write(UpdateTrace(version=report.version, start_s=start, end_s=self._now(),
                                     transport=report.transport, num_bytes=report.num_bytes, paused_s=report.seconds,
                                     target="eval" if pusher is not None and pusher is self.eval_pusher else "rollout"))

    async def _update_engines(self, manifest: Any) -> None:
        """The background half of a step's weight update: push, then tell the scheduler the engines moved."""
        assert self.scheduler is not None
        await self._push_manifest(manifest)
        for ref in self.engines:
            await self.scheduler.tell(WeightVersionChanged(engine=ref.name, version=manifest.weight_version))

    async def _settle_update(self) -> None:
        """Wait for the weight update in flight (before the next one, an eval, a checkpoint or the end)."""
        task, self.update_task = self.update_task, None
        if task is not None:
            await task

    # ----- SFT warm start -----

    async def _sft(self) -> tuple[int, float | None]:
        cfg = self.config.sft
        if cfg.max_steps <= 0:
            return 0, None
        assert self.trainer is not None
        probe = self.probe[:cfg.num_probe]
        accuracy = None
        step = 0
        with Progress(cfg.max_steps, enabled=self.show_progress) as progress:
            for step in range(1, cfg.max_steps + 1):
                start = (step - 1) * cfg.batch_size
                items = [self.dataset[(start + i) % len(self.dataset)] for i in range(cfg.batch_size)]
                samples = await asyncio.to_thread(self._sft_batch, items)  # rendering is work: off the loop
                metrics = await self.trainer.ask(TrainStep(samples=samples, objective="sft", lr=cfg.lr), ASK_S)
                self.version = metrics.weight_version
                if step % cfg.probe_every == 0 or step == cfg.max_steps:
                    await self._push()
                    accuracy = (await self._score_agent(probe, temperature=1.0) if self.agentic
                                else await self._score(probe, temperature=1.0, exact=True))
                    progress.update({"step": step, "reward_mean": accuracy, "wall_s": self._now()})
                    log.info("SFT step %d: loss %.3f, sampled probe accuracy %.3f", step, metrics.loss, accuracy)
                    if accuracy >= cfg.target_accuracy or self.stop.is_set():
                        break
        return step, accuracy

    def _sft_batch(self, items: list[Any]) -> list[TrainSample]:
        """The warm start's examples for these items: the answer (an agent: the ideal conversation's
        assistant turns) under the loss mask."""
        if self.agentic:
            pairs = calculator.sft_examples(items, self.tokenizer)
        else:
            pairs = [(e.tokens, e.loss_mask) for e in sft_examples(items, self.tokenizer)]
        return [TrainSample(tokens=t, loss_mask=m, rollout_logprobs=[0.0] * len(t)) for t, m in pairs]

    async def _score(self, items: list[Prompt], *, temperature: float, exact: bool = False,
                     url: str | None = None) -> float:
        """Mean reward (or exact-match accuracy) of one sample per prompt on the engines."""
        urls = [url] if url else [self.engine_urls[e.name] for e in self.engines]
        params = {"max_new_tokens": self.config.rollout.sampling.max_new_tokens, "temperature": temperature}
        scores: list[float] = []
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(EngineClient(u, timeout_s=ASK_S, api_key=self.engine_api_key))
                       for u in urls]
            chunks = [items[i::len(clients)] for i in range(len(clients))]
            outs = await asyncio.gather(*(c.generate(input_ids=[p.input_ids for p in chunk], sampling_params=params)
                                          for c, chunk in zip(clients, chunks) if chunk))
            for chunk, out in zip([c for c in chunks if c], outs):
                for prompt, o in zip(chunk, out):
                    if exact:
                        scores.append(float(is_correct(o["text"], prompt.answer)))
                    else:
                        finish = (o["meta_info"].get("finish_reason") or {}).get("type", "")
                        scores.append(float(await self.reward_fn(RewardInput(
                            prompt=prompt, output_text=o["text"], output_ids=o["output_ids"], finish_reason=finish))))
        return statistics.fmean(scores) if scores else 0.0

    async def _score_agent(self, items: list[Any], *, temperature: float) -> float:
        """Mean reward of one episode per task, through the session server (sessions closed after)."""
        from miles_async.agents.api import run_episode

        cfg = self.config
        assert self.sessions is not None
        agent = load_object(cfg.agent.agent, "agent")
        environment = load_object(cfg.agent.environment, "environment")()
        sampling = {"temperature": temperature, "max_tokens": cfg.rollout.sampling.max_new_tokens}
        self._probe_round = getattr(self, "_probe_round", 0) + 1
        ids = [f"probe{self._probe_round}-{i}" for i in range(len(items))]
        async with aiohttp.ClientSession(headers=bearer(self.engine_api_key)) as http:  # a session server off node 0
            episodes = await asyncio.gather(*(run_episode(agent, environment, item,
                                                          f"{self.sessions_url}/sessions/{sid}/v1", sampling=sampling,
                                                          http=http) for item, sid in zip(items, ids)))
        await self.sessions.ask(CloseSessions(session_ids=ids), timeout_s=ASK_S)
        return statistics.fmean(e.reward or 0.0 for e in episodes) if episodes else 0.0

    # ----- evaluation -----

    async def _evaluate(self) -> float:
        await self._settle_update()  # evaluate the weights just trained
        cfg = self.config.eval
        start = self._now()
        items = self.probe[:cfg.num_prompts]
        if cfg.mode == "shared":
            from miles_async.actors.scheduler import HoldRollouts

            assert self.scheduler is not None
            await self.scheduler.ask(HoldRollouts(hold=True), timeout_s=ASK_S)
            try:
                score = (await self._score_agent(items, temperature=cfg.temperature) if self.agentic
                         else await self._score(items, temperature=cfg.temperature))
            finally:
                await self.scheduler.ask(HoldRollouts(hold=False), timeout_s=ASK_S)
        elif cfg.mode == "dedicated":
            await self._push(self.eval_pusher)
            if self.agentic:
                raise ValueError('eval.mode = "dedicated" is not wired for agents yet: use "shared" or "command"')
            score = await self._score(items, temperature=cfg.temperature, url=self.engine_urls["eval-engine"])
        else:
            score = await self._run_eval_command()
        self.trace.write(EvalTrace(step=self.step, score=score, num_samples=len(items), mode=cfg.mode, start_s=start,
                                   end_s=self._now()))
        self.eval_scores.append((self.step, score))
        return score

    async def _run_eval_command(self) -> float:
        """Write a loadable checkpoint folder, run the command on it, read {"score": x} from its last line."""
        assert self.trainer is not None
        folder = self.run_dir / "eval" / f"step_{self.step:06d}"
        manifest = await self.trainer.ask(ExportWeights(folder=str(folder / "buckets")), ASK_S)
        await asyncio.to_thread(_as_hf_folder, self.model_dir, manifest, folder)
        command = self.config.eval.command.replace("{checkpoint}", shlex.quote(str(folder)))
        proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), ASK_S)
        lines = out.decode().strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"eval command {command!r} failed (exit {proc.returncode}): {err.decode()[-2000:]}")
        try:
            return float(json.loads(lines[-1])["score"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"eval command {command!r}: its last stdout line must be {{\"score\": x}}, "
                               f"got {lines[-1]!r}") from e

    # ----- the RL loop -----

    async def _launch(self, step: int) -> _Launched | None:
        """Wait for step `step`'s batch and start training on it; None if the run stops first."""
        assert self.trainer is not None
        step_start = self._now()
        batch = await self._next_batch()
        if batch is None:
            return None
        samples, prompt_ids = [], []
        for group in batch.groups:
            prompt_ids.append(group.prompt_id)
            samples.extend(to_train_sample(_payload(r), group.prompt_id) for r in group.samples)
        train = asyncio.ensure_future(self.trainer.ask(TrainStep(samples=samples, data_cursor=-1), ASK_S))
        return _Launched(step=step, start_s=step_start, batch=batch, samples=samples, prompt_ids=prompt_ids,
                         train=train, issued=time.perf_counter())

    async def _rl(self, first_step: int) -> tuple[list[float], float, float]:
        """The steps: each step's batch is trained while the previous step is written down (metrics,
        trace, progress), and its weights are pushed while the next one trains."""
        cfg = self.config
        assert self.trainer is not None and self.buffer is not None and self.scheduler is not None
        rewards: list[float] = []
        rl_start = last_end = time.perf_counter()
        trained = 0
        idle_total = 0.0
        busy_before: dict[str, float] = {}
        last = cfg.loop.num_steps
        with Progress(last, enabled=self.show_progress) as progress:
            current = await self._launch(first_step + 1) if first_step < last and not self.stop.is_set() else None
            while current is not None:
                step = self.step = current.step
                metrics = await current.train
                end, train_end_s = time.perf_counter(), self._now()
                train_s, step_s, last_end = end - current.issued, end - last_end, end
                t1 = time.perf_counter()
                self.version = metrics.weight_version
                await self.scheduler.tell(TrainerStepped(version=self.version, prompt_ids=current.prompt_ids))
                if not metrics.skipped:
                    manifest = await self.trainer.ask(ExportWeights(), ASK_S)
                    await self._settle_update()  # one update at a time, in version order
                    self.update_task = asyncio.ensure_future(self._update_engines(manifest))
                update_s = time.perf_counter() - t1
                eval_score = None
                if cfg.eval.mode != "none" and cfg.eval.every > 0 and (step % cfg.eval.every == 0 or step == last):
                    eval_score = await self._evaluate()
                checkpoint_due = bool(cfg.loop.checkpoint_every) and step % cfg.loop.checkpoint_every == 0
                upcoming = None
                if not self.joins.empty() and not self.stop.is_set():
                    await self._admit_nodes()  # the trainer is idle here: it exports the weights they need
                if step < last and not checkpoint_due and not self.stop.is_set():
                    upcoming = await self._launch(step + 1)  # the trainer works while this step is written down
                trained += len(current.samples)
                idle_total += max(step_s - train_s, 0.0)
                state = await self.scheduler.ask(GetSchedulerState(), timeout_s=ASK_S)
                busy = sum(state.engine_busy_s.values()) - sum(busy_before.values())
                busy_before = dict(state.engine_busy_s)
                buffer_stats = await self.buffer.ask(BufferStats(), timeout_s=ASK_S)
                row = self._row(current, metrics, step_s, train_s, update_s, busy, buffer_stats, eval_score)
                rewards.append(row["reward_mean"])
                self.metrics.log(row)
                batch = current.batch
                self.trace.write(StepTrace(
                    step=step, weight_version=self.version, start_s=current.start_s, end_s=self._now(),
                    wait_data_s=batch.waited_s, train_s=train_s, update_s=update_s, num_samples=len(current.samples),
                    num_tokens=metrics.num_tokens, staleness_mean=batch.metrics.drawn_staleness_mean,
                    staleness_max=batch.metrics.drawn_staleness_max, prompt_ids=current.prompt_ids,
                    train_end_s=train_end_s))
                progress.update(row)
                if checkpoint_due:
                    await self._checkpoint()
                    if step < last and not self.stop.is_set():
                        upcoming = await self._launch(step + 1)
                current = upcoming
        await self._settle_update()
        wall = time.perf_counter() - rl_start
        return rewards, trained / max(wall, 1e-9), idle_total / max(wall, 1e-9)

    def _row(self, current: _Launched, metrics: Any, step_s: float, train_s: float, update_s: float, busy: float,
             buffer_stats: dict, eval_score: float | None) -> dict[str, Any]:
        """One metrics.jsonl row (observe.logs lists the keys)."""
        samples, batch = current.samples, current.batch
        # The policy's reward: every sample finished since the last step, kept or filtered (the
        # batch's own mean leans on groups the filter kept, those with mixed rewards).
        reward = statistics.fmean(self.rollout_rewards) if self.rollout_rewards else 0.0
        self.rollout_rewards = []
        row = {
            "step": current.step, "wall_s": self._now(), "weight_version": self.version, "reward_mean": reward,
            "batch_reward_mean": statistics.fmean(s.reward for s in samples),
            "logprob_abs_diff": metrics.logprob_abs_diff, "staleness_mean": batch.metrics.drawn_staleness_mean,
            "staleness_max": batch.metrics.drawn_staleness_max,
            "waiting_staleness_mean": batch.metrics.waiting_staleness_mean, "num_samples": len(samples),
            "num_tokens": metrics.num_tokens, "samples_per_s": len(samples) / max(step_s, 1e-9),
            "step_s": step_s, "wait_data_s": batch.waited_s, "train_s": train_s, "update_s": update_s,
            "trainer_idle_fraction": max(step_s - train_s, 0.0) / max(step_s, 1e-9),
            "engine_busy_fraction": min(busy / max(step_s * len(self.engines), 1e-9), 1.0),
            "buffer_occupancy": buffer_stats["num_groups"] / self.config.buffer.capacity_groups,
            "dropped_stale": buffer_stats["dropped"].get("stale", 0),
            "dropped_aborted": buffer_stats["dropped"].get("aborted", 0),
            "dropped_filtered": buffer_stats["dropped"].get("filtered", 0),
            "loss": metrics.loss, "grad_norm": metrics.grad_norm, "entropy": metrics.entropy}
        if eval_score is not None:
            row["eval_score"] = eval_score
        if self.agentic:  # multi-turn: how much of every turn's prompt the engines' prefix caches held
            row["prefix_cache_hit_rate"] = self.cached_tokens / max(self.prompt_tokens_sent, 1)
        return row

    async def _next_batch(self) -> Batch | None:
        """The next batch, or None when the run is asked to stop while waiting."""
        assert self.buffer is not None
        get = asyncio.ensure_future(self.buffer.ask(GetBatch(batch_groups=self.config.loop.batch_groups,
                                                             trainer_version=self.version, timeout_s=ASK_S),
                                                    timeout_s=ASK_S + 10))
        stop = asyncio.ensure_future(self.stop.wait())
        lost = self.role_lost if self.role_lost is not None else asyncio.get_running_loop().create_future()
        waited_s = 0.0
        while not (done := (await asyncio.wait({get, stop, lost}, timeout=WAIT_REPORT_S,
                                                return_when=asyncio.FIRST_COMPLETED))[0]):
            waited_s += WAIT_REPORT_S
            stats = await self.buffer.ask(BufferStats(), timeout_s=ASK_S)
            dropped = ", ".join(f"{n} {why}" for why, n in stats["dropped"].items() if n) or "none"
            log.warning("step %d has waited %.0fs for a batch: %d groups waiting, dropped so far: %s%s", self.step,
                        waited_s, stats["num_groups"], dropped,
                        " (groups whose rewards are all equal are filtered: is the reward always the same?)"
                        if stats["dropped"].get("filtered") else "")
        stop.cancel()
        if lost in done:
            get.cancel()
            lost.result()  # raises the death: the run ends with it
        if get in done:
            return get.result()
        get.cancel()
        return None

    async def _checkpoint(self) -> None:
        assert self.trainer is not None and self.scheduler is not None
        await self._settle_update()
        state = await self.scheduler.ask(GetSchedulerState(), timeout_s=ASK_S)
        # Where the dataset resumes: the lowest prompt not yet trained or discarded (prompts past
        # it that were already trained are trained again after a resume: at most a few batches).
        info = await self.trainer.ask(SaveCheckpoint(), ASK_S)
        (Path(info.path) / "run_state.json").write_text(json.dumps({"next_prompt": state.next_prompt,
                                                                     "rl_step": self.step}))

    # ----- the whole run -----

    async def run(self) -> RunResult:
        self._prepare()
        self._write_header()  # first: the warm start's records come after it
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)
        interrupted = False
        try:
            async with self._run_failures(), contextlib.AsyncExitStack() as stack:
                if self.system is None:  # one node: this run's own actor system
                    self.system = await stack.enter_async_context(ActorSystem("controller", config=self.runtime))
                system = self.system
                if self.nodes is None:
                    self.nodes = {0: Node(rank=0, host="127.0.0.1", spawner=LocalSpawner(system))}
                await self._spawn(system)
                if self.agentic:  # the TITO session server, routing sessions to the engines
                    await self._spawn_sessions(system)
                first_step, first_prompt, sft_steps, sft_acc = await self._resume_or_warm_start()
                await self._spawn_rollout(system, first_prompt)
                self.role_lost = asyncio.get_running_loop().create_future()
                monitor = asyncio.ensure_future(self._watch_engines())
                try:
                    rewards, samples_per_s, idle = await self._rl(first_step)
                finally:
                    monitor.cancel()
                interrupted = self.stop.is_set()
                await self._checkpoint()
                await self._stop_all(system)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
        head, tail = rewards[:5], rewards[-5:]
        return RunResult(run_dir=str(self.run_dir), num_steps=self.step, sft_steps=sft_steps, sft_probe_accuracy=sft_acc,
                         reward_first=statistics.fmean(head) if head else None,
                         reward_last=statistics.fmean(tail) if tail else None, eval_scores=self.eval_scores,
                         samples_per_s=samples_per_s, trainer_idle_fraction=idle, wall_s=self._now(),
                         interrupted=interrupted, resumed_from=self.resumed_from)

    @contextlib.asynccontextmanager
    async def _run_failures(self) -> Any:
        """Turn a trainer rank's death or error into a `TrainerLostError` with the root cause (the
        scheduler's, buffer's or session server's death into a `RunLostError`). It is raised after
        the actor system closed, so every process of the run is gone by then."""
        from miles_async.runtime import ActorDeadError, RemoteError

        try:
            yield
        except (ActorDeadError, RemoteError) as e:
            name = e.actor
            role = name.startswith("trainer-") or (name in ROLES and isinstance(e, ActorDeadError))
            if not role:
                raise
            cause = e.cause if isinstance(e, ActorDeadError) else e.failure
            latest = checkpoint.latest(self.run_dir / "checkpoints")
            resume = (f"--resume continues from {latest}{_rl_step_of(latest)}" if latest is not None else
                      "no checkpoint was saved yet (loop.checkpoint_every), so --resume starts over")
            what = "died" if isinstance(e, ActorDeadError) else "failed"
            tail = (f"{what}: {cause.type}: {cause.message}; the run stopped at RL step {self.step} (every process "
                    f"of it has exited); {resume}")
            if name.startswith("trainer-"):
                raise TrainerLostError(f"trainer rank {name.removeprefix('trainer-')} ({name}) {tail}") from e
            placement = self.config.placement
            node = {"scheduler": placement.scheduler, "buffer": placement.buffer, "sessions": placement.sessions}.get(
                name, 0)
            raise RunLostError(f"{ROLES[name]} ({name}, on node {node}) {tail}") from e

    def _write_header(self) -> None:
        """The trace's first record: the schema and the run's settings (what the simulator replays with)."""
        cfg = self.config
        r, loop, b = cfg.rollout, cfg.loop, cfg.buffer
        self.trace.write(RunTrace(
            schema=TRACE_SCHEMA, start_s=self._now(), source="run", num_engines=r.num_engines,
            trainer_world_size=cfg.trainer.world_size, mode=loop.mode,
            max_staleness=loop.staleness, group_size=r.group_size, batch_groups=loop.batch_groups,
            target_in_flight=r.target_in_flight, max_in_flight_per_engine=r.max_in_flight_per_engine,
            refill=r.refill, partial=r.partial, capacity_groups=b.capacity_groups, filter=b.filter,
            on_stale=b.on_stale, on_abort=b.on_abort, eval_mode=cfg.eval.mode, eval_every=cfg.eval.every,
            num_steps=loop.num_steps, transport=cfg.weights.transport))

    async def _resume_or_warm_start(self) -> tuple[int, int, int, float | None]:
        """(first RL step, first prompt position, SFT steps, SFT probe accuracy)."""
        assert self.trainer is not None
        latest = checkpoint.latest(self.run_dir / "checkpoints") if self.resume else None
        if latest is not None:
            info = await self.trainer.ask(LoadCheckpoint(path=str(latest)), ASK_S)
            state = json.loads((latest / "run_state.json").read_text())
            self.version = info.weight_version
            self.resumed_from = str(latest)
            await self._push()
            log.info("resumed from %s: RL step %d, weight version %d", latest, state["rl_step"], self.version)
            return state["rl_step"], state["next_prompt"], 0, None
        if self.resume:
            log.info("no checkpoint under %s: starting fresh", self.run_dir / "checkpoints")
        sft_steps, accuracy = await self._sft()
        if self.version > 0:  # the warm-started model as a folder of its own, a start for other runs
            # (model.path); at version 0 the engines already hold the trainer's weights (same files)
            manifest = await self.trainer.ask(ExportWeights(folder=str(self.run_dir / "sft_model" / "buckets")), ASK_S)
            await asyncio.to_thread(_as_hf_folder, self.model_dir, manifest, self.run_dir / "sft_model")
        return 0, 0, sft_steps, accuracy

    async def _check_network(self, engine_nodes: list[Node]) -> None:
        """What crosses nodes, said before anything starts: a `disk_delta` transport needs the run
        folder shared with the engines' nodes (refused otherwise, naming them), and torch.distributed's
        own connections (trainer ranks on several nodes, `broadcast` to other nodes) have no
        authentication (warned: they belong on a trusted network)."""
        cfg = self.config
        remote = [n for n in engine_nodes if n.rank != 0]
        if cfg.weights.transport == "disk_delta" and remote:
            blind = [n.rank for n in remote if not await n.spawner.shares(self.run_dir / SHARED_FILE)]
            if blind:
                raise RunSetupError(f'weights.transport = "disk_delta" writes deltas into the run folder ({self.run_dir}) '
                                    f"for the engines to read, but node(s) {blind} do not see it: put it on a "
                                    'filesystem they mount at the same path, or use "stream" (no shared folder needed)')
        trainer_nodes = set(cfg.placement.trainer_nodes(cfg.trainer.world_size))
        if len(trainer_nodes) > 1 or (cfg.weights.transport == "broadcast" and remote):
            what = "trainer ranks on several nodes" if len(trainer_nodes) > 1 else "weights by broadcast to other nodes"
            log.warning("%s: their torch.distributed connections (gloo/NCCL and their TCPStore) have no "
                        "authentication, as torchrun's: keep these nodes on a trusted network%s", what,
                        "" if len(trainer_nodes) > 1 else ' (weights.transport = "stream" is authenticated)')

    async def _give_model(self, node: Node) -> None:
        """The model folder on `node` before its engines load it (sent if that node lacks it)."""
        sent = await node.spawner.ensure_folder(self.model_dir)
        if sent:
            log.info("node %d did not hold the model folder %s: sent %.1f MiB", node.rank, self.model_dir, sent / 2**20)

    def _gpu_env(self, node: Node) -> dict[str, str] | None:
        """CUDA_VISIBLE_DEVICES for the next engine on `node`: its GPUs in turn, after those of the
        trainer ranks when they share the node (a rank uses GPU LOCAL_RANK). None without GPUs."""
        if node.num_gpus <= 0:
            return None
        cfg = self.config
        taken = cfg.placement.trainer_nodes(cfg.trainer.world_size).count(node.rank)
        count = self._gpus_given.get(node.rank, 0)
        self._gpus_given[node.rank] = count + 1
        return {"CUDA_VISIBLE_DEVICES": str((taken + count) % node.num_gpus)}

    def add_node(self, node: Node) -> None:
        """A node joined the running job (a new one, or one back after it was lost): its engines are
        started, given the current weights, and put to work between two steps."""
        self.joins.put_nowait(node)

    async def _admit_nodes(self) -> None:
        from miles_async.actors.scheduler import AddEngine
        from miles_async.actors.weights import JoinEngine

        assert self.system is not None and self.trainer is not None and self.scheduler is not None
        await self._settle_update()  # every engine holds self.version; none is being written
        while not self.joins.empty():
            node = self.joins.get_nowait()
            count = max(1, sum(1 for n in self.config.placement.engines if n == node.rank))
            await self._give_model(node)
            for _ in range(count):
                name = f"engine-{self.num_engines_started}"
                self.num_engines_started += 1
                ref = await node.spawner.spawn(EngineActor, name, args=(str(self.model_dir), self.engine_cfg),
                                               kwargs={"http_host": node.host, "http_port": 0,
                                                       "num_threads": self.config.rollout.engine_threads,
                                                       "api_key": self.engine_api_key}, env=self._gpu_env(node))
                state = await ref.ask(EngineStatus(), timeout_s=ASK_S)
                if self.version > 0:  # the current weights first, through a pusher of its own
                    pusher = await self.system.spawn(WeightPusher, f"pusher-{name}", args=([name], self.sync_config))
                    try:
                        await self._push(pusher)
                    finally:
                        await self.system.stop(pusher)
                await self.pusher.ask(JoinEngine(name=name), timeout_s=ASK_S)
                self.engines.append(ref)
                self.engine_urls[name] = state.url
                actor = name if self.config.rollout.client == "actor" else ""
                await self.scheduler.tell(AddEngine(name=name, url=state.url, version=self.version, actor=actor))
                if self.sessions is not None:  # agents' sessions are routed by the session server
                    await self.sessions.ask(AddSessionEngine(url=state.url), timeout_s=ASK_S)
                log.warning("node %d joined: %s serves from weight version %d", node.rank, name, self.version)

    async def _watch_engines(self, interval_s: float = 0.5) -> None:
        """Declare an engine that stops answering lost: the scheduler moves its samples, the pusher forgets it."""
        from miles_async.actors.scheduler import EngineLost
        from miles_async.actors.weights import ForgetEngine
        from miles_async.runtime import ActorDeadError, AskTimeoutError

        assert self.scheduler is not None and self.pusher is not None
        while True:
            await asyncio.sleep(interval_s)
            await self._watch_roles()
            for ref in list(self.engines):
                try:
                    await ref.ask(EngineStatus(), timeout_s=30.0)
                except (ActorDeadError, AskTimeoutError) as e:
                    log.error("engine %s is gone (%s); its samples go to the other engines", ref.name, e)
                    self.engines.remove(ref)
                    await self.scheduler.tell(EngineLost(name=ref.name))
                    await self.pusher.ask(ForgetEngine(name=ref.name), timeout_s=ASK_S)
                    if self.sessions is not None:
                        await self.sessions.ask(RemoveSessionEngine(url=self.engine_urls[ref.name]), timeout_s=ASK_S)
                    if not self.engines:
                        log.error("no engine left: stopping the run")
                        self.stop.set()

    async def _watch_roles(self) -> None:
        """A dead scheduler, buffer or session server ends the run (it cannot go on without them):
        `role_lost` gets the death, which whatever the loop waits on then raises."""
        from miles_async.actors.buffer import BufferStats
        from miles_async.runtime import ActorDeadError

        probes = ((self.scheduler, GetSchedulerState()), (self.buffer, BufferStats()), (self.sessions, SessionsUrl()))
        for ref, probe in probes:
            if ref is None or self.role_lost is None or self.role_lost.done():
                continue
            try:
                await ref.ask(probe, timeout_s=30.0)
            except ActorDeadError as e:
                log.error("%s is gone (%s): the run cannot go on", ref.name, e)
                self.role_lost.set_exception(e)

    async def _stop_all(self, system: ActorSystem) -> None:
        for ref in (self.scheduler, self.buffer, self.sessions):
            if ref is not None:
                with contextlib.suppress(Exception):
                    await system.stop(ref)
        if self.trainer is not None:
            await self.trainer.stop()

    def _on_signal(self) -> None:
        if self.stop.is_set():
            log.warning("second interrupt: exiting now")
            raise KeyboardInterrupt
        print("\nmiles-async: stopping after this step (a checkpoint is saved); Ctrl-C again to quit now",
              file=sys.stderr)
        self.stop.set()


def _rl_step_of(folder: Path) -> str:
    """" (after RL step N)" for a checkpoint folder (named by the trainer's step, SFT steps included)."""
    try:
        return f" (after RL step {json.loads((folder / 'run_state.json').read_text())['rl_step']})"
    except (OSError, ValueError, KeyError):
        return ""


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


def _as_hf_folder(model_dir: Path, manifest: Any, folder: Path) -> None:
    """A checkpoint folder `load_pretrained` and transformers read: the model's config and tokenizer
    files beside one `model.safetensors` merged from the exported buckets."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for bucket in manifest.buckets:
        tensors.update(load_file(bucket.path))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix in (".json", ".txt", ".jinja") and "safetensors" not in path.name:
            shutil.copy2(path, folder / path.name)
    shutil.rmtree(Path(manifest.folder), ignore_errors=True)


async def run(config: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True) -> RunResult:
    return await Controller(config, run_dir, resume=resume, progress=progress).run()
