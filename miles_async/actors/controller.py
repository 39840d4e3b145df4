"""The controller: the one place that wires rollout -> buffer -> trainer -> weights, and owns the loop.

    dataset ──► RefillScheduler ──Rollout──► RolloutWorker(s) ──Generate / HTTP──► EngineActor(s) [processes]
                   ▲   │ Trajectory (metadata + BlobRef)   │ token arrays              ▲
                   │   ▼                                   ▼                           │ weights (shm, ...)
                   │  Buffer ──GetBatch──► controller    data plane (shared memory)    │
                   │                          │ plan: each rank its share   ▲ reads    │
                   │                          ├──TrainStep──► TrainerRank × N          │
                   │                          │  ExportWeights ──► WeightPusher ───────┘
                   └── TrainerStepped, WeightVersionChanged ◄┘

Who consumes, produces and waits for what:
- `RefillScheduler` consumes the task's items and the events on its left; produces rollout
  requests; waits for free slots and for admission (`policies.staleness`: at most `loop.max_staleness`
  versions ahead).
- `RolloutWorker`s consume requests; produce scored `Trajectory` records, their token arrays put
  into the data plane of the worker's process (this one); wait for their engine.
- `Buffer` consumes complete groups; produces batches; a full buffer keeps the scheduler's put
  waiting, and an empty one keeps the controller's `GetBatch` waiting. It owns the groups' arrays
  from their put and frees them: those it drops, and a batch once its step is trained.
- The controller (this file), per step: waits for a batch (`wait_data_s`), has the trainer ranks
  train it (`train_s`: `TrainerGroup.train` plans the step and sends each rank only its share, as
  references; each rank reads its share's arrays from the data plane), hands the batch back to the
  buffer (`ReleaseBatch`: the buffer owns the arrays and frees them), exports the new weights and
  has the pusher move them into the engines (`update_s`, overlapping the next step), then tells
  the scheduler (the trained prompts leave the admission count; engines hold a new version).
  Generation runs on meanwhile: that overlap is the fully asynchronous mode. `loop.mode =
  "sync"` (staleness 0) makes the same loop lockstep; "one_step_off" is 1.

The rest lives beside it: the pre-flight (`preflight.py`: the model, its tokenizer, the task and
its items, checked and built before the run folder is written), starting and placing the
processes (`fleet.py`), the SFT warm start (`warmstart.py`), evaluation (`evaluation.py`), and liveness from the runtime's supervision
(`liveness.py`: a lost engine leaves the fleet and is started again within `[rollout.restart]`,
joining between two steps with the current weights, like a node that joins; with no engine left
the run saves a checkpoint and stops, `EnginesLostError`; a lost scheduler, buffer, session server
or trainer rank ends the run naming it).

Outputs in the run folder: metrics.jsonl (one row per step), trace.jsonl (every sample, step,
update and eval: the simulator's input), checkpoints/, config.json (the resolved recipe),
sft_model/ and final_model/ (the model after the SFT warm start and at the end, as Hugging Face folders);
with `[observe]`, samples.jsonl (log_samples decoded samples per step), wandb/ and tensorboard/
(every metrics row, under the names of observe.names). Ctrl-C (or SIGTERM) stops after the current step, saves a checkpoint, and stops every actor and
child process; `resume=True` continues from the latest checkpoint.

Checkpoints (`loop.checkpoint_every`, `checkpoint_every_s`, `keep_checkpoints`): between two steps
the trainer copies its state and writes it in the background while the next step trains, so a
periodic checkpoint holds the loop up only for the copy (`checkpoint_s` in the next step's
metrics row). Each holds the run's own state beside the trainer's (`run_state.json`, the
`RunState` of run_state.py): the RL step, the first prompt never admitted, the prompts admitted
and not yet trained (generated again after a resume, so no prompt is trained twice nor skipped),
and how long metrics.jsonl, trace.jsonl and samples.jsonl were. A resume cuts them back to that
length (the lines cut go to `*.rolled_back.jsonl`), so each step appears once in them however
many times the run restarted. A run that stops cleanly for any reason while its trainer lives
(the end, Ctrl-C, a fatal error elsewhere) saves one more, after the last step it recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from miles_async.actors import PRELOAD
from miles_async.actors.buffer import Batch, BufferState, BufferStats, GetBatch, ReleaseBatch
from miles_async.actors.engine import ReleaseMemory, ResumeMemory
from miles_async.actors.evaluation import Evaluator, as_hf_folder
from miles_async.actors.fleet import (
    SHARED_FILE,
    Fleet,
    LocalSpawner,
    Node,
    RunFolder,
    RunSetupError,
    one_node_gpus,
    resolve_transport,
)
from miles_async.actors.liveness import Liveness
from miles_async.actors.preflight import Checked, check_run
from miles_async.actors.recipe import RunConfig, dump_recipe
from miles_async.actors.run_state import RUN_STATE_FILE, RunState, roll_back_logs
from miles_async.actors.scheduler import GetSchedulerState, TrainerStepped, WeightVersionChanged
from miles_async.actors.teacher import GetTeacherStats
from miles_async.actors.trainer import ExportWeights, LoadCheckpoint, SaveCheckpoint, WeightManifest
from miles_async.actors.warmstart import warm_start
from miles_async.actors.weights import PushWeights
from miles_async.observe import (
    TRACE_SCHEMA,
    MetricsLog,
    Progress,
    RunTrace,
    SampleText,
    SampleTrace,
    StepTrace,
    TraceLog,
    TrackerError,
    UpdateTrace,
    open_trackers,
)
from miles_async.observe.names import RLRow
from miles_async.observe.samples import decode, pick
from miles_async.runtime import ActorDeadError, ActorRef, ActorSystem, RemoteError, RuntimeConfig
from miles_async.trainer import checkpoint
from miles_async.trainer.step import StepMetrics
from miles_async.trajectory import TokenData, Trajectory, decode_data

__all__ = ["Controller", "EnginesLostError", "LocalSpawner", "Node", "RunLostError", "RunResult", "RunSetupError",
           "TrainerLostError", "run", "run_restarting"]

log = logging.getLogger("miles_async.actors.controller")
ASK_S = 600.0
WAIT_REPORT_S = 30.0  # a step waiting this long for data says what the buffer holds and dropped
LAST_CHECKPOINT_S = 120.0  # a fatal error elsewhere: how long the last checkpoint may take


class RunLostError(RuntimeError):
    """A process the run cannot go on without died (the scheduler, the buffer or the session
    server: e.g. their node was lost). The message names it, its node, the cause, the step, and
    the checkpoint `--resume` continues from."""


class TrainerLostError(RunLostError):
    """A trainer rank died or failed: the run cannot go on (the ranks train together). The message
    names the rank, its error, the step, and the checkpoint `--resume` continues from."""


class EnginesLostError(RunLostError):
    """Every rollout engine died for good (`[rollout.restart]`'s limit reached, restarts off, or their
    nodes lost): a checkpoint was saved and the run stopped. The message names the last engine, its
    cause, the step, and the checkpoint `--resume` continues from."""


ROLES = {"scheduler": "the refill scheduler", "buffer": "the buffer", "sessions": "the session server",
         "sample-recorder": "the sample recorder", "teacher": "the distillation teacher's engine",
         "teacher-scorer": "the teacher's scoring stage"}  # the processes a run cannot go on without


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
    restarts: int = 0  # how many times it was started again after losing a process (max_restarts)


@dataclass(slots=True)
class _Trained:
    """A step trained and not yet written down (metrics row, trace record)."""

    launched: _Launched
    metrics: StepMetrics
    step_s: float
    train_s: float
    train_end_s: float
    update_s: float = 0.0
    eval_score: float | None = None
    teacher_busy_s: float = 0.0  # distillation: the teacher's busy time over this step
    texts: list[SampleText] = field(default_factory=list)  # observe.log_samples: decoded samples of its batch


@dataclass(slots=True)
class _Launched:
    """A step whose batch is training: what the controller writes down when it finishes."""

    step: int
    start_s: float
    batch: Batch
    samples: list[Trajectory]
    prompt_ids: list[int]
    train: asyncio.Future[StepMetrics]
    issued: float  # perf_counter when the step was sent
    offload_s: tuple[float, float] = (0.0, 0.0)  # loop.offload_engines: (release before it, resume before its batch)


class Controller:
    """One run (module docstring): `await Controller(config, run_dir).run()`."""

    # Made by run(): the run's processes, the evaluator, the watch (once the actor system is up), and the
    # progress view and the samples' tokenizer (before it).
    fleet: Fleet
    evaluator: Evaluator
    liveness: Liveness
    progress: Progress  # the terminal's view, from the run's start (setup, SFT, RL)

    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 runtime: RuntimeConfig | None = None, system: ActorSystem | None = None,
                 nodes: dict[int, Node] | None = None, engine_api_key: str | None = None,
                 checked: Checked | None = None) -> None:
        node_ranks = set(nodes) if nodes else {0}
        missing = sorted(config.placement.nodes - node_ranks)
        if missing:
            raise ValueError(f"placement puts work on node(s) {missing} but the run's nodes are "
                             f"{sorted(node_ranks)}: launch that many nodes or change [placement]")
        self.config = config
        self.run_dir = Path(run_dir)
        # The pre-flight's tokenizer, task and items (the CLI's, or made here), before anything is written.
        checked = checked or check_run(config, self.run_dir, num_nodes=max(node_ranks) + 1)
        self.task, self.dataset, self.probe = checked.task, checked.dataset, checked.probe
        self.tokenizer = checked.tokenizer  # the model's: the task's, and what observe.log_samples decodes with
        self.resume = resume
        self.show_progress = progress
        self.runtime = runtime or RuntimeConfig(ask_timeout_s=ASK_S, spawn_timeout_s=120.0, preload=PRELOAD)
        self.system = system  # given: a multi-node run's (the launcher owns it)
        self.nodes = nodes
        self.engine_api_key = engine_api_key  # required by the engines' HTTP API (multi-node: off loopback)
        self.stop = asyncio.Event()
        self.start_time = time.time()
        self.version = 0
        self.step = 0
        self.resumed_from: str | None = None
        self.update_task: asyncio.Future[None] | None = None  # the weight push in flight
        # Nodes (re)joining the running job, and engines due to restart (by name): admitted between steps.
        self.joins: asyncio.Queue[Node | str] = asyncio.Queue()
        self.joining = asyncio.Event()  # set while `joins` holds some: wakes a step waiting for data
        self.rollout_rewards: list[float] = []  # of every sample finished since the last step
        self.retry_prompts: list[int] = []  # a resumed run's prompts admitted before and not trained
        self.prompt_tokens_sent = 0
        self.cached_tokens = 0
        self.folder = self._prepare_folder()
        self.resume_point = roll_back_logs(self.run_dir) if resume else None
        self.last_checkpoint = (0, time.monotonic())  # (RL step, when) of the latest checkpoint
        self.checkpoint_s = 0.0  # the last checkpoint's time in the loop's way, for the next row
        self.resume_s = 0.0  # loop.offload_engines: taking the engines' memory back before the last push
        self.launched: _Launched | None = None  # a step sent to the trainer, not yet trained
        self.unrecorded: _Trained | None = None  # a step trained, not yet written down
        self.metrics = MetricsLog(self.run_dir)
        self.trace = TraceLog(self.run_dir)

    def _prepare_folder(self) -> RunFolder:
        cfg = self.config
        model = cfg.model.pinned(self.run_dir) if self.resume else cfg.model  # the commit it started from
        try:  # before anything is written: a bad model path, Hub id or revision leaves the run folder as it was
            source, teacher = model.source(), cfg.teacher.resolve()
        except ValueError as e:
            raise RunSetupError(str(e)) from e
        recipe = dump_recipe(cfg)
        if source is not None and source.commit:  # resolved here, once: every process loads this snapshot folder
            log.info("%s", source.describe())
            recipe["model"]["revision"] = source.commit
        if teacher is not None and cfg.teacher.path and teacher != Path(cfg.teacher.path).expanduser():
            log.info("teacher %s at revision %s (%s)", cfg.teacher.path, teacher.name, teacher)
            recipe["teacher"]["revision"] = teacher.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(recipe, indent=2))
        token = secrets.token_hex(16)  # trainer ranks check they see the run folder (other nodes)
        (self.run_dir / SHARED_FILE).write_text(token)
        model_dir = source.folder if source is not None else model.folder(self.run_dir)
        return RunFolder(run_dir=self.run_dir, model_dir=model_dir, shared_token=token)

    def _now(self) -> float:
        return time.time() - self.start_time

    async def _open_trackers(self) -> None:
        """The trackers `[observe]` asks for (wandb, TensorBoard), fed every metrics row from here on."""
        observe = self.config.observe
        if not (observe.wandb or observe.tensorboard):
            return
        self.progress.status("opening " + " and ".join(n for n, on in (("wandb", observe.wandb),
                                                                        ("TensorBoard", observe.tensorboard)) if on))
        resume_step = None if not self.resume else (self.resume_point[1].rl_step if self.resume_point else 0)
        recipe = json.loads((self.run_dir / "config.json").read_text())  # as resolved (the model's commit)
        try:  # off the loop: wandb.init takes a second or more
            trackers = await asyncio.to_thread(open_trackers, observe, self.run_dir, recipe=recipe,
                                               resume_step=resume_step)
        except TrackerError as e:
            raise RunSetupError(str(e)) from e
        self.metrics.add_trackers(trackers)

    def add_node(self, node: Node) -> None:
        """A node joined the running job (a new one, or one back after it was lost): its engines are
        started, given the current weights, and put to work between two steps."""
        self.joins.put_nowait(node)
        self.joining.set()

    def _engine_due(self, name: str) -> None:
        """An engine whose process died is due to start again (`Liveness`; admitted like a node)."""
        self.joins.put_nowait(name)
        self.joining.set()

    # ----- the whole run -----

    async def run(self) -> RunResult:
        self._write_header()  # first: the warm start's records come after it
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)
        try:
            async with self._run_failures(), contextlib.AsyncExitStack() as stack:
                self.progress = stack.enter_context(Progress(phase="setup", enabled=self.show_progress))
                stack.callback(self.metrics.close)  # its trackers too: wandb's run finishes
                await self._open_trackers()
                if self.system is None:  # one node: this run's own actor system
                    self.system = await stack.enter_async_context(ActorSystem("controller", config=self.runtime))
                if self.nodes is None:
                    self.nodes = {0: Node(rank=0, host="127.0.0.1", spawner=LocalSpawner(self.system),
                                          num_gpus=one_node_gpus(self.config))}
                self.fleet = Fleet(self.config, self.folder, self.system, self.nodes, self.engine_api_key)
                self.progress.status(f"loading the model: starting {self.config.rollout.num_engines} engine(s) and "
                                     f"{self.config.trainer.world_size} trainer rank(s)")
                await self.fleet.start()
                if self.task.multi_turn:  # the TITO session server, routing sessions to the engines
                    self.progress.status("starting the session server")
                    await self.fleet.start_sessions()
                self.evaluator = Evaluator(self.config, self.fleet, self.task, self.probe, trace=self.trace,
                                           now=self._now, push=self._push)
                first_step, first_prompt, sft_steps, sft_acc = await self._resume_or_warm_start()
                await self.fleet.start_rollout(self.dataset, version=self.version, first_prompt=first_prompt,
                                               on_sample=self._trace_sample, retry_prompts=self.retry_prompts)
                async with Liveness(self.fleet, self.stop, restart=self.config.rollout.restart.policy(),
                                    due=self._engine_due, trace=self.trace, now=self._now,
                                    version=self.version) as self.liveness:
                    try:
                        if first_step == 0 and self.config.eval.at_start and self.config.eval.mode != "none":
                            self.progress.set_phase("RL", self.config.loop.num_steps)
                            self.progress.status("evaluating step 0 (before training)")
                            score = await self.evaluator.evaluate(0)  # the starting point of the curve
                            log.info("eval before training: score %.3f on %d held-out items", score,
                                     min(self.config.eval.num_prompts, len(self.probe)))
                        rewards, samples_per_s, idle = await self._rl(first_step)
                    except Exception as e:
                        await self._last_checkpoint(e)
                        if self.launched is not None:  # its failure (the same death) is not reported twice
                            self.launched.train.add_done_callback(_quietly)
                        raise
                interrupted = self.stop.is_set()
                self.progress.status("saving the last checkpoint and the model")
                await self._checkpoint()
                if self.step > first_step:  # the trained model, as a folder of its own
                    await self._save_model("final_model")
                if self.liveness.no_engine_left is not None:  # it stopped the run: no more samples can come
                    raise EnginesLostError(f"{self.liveness.no_engine_left}; the run stopped at RL step {self.step}; "
                                           f"{self._resume_hint()}")
                await self.fleet.stop_roles()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
        head, tail = rewards[:5], rewards[-5:]
        return RunResult(run_dir=str(self.run_dir), num_steps=self.step, sft_steps=sft_steps, sft_probe_accuracy=sft_acc,
                         reward_first=statistics.fmean(head) if head else None,
                         reward_last=statistics.fmean(tail) if tail else None, eval_scores=self.evaluator.scores,
                         samples_per_s=samples_per_s, trainer_idle_fraction=idle, wall_s=self._now(),
                         interrupted=interrupted, resumed_from=self.resumed_from)

    async def _resume_or_warm_start(self) -> tuple[int, int, int, float | None]:
        """(first RL step, first prompt position, SFT steps, SFT probe accuracy)."""
        trainer = self.fleet.trainer
        assert trainer is not None
        if self.resume_point is not None:
            latest, state = self.resume_point
            self.progress.status(f"resuming from {latest.name} (RL step {state.rl_step})")
            info = await trainer.ask(LoadCheckpoint(path=str(latest)), ASK_S)
            self.version = info.weight_version
            self.resumed_from = str(latest)
            self.step = state.rl_step
            self.last_checkpoint = (self.step, time.monotonic())
            await self._push()
            log.info("resumed from %s: RL step %d, weight version %d", latest, state.rl_step, self.version)
            self.retry_prompts = list(state.unfinished)
            return state.rl_step, state.first_prompt, 0, None
        if self.resume:
            log.info("no checkpoint under %s: starting over", self.run_dir / "checkpoints")
        assert self.system is not None
        sft_steps, accuracy = await warm_start(
            self.config.sft, task=self.task, dataset=self.dataset, probe=self.probe, trainer=trainer,
            dataplane=self.system.dataplane, evaluator=self.evaluator, push=self._push, stop=self.stop,
            progress=self.progress, on_version=self._set_version)
        if self.version > 0:  # the warm-started model as a folder of its own, a start for other runs
            # (model.path); at version 0 the engines already hold the trainer's weights (same files)
            self.progress.status("saving the SFT model (sft_model/)")
            await self._save_model("sft_model")
        return 0, 0, sft_steps, accuracy

    async def _save_model(self, name: str) -> None:
        """The trainer's current weights as a Hugging Face folder `name` in the run folder (model
        config and tokenizer files beside one model.safetensors): what transformers, vLLM or
        another run's `model.path` loads."""
        assert self.fleet.trainer is not None
        manifest = await self.fleet.trainer.ask(ExportWeights(folder=str(self.run_dir / name / "buckets"), merged=True),
                                                ASK_S)
        await asyncio.to_thread(as_hf_folder, self.folder.model_dir, manifest, self.run_dir / name)

    def _set_version(self, version: int) -> None:
        self.version = version

    # ----- weights -----

    async def _push(self, pusher: ActorRef | None = None) -> None:
        """Export the trainer's weights and push them (through `pusher`, by default the run's)."""
        assert self.fleet.trainer is not None
        manifest = await self.fleet.trainer.ask(self._push_export(), ASK_S)
        await self._push_manifest(manifest, pusher)

    def _push_export(self) -> ExportWeights:
        """What a push exports: with LoRA, the adapters alone for embedded engines (they merge them
        into their copy of the base) and external ones serving them through their LoRA endpoint;
        the model with the adapters merged for external ones that reload whole models
        (`rollout.server.lora = "merged"`)."""
        return ExportWeights(merged=self.config.rollout.backend != "embedded" and not self.fleet.adapter)

    async def _push_manifest(self, manifest: WeightManifest, pusher: ActorRef | None = None) -> None:
        """Push an exported version to the engines, trace it, and delete the export (it is consumed)."""
        target = pusher or self.fleet.pusher
        assert target is not None
        start = self._now()
        try:
            report = await target.ask(PushWeights(version=manifest.weight_version, manifest=manifest), timeout_s=ASK_S)
        finally:
            await asyncio.to_thread(shutil.rmtree, manifest.folder, True)
        log.debug("weight version %d pushed over %s in %.3fs", report.version, report.transport, self._now() - start)
        self.trace.write(UpdateTrace(version=report.version, start_s=start, end_s=self._now(),
                                     transport=report.transport, num_bytes=report.num_bytes, paused_s=report.seconds,
                                     target="eval" if pusher is not None and pusher is self.fleet.eval_pusher
                                     else "rollout"))

    async def _update_engines(self, manifest: WeightManifest) -> None:
        """The background half of a step's weight update: push, then tell the scheduler the engines moved."""
        assert self.fleet.scheduler is not None
        if self.config.loop.offload_engines:  # their memory back, just before the weights refill it
            self.resume_s += await self._offload(ResumeMemory(tags=self._offload_tags()))
        await self._push_manifest(manifest)
        for ref in self.fleet.engines:
            await self.fleet.scheduler.tell(WeightVersionChanged(engine=ref.name, version=manifest.weight_version))

    def _offload_tags(self) -> list[str]:
        return ["kv_cache"] if self.config.trainer.lora.enabled else ["weights", "kv_cache"]

    async def _offload(self, msg: ReleaseMemory | ResumeMemory) -> float:
        """Release (or take back) every engine's memory (`loop.offload_engines`); the seconds it took."""
        start = time.perf_counter()
        await asyncio.gather(*(ref.ask(msg, timeout_s=ASK_S) for ref in self.fleet.engines))
        return time.perf_counter() - start

    async def _settle_update(self) -> None:
        """Wait for the weight update in flight (before the next one, an eval, a checkpoint or the end)."""
        task, self.update_task = self.update_task, None
        if task is not None:
            await task

    # ----- the RL loop -----

    async def _launch(self, step: int) -> _Launched | None:
        """Wait for step `step`'s batch and start training on it; None if the run stops first."""
        assert self.fleet.trainer is not None
        step_start = self._now()
        batch = await self._next_batch()
        if batch is None:
            return None
        samples = [s for group in batch.groups for s in group.samples]
        offload_s = (0.0, 0.0)
        if self.config.loop.offload_engines:  # sync: nothing generates until the next push
            await self._settle_update()
            offload_s = (await self._offload(ReleaseMemory(tags=self._offload_tags())), self.resume_s)
            self.resume_s = 0.0
        train = asyncio.ensure_future(self.fleet.trainer.train(samples, timeout_s=ASK_S))
        self.launched = _Launched(step=step, start_s=step_start, batch=batch, samples=samples,
                                  prompt_ids=[g.prompt_id for g in batch.groups], train=train,
                                  issued=time.perf_counter(), offload_s=offload_s)
        return self.launched

    async def _release(self, batch: Batch) -> None:
        """A batch is trained (or its step failed): the buffer, which owns its arrays, frees them."""
        assert self.fleet.buffer is not None
        try:
            await self.fleet.buffer.tell(ReleaseBatch(batch_id=batch.batch_id))
        except ActorDeadError as e:  # the run ends with the buffer (Liveness names it), the arrays with the run
            log.debug("batch %d not released: %s", batch.batch_id, e)

    async def _rl(self, first_step: int) -> tuple[list[float], float, float]:
        """The steps: each step's batch is trained while the previous step is written down (metrics,
        trace, progress), and its weights are pushed while the next one trains."""
        cfg = self.config
        trainer, scheduler, buffer = self.fleet.trainer, self.fleet.scheduler, self.fleet.buffer
        assert trainer is not None and scheduler is not None and buffer is not None and self.system is not None
        rewards: list[float] = []
        rl_start = last_end = time.perf_counter()
        trained = 0
        idle_total = 0.0
        busy_before: dict[str, float] = {}
        teacher_busy_before = 0.0
        last = cfg.loop.num_steps
        with self.progress.in_phase("RL", last) as progress:
            progress.status(f"generating the first batch ({cfg.loop.batch_groups} groups)")
            current = await self._launch(first_step + 1) if first_step < last and not self.stop.is_set() else None
            while current is not None:
                try:
                    metrics = await current.train
                    texts = await self._sample_texts(current) if cfg.observe.log_samples else []
                finally:  # trained (or failed): the buffer frees the batch's arrays
                    await self._release(current.batch)
                step = self.step = current.step
                self.launched = None
                end, train_end_s = time.perf_counter(), self._now()
                train_s, step_s, last_end = end - current.issued, end - last_end, end
                trained_step = self.unrecorded = _Trained(current, metrics, step_s, train_s, train_end_s, texts=texts)
                t1 = time.perf_counter()
                self.version = metrics.weight_version
                await scheduler.tell(TrainerStepped(version=self.version, prompt_ids=current.prompt_ids))
                # (engines that gave back their memory get the weights again even when the step made none)
                if not metrics.skipped or cfg.loop.offload_engines:
                    manifest = await trainer.ask(self._push_export(), ASK_S)
                    await self._settle_update()  # one update at a time, in version order
                    self.update_task = asyncio.ensure_future(self._update_engines(manifest))
                trained_step.update_s = time.perf_counter() - t1
                if cfg.eval.due(step, last):
                    progress.status(f"evaluating step {step}")
                    await self._settle_update()  # evaluate the weights just trained
                    trained_step.eval_score = await self.evaluator.evaluate(step)
                last_step, last_time = self.last_checkpoint
                checkpoint_due = step < last and cfg.loop.checkpoint_due(step, step - last_step,
                                                                          time.monotonic() - last_time)
                upcoming = None
                if not self.joins.empty() and not self.stop.is_set():
                    await self._admit_nodes()  # the trainer is idle here: it exports the weights they need
                if step < last and not checkpoint_due and not self.stop.is_set():
                    upcoming = await self._launch(step + 1)  # the trainer works while this step is written down
                trained += len(current.samples)
                idle_total += max(step_s - train_s, 0.0)
                state = await scheduler.ask(GetSchedulerState(), timeout_s=ASK_S)
                busy = sum(state.engine_busy_s.values()) - sum(busy_before.values())
                busy_before = dict(state.engine_busy_s)
                if self.fleet.teacher_scorer is not None:
                    teacher = await self.fleet.teacher_scorer.ask(GetTeacherStats(), timeout_s=ASK_S)
                    trained_step.teacher_busy_s, teacher_busy_before = (teacher.busy_s - teacher_busy_before,
                                                                        teacher.busy_s)
                buffer_state = await buffer.ask(BufferStats(), timeout_s=ASK_S)
                row, values = self._write_down(trained_step, busy, buffer_state)
                rewards.append(row.rollout_reward_mean)
                progress.update(values)
                if checkpoint_due and not self.stop.is_set():  # (a stop's own checkpoint comes at the end)
                    progress.status(f"saving a checkpoint after step {step}")
                    self.checkpoint_s = await self._checkpoint(background=True)
                    if step < last and not self.stop.is_set():
                        upcoming = await self._launch(step + 1)
                current = upcoming
        await self._settle_update()
        wall = time.perf_counter() - rl_start
        return rewards, trained / max(wall, 1e-9), idle_total / max(wall, 1e-9)

    def _write_down(self, t: _Trained, busy: float, buffer_state: BufferState) -> tuple[RLRow, dict[str, Any]]:
        """A trained step's metrics row and trace record; the row, typed and as written (name -> value)."""
        current, metrics, batch = t.launched, t.metrics, t.launched.batch
        row = self._row(current, metrics, t.step_s, t.train_s, t.update_s, busy, buffer_state, t.eval_score,
                        t.teacher_busy_s)
        values = row.as_dict()
        self.metrics.log(values)
        self.metrics.log_samples(current.step, t.texts)
        self.trace.write(StepTrace(
            step=current.step, weight_version=metrics.weight_version, start_s=current.start_s, end_s=self._now(),
            wait_data_s=batch.waited_s, train_s=t.train_s, update_s=t.update_s, num_samples=len(current.samples),
            num_tokens=metrics.num_tokens, staleness_mean=batch.metrics.drawn_staleness_mean,
            staleness_max=batch.metrics.drawn_staleness_max, prompt_ids=current.prompt_ids,
            train_end_s=t.train_end_s))
        self.unrecorded = None
        return row, values

    def _row(self, current: _Launched, metrics: StepMetrics, step_s: float, train_s: float, update_s: float,
             busy: float, buffer_state: BufferState, eval_score: float | None,
             teacher_busy_s: float = 0.0) -> RLRow:
        """One metrics.jsonl row (its names and their meanings: observe.names.METRICS)."""
        samples, batch = current.samples, current.batch
        # The policy's reward: every sample finished since the last step, kept or filtered (the
        # batch's own mean leans on groups the filter kept, those with mixed rewards).
        reward = statistics.fmean(self.rollout_rewards) if self.rollout_rewards else 0.0
        self.rollout_rewards = []
        accept_rate, accept_length = spec_metrics(samples)
        teacher = self.fleet.teacher_scorer is not None  # distillation: the distance to the teacher, the stage's time
        offload = self.config.loop.offload_engines  # the engines' memory: taken back before its batch, released
        checkpoint_s, self.checkpoint_s = self.checkpoint_s, 0.0  # a checkpoint before this step: its time in the way
        return RLRow(
            step=current.step, rollout_reward_mean=reward,
            rollout_unscored_fraction=sum(not s.scored for s in samples) / len(samples),
            rollout_response_len_mean=statistics.fmean(s.num_generated_tokens for s in samples),
            rollout_spec_accept_rate=accept_rate, rollout_spec_accept_length=accept_length,
            # how much of every turn's prompt the engines' prefix caches held
            rollout_prefix_cache_hit_rate=self.cached_tokens / max(self.prompt_tokens_sent, 1)
            if self.task.multi_turn else None,
            train_loss=metrics.loss, train_pg_loss=metrics.pg_loss, train_grad_norm=metrics.grad_norm,
            train_entropy=metrics.entropy, train_kl=metrics.kl, train_rollout_kl_k3=metrics.rollout_kl_k3,
            train_clip_fraction=metrics.clip_fraction, train_logprob_abs_diff=metrics.logprob_abs_diff,
            train_tis_truncated_fraction=metrics.tis_truncated_fraction,
            train_mis_masked_fraction=metrics.mis_masked_fraction, train_draft_ce=metrics.draft_ce,
            train_teacher_kl=metrics.teacher_kl if teacher else None,
            train_batch_reward_mean=statistics.fmean([s.reward for s in samples if s.scored] or [0.0]),
            train_staleness_mean=batch.metrics.drawn_staleness_mean,
            train_staleness_max=batch.metrics.drawn_staleness_max,
            train_weight_version=self.version, train_num_samples=len(samples),
            train_num_tokens=metrics.num_tokens, train_num_forward_tokens=metrics.num_forward_tokens,
            perf_wall_s=self._now(), perf_step_s=step_s, perf_samples_per_s=len(samples) / max(step_s, 1e-9),
            perf_wait_data_s=batch.waited_s, perf_train_s=train_s, perf_update_s=update_s,
            perf_trainer_idle_fraction=max(step_s - train_s, 0.0) / max(step_s, 1e-9),
            perf_engine_busy_fraction=min(busy / max(step_s * len(self.fleet.engines), 1e-9), 1.0),
            perf_checkpoint_s=checkpoint_s or None,
            perf_engine_release_s=current.offload_s[0] if offload else None,
            perf_engine_resume_s=current.offload_s[1] if offload else None,
            perf_teacher_s=sum(s.teacher_s for s in samples) if teacher else None,
            perf_teacher_wait_s=sum(s.teacher_wait_s for s in samples) if teacher else None,
            perf_teacher_busy_fraction=min(teacher_busy_s / max(step_s, 1e-9), 1.0) if teacher else None,
            eval_score=eval_score,
            # an lm-eval command's own metrics, by task
            lm_eval=self.evaluator.metrics_of(current.step) if eval_score is not None else {},
            buffer_occupancy=buffer_state.num_groups / self.config.buffer.capacity_groups,
            buffer_waiting_staleness_mean=batch.metrics.waiting_staleness_mean,
            buffer_dropped_stale=buffer_state.dropped.get("stale", 0),
            buffer_dropped_aborted=buffer_state.dropped.get("aborted", 0),
            buffer_dropped_filtered=buffer_state.dropped.get("filtered", 0))

    async def _next_batch(self) -> Batch | None:
        """The next batch, or None when the run is asked to stop while waiting. A process the run
        needs dying meanwhile raises its death (`Liveness.lost`)."""
        buffer = self.fleet.buffer
        assert buffer is not None
        get = asyncio.ensure_future(buffer.ask(GetBatch(batch_groups=self.config.loop.batch_groups,
                                                        trainer_version=self.version, timeout_s=ASK_S),
                                               timeout_s=ASK_S + 10))
        stop = asyncio.ensure_future(self.stop.wait())
        lost = self.liveness.lost
        joining = asyncio.ensure_future(self.joining.wait())
        waited_s = 0.0
        waiting: set[asyncio.Future[Any]] = {get, stop, lost, joining}
        while not (done := (await asyncio.wait(waiting, timeout=WAIT_REPORT_S,
                                                return_when=asyncio.FIRST_COMPLETED))[0]) or done == {joining}:
            if joining in done:  # an engine (re)joins: with none left, no batch comes until it serves
                await self._admit_nodes()
                waiting.discard(joining)
                joining = asyncio.ensure_future(self.joining.wait())
                waiting.add(joining)
                continue
            waited_s += WAIT_REPORT_S
            state = await buffer.ask(BufferStats(), timeout_s=ASK_S)
            dropped = ", ".join(f"{n} {why}" for why, n in state.dropped.items() if n) or "none"
            log.warning("step %d has waited %.0fs for a batch: %d groups waiting, dropped so far: %s%s", self.step,
                        waited_s, state.num_groups, dropped,
                        " (groups whose rewards are all equal are filtered: is the reward always the same?)"
                        if state.dropped.get("filtered") else "")
        stop.cancel()
        joining.cancel()
        if lost in done:
            get.cancel()
            lost.result()  # raises the death: the run ends with it
        if get in done:
            return get.result()
        get.cancel()
        return None

    async def _admit_nodes(self) -> None:
        """Nodes that joined and engines due to restart join the run (the trainer is idle: it exports
        the weights they need)."""
        await self._settle_update()  # every engine holds self.version; none is being written
        while not self.joins.empty():
            join = self.joins.get_nowait()
            if isinstance(join, str):
                await self.liveness.restart_engine(join, self.version, self._push)
                continue
            for ref in await self.fleet.admit(join, self.version, self._push):
                await self.liveness.joined(ref, self.version)
        self.joining.clear()

    async def _checkpoint(self, *, background: bool = False) -> float:
        """Save a checkpoint after the step last written down (module docstring); the seconds it
        held the loop up. In the background the trainer replies once its state is copied."""
        assert self.fleet.trainer is not None and self.fleet.scheduler is not None
        start = time.perf_counter()
        if not background:
            await self._settle_update()
        state = await self.fleet.scheduler.ask(GetSchedulerState(), timeout_s=ASK_S)
        run_state = RunState(rl_step=self.step, next_new_prompt=state.next_new_prompt, unfinished=state.unfinished,
                             metrics_bytes=self.metrics.path.stat().st_size, trace_bytes=self.trace.path.stat().st_size,
                             samples_bytes=self.metrics.samples_bytes())
        info = await self.fleet.trainer.ask(SaveCheckpoint(
            background=background, files={RUN_STATE_FILE: run_state.encode()},
            keep=self.config.loop.keep_checkpoints), ASK_S)
        self.last_checkpoint = (self.step, time.monotonic())
        held_s = time.perf_counter() - start
        log.info("checkpoint after RL step %d: %s (%.2fs in the loop's way%s)", self.step, info.path, held_s,
                 ", written in the background" if background else "")
        return held_s

    async def _last_checkpoint(self, error: BaseException) -> None:
        """A fatal error while the trainer lives: save a checkpoint of what was recorded before the
        run stops (a step sent to the trainer is waited for and counted first). Best effort: a
        failure here is logged and the run stops with the original error."""
        if _trainer_failed(error) or self.fleet.trainer is None or self.fleet.scheduler is None:
            return
        try:
            if self.unrecorded is not None:  # trained: written down with what is known
                self._write_down(self.unrecorded, 0.0, BufferState(num_groups=0, dropped={}))
            if self.launched is not None:  # the trainer applies it before it can save: count it
                launched, self.launched = self.launched, None
                metrics = await asyncio.wait_for(asyncio.shield(launched.train), LAST_CHECKPOINT_S)
                self.step, self.version = launched.step, metrics.weight_version
                await self.fleet.scheduler.tell(TrainerStepped(version=metrics.weight_version,
                                                               prompt_ids=launched.prompt_ids))
                self._write_down(_Trained(launched, metrics, 0.0, 0.0, self._now()), 0.0,
                                 BufferState(num_groups=0, dropped={}))
            self.update_task = None  # the failed update (or one that never ends) is not waited for
            await asyncio.wait_for(self._checkpoint(), LAST_CHECKPOINT_S)
        except Exception as e:  # noqa: BLE001 - the run stops with its own error; this one is said
            log.warning("no checkpoint could be saved before stopping: %s: %s", type(e).__name__, e)

    # ----- records -----

    def _trace_sample(self, sample: Trajectory, counted: bool) -> None:
        if counted and not sample.aborted and sample.scored:  # an unscored sample has no reward to average
            self.rollout_rewards.append(sample.reward)
        self.prompt_tokens_sent += sample.prompt_tokens_sent
        self.cached_tokens += sample.cached_tokens
        self.trace.write(SampleTrace(
            prompt_id=sample.prompt_id, index=sample.index, attempt=sample.attempt, engine=sample.engine,
            submit_s=sample.submit_s - self.start_time, end_s=sample.end_s - self.start_time,
            prompt_tokens=sample.num_prompt_tokens, output_tokens=sample.num_generated_tokens,
            versions=list(sample.weight_versions), reward=sample.reward, finish_reason=sample.finish_reason,
            dropped="" if counted else "engine_lost", num_turns=sample.num_turns, tool_s=sample.tool_s,
            teacher_s=sample.teacher_s, teacher_wait_s=sample.teacher_wait_s, scored=sample.scored))

    async def _sample_texts(self, launched: _Launched) -> list[SampleText]:
        """`observe.log_samples` samples of a trained batch, decoded: their arrays are read from the
        data plane before the batch is freed, the tokens decoded off the loop."""
        assert self.system is not None
        chosen = [launched.samples[i] for i in pick(len(launched.samples), self.config.observe.log_samples)]
        arrays = [s.data if isinstance(s.data, TokenData) or s.data is None
                  else decode_data(await self.system.dataplane.read(s.data)) for s in chosen]

        def decoded() -> list[SampleText]:
            return [decode(self.tokenizer, [] if data is None else data.token_ids().tolist(),
                           s.num_prompt_tokens, step=launched.step, prompt_id=s.prompt_id, index=s.index,
                           reward=s.reward, scored=s.scored, versions=list(s.weight_versions),
                           finish_reason=s.finish_reason, num_generated_tokens=s.num_generated_tokens)
                    for s, data in zip(chosen, arrays)]

        return await asyncio.to_thread(decoded)

    def _write_header(self) -> None:
        """The trace's first record: the schema and the run's settings (what the simulator replays with)."""
        cfg = self.config
        r, s, loop, b = cfg.rollout, cfg.scheduler, cfg.loop, cfg.buffer
        self.trace.write(RunTrace(
            schema=TRACE_SCHEMA, start_s=self._now(), source="run", num_engines=r.num_engines,
            trainer_world_size=cfg.trainer.world_size, mode=loop.mode,
            max_staleness=loop.staleness, group_size=s.group_size, batch_groups=loop.batch_groups,
            target_in_flight=s.target_in_flight, max_in_flight_per_engine=s.max_in_flight_per_engine,
            refill=s.refill, partial=r.partial, capacity_groups=b.capacity_groups, filter=b.filter,
            on_stale=b.on_stale, on_abort=b.on_abort, eval_mode=cfg.eval.mode, eval_every=cfg.eval.every,
            num_steps=loop.num_steps, transport=resolve_transport(cfg),
            teacher_in_flight=cfg.teacher.max_in_flight if cfg.teacher.enabled else 0))

    # ----- stopping -----

    @contextlib.asynccontextmanager
    async def _run_failures(self) -> Any:
        """Turn a trainer rank's death or error into a `TrainerLostError` with the root cause (the
        scheduler's, buffer's or session server's death into a `RunLostError`). It is raised after
        the actor system closed, so every process of the run is gone by then."""
        try:
            yield
        except (ActorDeadError, RemoteError) as e:
            name = e.actor
            role = name.startswith("trainer-") or (name in ROLES and isinstance(e, ActorDeadError))
            if not role:
                raise
            cause = e.cause if isinstance(e, ActorDeadError) else e.failure
            resume = self._resume_hint()
            what = "died" if isinstance(e, ActorDeadError) else "failed"
            tail = (f"{what}: {cause.type}: {cause.message}; the run stopped at RL step {self.step} (every process "
                    f"of it has exited); {resume}")
            if name.startswith("trainer-"):
                raise TrainerLostError(f"trainer rank {name.removeprefix('trainer-')} ({name}) {tail}") from e
            placement = self.config.placement
            node = {"scheduler": placement.scheduler, "buffer": placement.buffer, "sessions": placement.sessions}.get(
                name, 0)
            raise RunLostError(f"{ROLES[name]} ({name}, on node {node}) {tail}") from e

    def _resume_hint(self) -> str:
        latest = checkpoint.latest(self.run_dir / "checkpoints")
        return (f"--resume continues from {latest}{_rl_step_of(latest)}" if latest is not None else
                "no checkpoint was saved yet (loop.checkpoint_every_s, loop.checkpoint_every), so --resume starts over")

    def _on_signal(self) -> None:
        if self.stop.is_set():
            log.warning("second interrupt: exiting now")
            raise KeyboardInterrupt
        print("\nmiles-async: stopping after this step (a checkpoint is saved); Ctrl-C again to quit now",
              file=sys.stderr)
        self.stop.set()


