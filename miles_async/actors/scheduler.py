"""`RefillScheduler`: keeps the engines busy with rollouts, one sample at a time (sample-level refill by
default; `RefillConfig.refill = "group"` frees a group's slots together, for comparison).

    dataset ──► RefillScheduler ──Rollout──► RolloutWorker(s) ──► engines
                   ▲      │ Trajectory (metadata + a reference to its arrays)
                   │      ├── (distillation) Score ──► TeacherScorer: the teacher's log-probs
                   │      └── n samples of a prompt ──PutGroup──► Buffer
                   ├── WeightVersionChanged (pusher side: an engine holds a new version)
                   ├── TrainerStepped (controller: a step trained these prompts)
                   ├── GroupsDropped (buffer: regenerate or forget these prompts)
                   ├── EngineLost (an engine died: its in-flight samples go to the others)
                   └── AddEngine (an engine joins: at the start, a node joining, or an engine
                       restarted after its process died, under its old name)

The decisions (what to submit, where, whether admission is open) are
`policies.refill.RefillPolicy`'s; this actor sends them and collects the answers. A finished
sample frees its slot at once and the slot is refilled in the same turn; a group whose n samples
are in goes to the buffer. With a distillation teacher (`teacher`, miles_async/actors/teacher.py) a finished
sample's slot is refilled first and the sample is then scored by the teacher; its group goes to
the buffer once every member is scored (a failed scoring fails the sample). Replies from an
engine that was declared lost are ignored (the policy reissued those samples), so no sample is
counted twice, and their arrays are freed from the data plane. The dataset's items are the task's, opaque here: a worker turns one into a prompt. When
every sample fails (an agent that always raises, a session server or engine refusing at once),
the refill would spin as fast as the failures come: past 16 failures in a row each one waits
before its slot is refilled (doubling, up to 5 s), the latest error is logged, and the first
success ends the wait. The failed requests of an engine already declared lost do not count: they
were reissued, and the burst of them says nothing of the engines left.

Off the controller's node (`[placement] scheduler`) it reports each finished sample to the
controller's `sample_sink` actor instead of calling `on_sample`.

With a `seed`, every sample's sampling seed is derived from it and (prompt, index, attempt), so
a run samples the same whatever the completion order (the engine then keeps a generator per
request, about 10% of its time on the tiny model); without, the engine's shared generator samples.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from miles_async.actors.buffer import GroupsDropped, PutGroup
from miles_async.actors.rollout import Rollout, SamplingConfig, failed
from miles_async.actors.teacher import Score
from miles_async.policies.buffer import Group
from miles_async.policies.refill import RefillConfig, RefillPolicy, Submit
from miles_async.runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    Clock,
    Message,
    RealClock,
    RemoteError,
    handler,
)
from miles_async.trajectory import Trajectory, blobs

log = logging.getLogger("miles_async.actors.scheduler")


class SchedulerState(msgspec.Struct, frozen=True, kw_only=True):
    trainer_version: int
    policy_version: int | None
    num_in_flight: int
    num_pending_groups: int
    num_samples_done: int
    num_groups_put: int
    next_new_prompt: int  # the first dataset position never admitted
    unfinished: list[int]  # positions below next_new_prompt admitted and not yet trained or discarded
    exhausted: bool
    admission_idle_s: float
    engine_busy_s: dict[str, float]


class AddEngine(Message, frozen=True):
    name: str
    url: str
    version: int
    actor: str = ""  # an EngineActor's name: workers message it instead of calling `url`


class WeightVersionChanged(Message, frozen=True):
    engine: str
    version: int


class TrainerStepped(Message, frozen=True):
    version: int
    prompt_ids: list[int]


class EngineLost(Message, frozen=True):
    name: str


class GetSchedulerState(Message[SchedulerState], frozen=True):
    """The scheduler's counters and state."""


class HoldRollouts(Message[None], frozen=True):
    """hold=True: send no new rollout requests (in-flight ones finish); False: send what waited."""

    hold: bool