def _quietly(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _trainer_failed(error: BaseException) -> bool:
    """Whether `error` is a trainer rank's death or failure (no checkpoint can be asked of it then)."""
    return isinstance(error, (ActorDeadError, RemoteError)) and error.actor.startswith("trainer-")


def _rl_step_of(folder: Path) -> str:
    """" (after RL step N)" for a checkpoint folder (named by the trainer's step, SFT steps included)."""
    try:
        return f" (after RL step {RunState.read(folder).rl_step})"
    except (OSError, ValueError):
        return ""


async def run(config: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
              max_restarts: int = 0, on_restart: Callable[[int, RunLostError], None] | None = None,
              controllers: list[Controller] | None = None, checked: Checked | None = None) -> RunResult:
    """One run on this node, started again up to `max_restarts` times (`run_restarting`): each
    restart told to `on_restart(attempt, error)`. `controllers` collects each attempt's `Controller`
    (tests reach its processes through it); `checked` is the pre-flight's (made by the first start
    when not given), used by every start."""

    def start(resume: bool) -> Controller:
        nonlocal checked
        checked = checked or check_run(config, run_dir)
        controller = Controller(config, run_dir, resume=resume, progress=progress, checked=checked)
        if controllers is not None:
            controllers.append(controller)
        return controller

    async def restarting(attempt: int, error: RunLostError) -> None:
        if on_restart is not None:
            on_restart(attempt, error)

    return await run_restarting(start, resume=resume, max_restarts=max_restarts, on_restart=restarting)


async def run_restarting(start: Callable[[bool], Controller], *, resume: bool, max_restarts: int,
                         on_restart: Callable[[int, RunLostError], Awaitable[None]]) -> RunResult:
    """Run `start(resume)`'s controller. When a process the run cannot go on without dies or fails
    (`RunLostError`: a trainer rank, the scheduler, the buffer, the session server, every engine),
    `await on_restart(attempt, error)` (it stops what is left of the run: on one node everything
    has exited by then) and the run starts again from its latest checkpoint, up to `max_restarts`
    times, as torchrun does; then the error is raised. The result counts the restarts."""
    restarts = 0
    while True:
        try:
            result = await start(resume).run()
        except RunLostError as e:
            if restarts >= max_restarts:
                raise
            restarts += 1
            resume = True
            log.warning("restart %d of %d: %s", restarts, max_restarts, e)
            await on_restart(restarts, e)
            continue
        return msgspec.structs.replace(result, restarts=restarts)


def spec_metrics(samples: list[Trajectory]) -> tuple[float, float]:
    """Speculative decoding over a batch's samples (the engines' counts): the fraction of draft
    tokens accepted, and tokens per decoding step (SGLang's accept length; 1 without speculation)."""
    drafted = sum(s.spec_draft_tokens for s in samples)
    steps = sum(s.spec_verify_ct for s in samples)
    generated = sum(s.num_generated_tokens for s in samples if s.spec_verify_ct)
    return (sum(s.spec_accepted_drafts for s in samples) / drafted if drafted else 0.0,
            generated / steps if steps else 1.0)