def sample_seed(run_seed: int, prompt_index: int, index: int, attempt: int) -> int:
    return zlib.crc32(f"{run_seed}:{prompt_index}:{index}:{attempt}".encode())


FAIL_STREAK = 16  # failed samples in a row before the scheduler backs off (see `_back_off`)
BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class SampleSeen(Message, frozen=True):
    """To the scheduler's `sample_sink`: a finished sample, and whether it counted (False: a late
    reply from an engine declared lost, traced only)."""

    sample: Trajectory
    counted: bool


class RefillScheduler(Actor):
    """See the module docstring. `dataset[i]` is prompt position i; `on_sample` (a callable, in the
    controller's process) or `sample_sink` (an actor's name, from another process or node) sees
    every finished sample."""

    mailbox_capacity: ClassVar[int] = 4096

    def __init__(self, config: RefillConfig, dataset: list[Any], sampling: SamplingConfig, *,
                 workers: list[str], buffer: str, seed: int | None = None, trainer_version: int = 0, first_prompt: int = 0,
                 retry_prompts: list[int] | None = None,
                 on_sample: Callable[[Trajectory, bool], None] | None = None, clock: Clock | None = None,
                 timeout_s: float = 3600.0, routed_experts: bool = False, sample_sink: str = "",
                 teacher: str = "") -> None:
        if not dataset:
            raise ValueError("the scheduler needs a non-empty dataset of prompts")
        if not workers:
            raise ValueError("the scheduler needs at least one rollout worker")
        self.policy = RefillPolicy(config, trainer_version=trainer_version, first_prompt_id=first_prompt,
                                   retry_prompt_ids=retry_prompts or ())
        self.dataset = dataset
        self.sampling = sampling
        self.worker_names = workers
        self.buffer_name = buffer
        self.seed = seed
        self.on_sample = on_sample
        self.sample_sink = sample_sink
        self.sink: ActorRef | None = None
        self.timeout_s = timeout_s
        self.routed_experts = routed_experts  # MoE: every rollout records its routed experts (R3)
        self.teacher_name = teacher  # distillation: the TeacherScorer that scores every finished sample
        self.teacher: ActorRef | None = None
        self.teacher_failures = 0
        self.clock = clock or RealClock()
        self.workers: list[ActorRef] = []
        self.buffer: ActorRef | None = None
        self.engines: dict[str, tuple[str, int]] = {}  # name -> (url, version)
        self.engine_actors: dict[str, str] = {}  # name -> EngineActor name, for the mailbox path
        self.groups: dict[tuple[int, int], list[Trajectory]] = {}  # (prompt, attempt) -> samples so far
        self.unfinished: set[int] = set()  # prompts admitted and not yet trained or discarded
        self.tasks: set[asyncio.Task] = set()
        self.num_samples_done = 0
        self.num_groups_put = 0
        self.busy_s: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}
        self._next_worker = 0
        self.held: list[Submit] | None = None  # submits kept back while rollouts are held
        self.failed_in_a_row = 0  # samples that failed (error) since the last one that did not

    async def on_start(self) -> None:
        self.workers = [await self.system.lookup(name, timeout_s=60.0) for name in self.worker_names]
        if self.sample_sink:
            self.sink = await self.system.lookup(self.sample_sink, timeout_s=60.0)

    async def on_stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    # ----- events -----

    @handler
    async def add_engine(self, msg: AddEngine) -> None:
        self.engines[msg.name] = (msg.url, msg.version)
        self.engine_actors[msg.name] = msg.actor
        self.busy_s.setdefault(msg.name, 0.0)
        self._dispatch(self.policy.add_engine(msg.name, msg.version, self.clock.now()))

    @handler
    async def weight_version(self, msg: WeightVersionChanged) -> None:
        if msg.engine in self.engines:
            url, _ = self.engines[msg.engine]
            self.engines[msg.engine] = (url, msg.version)
            self._dispatch(self.policy.on_weight_version(msg.engine, msg.version, self.clock.now()))

    @handler
    async def trainer_stepped(self, msg: TrainerStepped) -> None:
        self.unfinished.difference_update(msg.prompt_ids)
        self._dispatch(self.policy.on_trainer_step(msg.version, msg.prompt_ids, self.clock.now()))

    @handler
    async def groups_dropped(self, msg: GroupsDropped) -> None:
        if not msg.retry:
            self.unfinished.difference_update(msg.prompt_ids)
        self._dispatch(self.policy.on_groups_dropped(msg.prompt_ids, retry=msg.retry, now=self.clock.now()))

    @handler
    async def engine_lost(self, msg: EngineLost) -> None:
        if msg.name not in self.engines:
            return
        del self.engines[msg.name]
        self._mark_busy(msg.name, False)
        removed = self.policy.remove_engine(msg.name, self.clock.now())
        log.warning("engine %s lost: %d in-flight samples go to the other engines", msg.name,
                    len(removed.lost_request_ids))
        self._dispatch(removed.submit)

    @handler
    async def hold(self, msg: HoldRollouts) -> None:
        if msg.hold:
            self.held = self.held if self.held is not None else []
        else:
            held, self.held = self.held or [], None
            self._dispatch(held)

    @handler
    async def state(self, msg: GetSchedulerState) -> SchedulerState:
        now = time.monotonic()
        busy = {name: s + (now - self._busy_since[name] if name in self._busy_since else 0.0)
                for name, s in self.busy_s.items()}
        metrics = self.policy.metrics(self.clock.now())
        return SchedulerState(
            trainer_version=self.policy.trainer_version, policy_version=self.policy.policy_version,
            num_in_flight=self.policy.num_in_flight, num_pending_groups=self.policy.num_pending_groups,
            num_samples_done=self.num_samples_done, num_groups_put=self.num_groups_put,
            exhausted=self.policy.exhausted, next_new_prompt=self.policy.next_prompt_id,
            unfinished=sorted(self.unfinished.union(self.policy.retry_prompt_ids)),
            admission_idle_s=metrics.admission_idle_s, engine_busy_s=busy)

    # ----- sending and collecting -----

    def _dispatch(self, submits: list[Submit]) -> None:
        if self.held is not None:
            self.held.extend(submits)
            return
        for submit in submits:
            self.unfinished.add(submit.prompt_id)
            url, version = self.engines[submit.engine]
            worker = self.workers[self._next_worker % len(self.workers)]
            self._next_worker += 1
            msg = Rollout(request_id=submit.request_id, prompt_id=submit.prompt_id, index=submit.index,
                          attempt=submit.attempt, engine=submit.engine, engine_url=url, engine_version=version,
                          engine_actor=self.engine_actors.get(submit.engine, ""),
                          item=self.dataset[submit.prompt_id % len(self.dataset)], sampling=self.sampling,
                          routed_experts=self.routed_experts,
                          seed=None if self.seed is None else sample_seed(self.seed, submit.prompt_id, submit.index,
                                                                         submit.attempt))
            self._mark_busy(submit.engine, True)
            task = asyncio.get_running_loop().create_task(self._run(worker, msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, worker: ActorRef, msg: Rollout) -> None:
        try:
            sample = await worker.ask(msg, timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the worker died or failed: the sample counts as aborted
            if isinstance(e, ActorDeadError) and worker in self.workers and len(self.workers) > 1:
                log.error("rollout worker %s died (%s); the others take its share", worker.name, e)
                self.workers.remove(worker)
            sample = failed(msg, time.time(), 0, "error", f"{type(e).__name__}: {e}")
        if self.policy.owns(sample.request_id):  # not a lost engine's late failures: those say nothing of the others
            await self._back_off(sample)
        await self._collect(sample)

    async def _back_off(self, sample: Trajectory) -> None:
        """Every sample failing (an agent that always raises, a session server refusing, an engine
        answering errors at once) would have the refill resubmit as fast as the failures come:
        past FAIL_STREAK failures in a row each one waits before it is collected (doubling up to
        MAX_BACKOFF_S) and the latest error is logged, until a sample succeeds again."""
        if sample.finish_reason != "error":
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        streak = self.failed_in_a_row
        if streak < FAIL_STREAK:
            return
        if streak & (streak - 1) == 0:  # 16, 32, 64, ...: say so, with the cause
            log.warning("%d samples in a row failed (latest, prompt %d: %s); backing off until one succeeds",
                        streak, sample.prompt_id, sample.error or sample.finish_reason)
        await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (streak // FAIL_STREAK - 1)))

    async def _seen(self, sample: Trajectory, counted: bool) -> None:
        if self.on_sample is not None:
            self.on_sample(sample, counted)
        if self.sink is not None:
            await self.sink.tell(SampleSeen(sample=sample, counted=counted))

    async def _collect(self, sample: Trajectory) -> None:
        if not self.policy.owns(sample.request_id):
            await self._seen(sample, False)  # a lost engine's late reply: traced, not counted
            self.system.dataplane.free(blobs([sample]))
            return
        self.num_samples_done += 1
        submits = self.policy.on_sample_done(sample.request_id, self.clock.now())
        engine_load = self.policy.metrics(self.clock.now()).in_flight_per_engine
        for name, load in engine_load.items():
            self._mark_busy(name, load > 0)
        self._dispatch(submits)  # the slot is refilled before the teacher scores this one
        if self.teacher_name and not sample.aborted:
            sample = await self._score(sample)
        await self._seen(sample, True)
        key = (sample.prompt_id, sample.attempt)
        members = self.groups.setdefault(key, [])
        members.append(sample)
        if len(members) == self.policy.config.group_size:
            del self.groups[key]
            await self._put(sample.prompt_id, sample.attempt, members)

    async def _score(self, sample: Trajectory) -> Trajectory:
        """Distillation: the teacher's log-probs of the sample's tokens (miles_async/actors/teacher.py). A failed
        request fails the sample, as an engine error does (its group is dropped as aborted)."""
        if self.teacher is None:
            self.teacher = await self.system.lookup(self.teacher_name, timeout_s=60.0)
        try:
            return await self.teacher.ask(Score(sample=sample), timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the sample fails, the run goes on
            why = f"{e.failure.type}: {e.failure.message}" if isinstance(e, RemoteError) else f"{type(e).__name__}: {e}"
            # the teacher's death ends the run (the controller's liveness watch names it once): not said per sample
            dead = isinstance(e, ActorDeadError) or (isinstance(e, RemoteError) and e.failure.type == "ActorDeadError")
            self.teacher_failures += 1
            if not dead and self.teacher_failures & (self.teacher_failures - 1) == 0:  # the 1st, 2nd, 4th, ...
                log.warning("the teacher could not score prompt %d (%d failures so far): %s", sample.prompt_id,
                            self.teacher_failures, why)
            self.system.dataplane.free(blobs([sample]))
            return msgspec.structs.replace(sample, finish_reason="error", error=f"teacher: {why}", data=None)

    async def _put(self, prompt_id: int, attempt: int, members: list[Trajectory]) -> None:
        samples = tuple(sorted(members, key=lambda s: s.index))
        if self.buffer is None:  # looked up on first use: the buffer is spawned after this actor
            self.buffer = await self.system.lookup(self.buffer_name, timeout_s=60.0)
        try:
            await self.buffer.ask(PutGroup(group=Group(prompt_id=prompt_id, samples=samples, attempt=attempt)),
                                  timeout_s=self.timeout_s)
        except ActorDeadError as e:  # the buffer is gone: the run is ending, or its node was lost (which
            # the controller's liveness watch reports); nobody will train this group
            log.debug("group of prompt %d not put: %s", prompt_id, e)
            self.system.dataplane.free(blobs(samples))
            return
        self.num_groups_put += 1

    def _mark_busy(self, engine: str, busy: bool) -> None:
        now = time.monotonic()
        if busy and engine not in self._busy_since:
            self._busy_since[engine] = now
        elif not busy and engine in self._busy_since:
            self.busy_s[engine] = self.busy_s.get(engine, 0.0) + now - self._busy_since.pop(engine)
