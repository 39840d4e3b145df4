"""The discrete-event simulation of the RL loop: the real policies, engines and trainer as cost models.

    heap of (time, seq, event) ──► handlers ──► RefillPolicy / BufferPolicy (the loop's own code)
                                      │
        engines (processor sharing: every active sequence advances one token per decode step,
        a step for b sequences taking GenCost.step_s(b)), the trainer (wait for a batch, train,
        export, push in the background, eval), weight pushes (pause, then the new version)

What happens, in the order the real controller does it (miles_async/actors/controller.py):
- The refill policy issues samples to engines; a sample waits `dispatch_s`, then per turn a
  prefill, its decode tokens and its tool time; when it ends the policy frees (and refills) its
  slot, and a group whose n samples are in goes to the buffer policy (accepted, dropped as
  filtered or aborted, or held while the buffer is full until the next draw). With a
  distillation teacher (`teacher_in_flight` > 0) each finished sample is scored first
  (`TeacherCost`, at most that many at once, the rest queued in order); its group goes to the
  buffer once every member is scored.
- The trainer asks the buffer for `batch_groups` groups at its version (stale ones are dropped
  then, and retried or discarded), trains (`TrainCost`), tells the refill policy (the version goes
  up, those groups leave the admission count), exports (`export_s`, waiting for the previous push
  first), starts the push in the background, evaluates if due (a shared eval holds new rollouts),
  and asks for the next batch after `overhead_s`.
- A push pauses generation for its last `paused_s`, then the engines hold the new version: a
  sample in flight gets that version appended (partial "continue") or is aborted ("abort_retry").

Cost modes: "fitted" times every sample with `GenCost` (so concurrency and engine count matter);
"replay" uses each recorded sample's measured duration (and the recorded train times, step by
step), so a replay with the run's own settings retraces the run; samples the trace lacks fall
back to the fitted model.

Time is a float of seconds on this simulator's own clock (`Simulator.now()`, what the policies
are given); nothing sleeps. Try it:

    from miles_async.sim import load_trace, fit_costs, simulate, SimConfig, RecordedWorkload
    trace = load_trace("runs/x/trace.jsonl")
    result = simulate(SimConfig.from_header(trace.header, num_steps=50), fit_costs(trace), RecordedWorkload(trace))
    print(result.stats)
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from typing import Literal

import msgspec

from miles_async.observe.records import TRACE_SCHEMA, EvalTrace, RunTrace, SampleTrace, StepTrace, UpdateTrace
from miles_async.policies import (
    BufferConfig,
    BufferPolicy,
    Group,
    RefillConfig,
    RefillPolicy,
    Submit,
)
from miles_async.sim.costs import CostModel
from miles_async.sim.plot import Interval
from miles_async.sim.report import RunStats, StepRecord, summarize
from miles_async.sim.workload import SampleSpec, Workload
from miles_async.trajectory import Trajectory, VersionSpan

MODES = {"sync": 0, "one_step_off": 1}
_CHOICES = {"mode": ("sync", "one_step_off", "async"), "refill": ("sample", "group"),
            "partial": ("continue", "abort_retry"), "filter": ("nonzero_std", "none"),
            "on_stale": ("retry", "discard"), "on_abort": ("retry", "discard"), "costs": ("fitted", "replay")}
# A run that trains nothing in this many batches' worth of samples is dropping everything.
_STALL_BATCHES = 200


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The what-if settings; names and meanings as in the recipe (rollout.*, loop.*, buffer.*).

    mode: "sync" (staleness 0), "one_step_off" (1) or "async" (`max_staleness`).
    eval_every: a shared evaluation (lasting CostModel.eval_s) after every k-th step; 0: none.
    costs: "fitted" (cost models) or "replay" (recorded durations where the trace has them).
    """

    num_engines: int = 1
    trainer_world_size: int = 1
    mode: Literal["sync", "one_step_off", "async"] = "async"
    max_staleness: int = 1
    group_size: int = 8
    batch_groups: int = 8
    target_in_flight: int = 64
    max_in_flight_per_engine: int | None = None
    refill: Literal["sample", "group"] = "sample"
    partial: Literal["continue", "abort_retry"] = "continue"
    capacity_groups: int = 64
    filter: Literal["nonzero_std", "none"] = "nonzero_std"
    on_stale: Literal["retry", "discard"] = "retry"
    on_abort: Literal["retry", "discard"] = "retry"
    eval_every: int = 0
    num_steps: int = 100
    costs: Literal["fitted", "replay"] = "fitted"
    teacher_in_flight: int = 0  # distillation: the teacher's scoring requests at once (0: no teacher stage)

    def __post_init__(self) -> None:
        for field in ("num_engines", "trainer_world_size", "group_size", "batch_groups", "target_in_flight",
                      "capacity_groups", "num_steps"):
            if getattr(self, field) < 1:
                raise ValueError(f"SimConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.max_staleness < 0 or self.eval_every < 0 or self.teacher_in_flight < 0:
            raise ValueError("SimConfig.max_staleness, eval_every and teacher_in_flight must be >= 0")
        for field, choices in _CHOICES.items():
            if getattr(self, field) not in choices:
                raise ValueError(f"SimConfig.{field} must be one of {', '.join(choices)}, got {getattr(self, field)!r}")
        if self.max_in_flight_per_engine is not None and self.max_in_flight_per_engine < 1:
            raise ValueError(f"SimConfig.max_in_flight_per_engine must be >= 1 or None, got "
                             f"{self.max_in_flight_per_engine}")
        if self.batch_groups > self.capacity_groups:
            raise ValueError(f"SimConfig.batch_groups ({self.batch_groups}) > capacity_groups "
                             f"({self.capacity_groups}): a batch could never be drawn")

    @property
    def staleness(self) -> int:
        return MODES.get(self.mode, self.max_staleness)

    @classmethod
    def from_header(cls, header: RunTrace, **changes: object) -> SimConfig:
        """The recorded run's own settings (its evals count only when they were shared)."""
        fields = {f: getattr(header, f) for f in cls.__struct_fields__ if hasattr(header, f)}
        fields["eval_every"] = header.eval_every if header.eval_mode == "shared" else 0
        fields["num_steps"] = max(header.num_steps, 1)
        fields.update(changes)
        return msgspec.convert(fields, cls)

    def header(self, *, source: str = "synthetic") -> RunTrace:
        return RunTrace(schema=TRACE_SCHEMA, start_s=0.0, source=source,
                        num_engines=self.num_engines, trainer_world_size=self.trainer_world_size, mode=self.mode,
                        max_staleness=self.staleness, group_size=self.group_size, batch_groups=self.batch_groups,
                        target_in_flight=self.target_in_flight, max_in_flight_per_engine=self.max_in_flight_per_engine,
                        refill=self.refill, partial=self.partial, capacity_groups=self.capacity_groups,
                        filter=self.filter, on_stale=self.on_stale, on_abort=self.on_abort,
                        eval_mode="shared" if self.eval_every else "none", eval_every=self.eval_every,
                        num_steps=self.num_steps, transport="simulated", teacher_in_flight=self.teacher_in_flight)


class SimResult(msgspec.Struct, kw_only=True):
    """stats: the summary (`report.RunStats`). wall_s / num_events: the simulator's own cost.
    intervals, versions, records: the timeline and a trace of the simulated run (when recorded)."""

    config: SimConfig
    costs: CostModel
    stats: RunStats
    wall_s: float
    num_events: int
    intervals: list[Interval] = []
    versions: list[tuple[float, int]] = []
    records: list = []


# Event codes (the heap holds (time, seq, code, object, generation)).
_TICK, _START, _FINISH, _TRAIN_DONE, _EXPORT_DONE, _PAUSE, _COMMIT, _EVAL_DONE, _ASK, _SCORED = range(10)


class _Sample:
    __slots__ = (
        "attempt",
        "engine",
        "finish_work",
        "index",
        "issue_t",
        "loaded",
        "prompt_id",
        "request_id",
        "spec",
        "state",
        "tokens_left",
        "turn_tool_s",
        "turns_left",
        "versions",
    )

    def __init__(self, submit: Submit, engine: _Engine, spec: SampleSpec, t: float) -> None:
        self.request_id = submit.request_id
        self.prompt_id = submit.prompt_id
        self.index = submit.index
        self.attempt = submit.attempt
        self.engine = engine
        self.spec = spec
        self.versions = [engine.version]
        self.issue_t = t
        # Turns of whole tokens summing to output_tokens (the first ones one longer), none empty.
        self.turns_left = max(1, min(spec.num_turns, spec.output_tokens))
        self.tokens_left = spec.output_tokens
        self.turn_tool_s = spec.tool_s / self.turns_left
        self.finish_work = 0.0
        self.state = 0  # 0 waiting (dispatch, prefill, tool), 1 decoding, 2 done
        self.loaded = False  # counted in its engine's load (in flight there, not in a tool call)


class _Engine:
    """Processor sharing: `work` counts decode steps done (tokens per active sequence) since start;
    a sequence that started at work w with k tokens to go finishes at work w + k. A step costs
    `GenCost.step_s(load)`, `load` being the samples in flight on the engine less those in a tool
    call: the same count the fit measured from the trace (submit to end, per engine)."""

    __slots__ = (
        "active",
        "busy_s",
        "busy_since",
        "gen",
        "issued",
        "lane_count",
        "lane_t",
        "last_t",
        "load",
        "name",
        "num_decoding",
        "paused",
        "tick_t",
        "version",
        "work",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0
        self.active: list[tuple[float, int, _Sample]] = []  # heap by finish work
        self.num_decoding = 0
        self.load = 0
        self.work = 0.0
        self.last_t = 0.0
        self.paused = False
        self.gen = 0
        self.tick_t: float | None = None  # when the valid pending wake-up is due
        self.issued: set[_Sample] = set()
        self.busy_since: float | None = None
        self.busy_s = 0.0
        self.lane_t = 0.0
        self.lane_count = 0


class Simulator:
    def __init__(self, config: SimConfig, costs: CostModel, workload: Workload, *, record: bool = False,
                 train_s_by_step: dict[int, float] | None = None) -> None:
        self.config = config
        self.costs = costs
        self.workload = workload
        self.record = record
        self.train_s_by_step = train_s_by_step or {}
        k = config.staleness
        self.refill = RefillPolicy(RefillConfig(
            target_in_flight=config.target_in_flight, group_size=config.group_size, batch_groups=config.batch_groups,
            max_staleness=k, max_in_flight_per_engine=config.max_in_flight_per_engine, refill=config.refill))
        self.buffer = BufferPolicy(BufferConfig(capacity_groups=config.capacity_groups, max_staleness=k,
                                                on_stale=config.on_stale, on_abort=config.on_abort,
                                                filter=config.filter))
        self.t = 0.0
        self.heap: list = []
        self.seq = 0
        self.num_events = 0
        self.engines = {f"engine-{i}": _Engine(f"engine-{i}") for i in range(config.num_engines)}
        self.requests: dict[int, _Sample] = {}
        self.partial: dict[tuple[int, int], list[Trajectory]] = {}
        self.waiting_puts: deque[Group] = deque()
        self.held: list[Submit] | None = None
        self.version = 0
        self.trainer_state = "ask"
        self.ask_t = 0.0
        self.batch: list[Group] = []
        self.train_start = 0.0
        self.export_start = 0.0
        self.push_version: int | None = None
        self.steps: list[StepRecord] = []
        self.dropped: Counter[str] = Counter()
        self.num_generated = 0
        self.intervals: list[Interval] = []
        self.versions: list[tuple[float, int]] = []
        self.records: list = []
        self.done = False
        self.training = False  # the trainer is training: generation may be slower (GenCost.shared_*)
        g = costs.gen
        self._a, self._c = g.token_s, g.token_s_per_seq
        self._train_a, self._train_c = g.token_s + g.shared_token_s, g.token_s_per_seq + g.shared_token_s_per_seq
        self.shared = costs.gen.shared_token_s > 0 or costs.gen.shared_token_s_per_seq > 0
        self._busy_at_first: dict[str, float] = {}
        self._generated_at_step = 0
        self._stall_samples = _STALL_BATCHES * config.batch_groups * config.group_size
        self._pending_tokens = 0
        self.push_start = 0.0
        self.eval_start = 0.0
        self.scoring = 0  # distillation: teacher requests out, and samples waiting for one
        self.score_queue: deque[tuple[Trajectory, SampleTrace | None, float]] = deque()

    def now(self) -> float:
        """The virtual clock the policies read."""
        return self.t

    # ----- the loop -----

    def run(self) -> SimResult:
        start = time.perf_counter()
        for engine in self.engines.values():
            self._issue(self.refill.add_engine(engine.name, version=0, now=self.t))
        self._ask_batch()
        handlers = (self._tick, self._start, self._finish, self._train_done, self._export_done, self._pause,
                    self._commit, self._eval_done, self._overhead_done, self._scored)
        heap, pop = self.heap, heapq.heappop
        while heap and not self.done:
            t, _, code, obj, gen = pop(heap)
            self.t = t
            self.num_events += 1
            handlers[code](obj, gen)
        if not self.done:
            raise RuntimeError(f"the simulation stalled after {len(self.steps)} of {self.config.num_steps} steps "
                               f"at t={self.t:.3f}s: nothing left to happen ({self._stall_hint()})")
        end = self.t
        if self.record:
            self._close_lanes(end)
        busy = {e.name: e.busy_s + (end - e.busy_since if e.busy_since is not None else 0.0)
                for e in self.engines.values()}
        stats = summarize(self.steps, busy_s_total=sum(busy.values()), busy_s_before_first=self._busy_at_first,
                          num_engines=len(self.engines), dropped=dict(self.dropped),
                          samples_generated=self.num_generated)
        return SimResult(config=self.config, costs=self.costs, stats=stats, wall_s=time.perf_counter() - start,
                         num_events=self.num_events, intervals=self.intervals, versions=self.versions,
                         records=self.records)

    def _stall_hint(self) -> str:
        return (f"{self.refill.num_in_flight} samples in flight, {self.buffer.num_groups} groups in the buffer, "
                f"{len(self.waiting_puts)} waiting for room, trainer {self.trainer_state}; is batch_groups larger than "
                "what admission or the buffer can ever hold?")

    def _at(self, t: float, code: int, obj: object = None, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, code, obj, gen))

    # ----- rollout -----

    def _issue(self, submits: list[Submit]) -> None:
        if self.held is not None:
            self.held.extend(submits)
            return
        gen = self.costs.gen
        for submit in submits:
            engine = self.engines[submit.engine]
            spec = self.workload.spec(submit.prompt_id, submit.index, submit.attempt)
            sample = _Sample(submit, engine, spec, self.t)
            self.requests[submit.request_id] = sample
            self._mark_issued(engine, sample, True)
            self._load(sample, True)
            if self.config.costs == "replay" and spec.duration_s is not None:
                self._at(self.t + gen.dispatch_s + spec.duration_s, _FINISH, sample)
            else:
                self._at(self.t + gen.dispatch_s + gen.prefill_s, _START, sample)

    def _start(self, sample: _Sample, _gen: int) -> None:
        """A turn's decoding begins on the sample's engine."""
        if sample.state == 2:
            return  # aborted while waiting
        engine = sample.engine
        self._advance(engine)
        if not sample.loaded:  # back from a tool call
            sample.loaded = True
            engine.load += 1
        sample.state = 1
        turn_tokens = -(-sample.tokens_left // sample.turns_left)  # ceil: the remainder goes first
        sample.tokens_left -= turn_tokens
        sample.finish_work = engine.work + turn_tokens
        heapq.heappush(engine.active, (sample.finish_work, sample.request_id, sample))
        engine.num_decoding += 1
        self._schedule(engine)

    def _step_s(self, engine: _Engine) -> float:
        """`GenCost.step_s` for the engine now, inlined (it is asked several times per turn)."""
        n = engine.load if engine.load > engine.num_decoding else engine.num_decoding  # noqa: FURB136 - hot: no call
        return self._train_a + self._train_c * n if self.training else self._a + self._c * n

    def _advance(self, engine: _Engine) -> None:
        if engine.num_decoding and not engine.paused:
            engine.work += (self.t - engine.last_t) / self._step_s(engine)
        engine.last_t = self.t

    def _schedule(self, engine: _Engine) -> None:
        """Make sure the engine wakes by its next finish. A pending wake-up that is no later is kept
        (it may come early: `_tick` then finds nothing done and schedules again), which spares a
        heap entry per load change: an engine's load changes with every sample it starts or ends."""
        active = engine.active
        while active and active[0][2].state != 1:
            heapq.heappop(active)  # aborted
        if not active or engine.paused:
            return
        left = active[0][0] - engine.work
        at = self.t + left * self._step_s(engine) if left > 0 else self.t
        if engine.tick_t is not None and engine.tick_t <= at:
            return
        engine.gen += 1
        engine.tick_t = at
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, _TICK, engine, engine.gen))

    def _tick(self, engine: _Engine, gen: int) -> None:
        if gen != engine.gen:
            return  # rescheduled since
        engine.tick_t = None
        self._advance(engine)
        active = engine.active
        limit = engine.work + 1e-9
        while active and active[0][0] <= limit:
            _, _, sample = heapq.heappop(active)
            if sample.state != 1:
                continue
            engine.num_decoding -= 1
            sample.state = 0
            sample.turns_left -= 1
            delay = sample.turn_tool_s + (self.costs.gen.prefill_s if sample.turns_left else 0.0)
            if sample.turn_tool_s > 0:
                sample.loaded = False  # off the engine while its tool runs
                engine.load -= 1
            if sample.turns_left or delay > 0:
                self.seq += 1
                heapq.heappush(self.heap, (self.t + delay, self.seq, _START if sample.turns_left else _FINISH, sample, 0))
            else:
                self._finish(sample, 0)
        self._schedule(engine)

    def _finish(self, sample: _Sample, _gen: int, *, aborted: bool = False) -> None:
        if sample.state == 2:
            return
        sample.state = 2
        engine = sample.engine
        self._load(sample, False)
        self._mark_issued(engine, sample, False)
        del self.requests[sample.request_id]
        self.num_generated += 1
        spec = sample.spec
        trace = None
        if self.record:
            trace = SampleTrace(
                prompt_id=sample.prompt_id, index=sample.index, attempt=sample.attempt, engine=engine.name,
                submit_s=sample.issue_t + self.costs.gen.dispatch_s, end_s=self.t, prompt_tokens=spec.prompt_tokens,
                output_tokens=spec.output_tokens, versions=list(sample.versions), reward=spec.reward,
                finish_reason="abort" if aborted else "stop", num_turns=spec.num_turns, tool_s=spec.tool_s)
        # The simulator knows which versions a sample saw, not at which tokens: empty spans, in order.
        end = spec.prompt_tokens + spec.output_tokens
        record = Trajectory(prompt_id=sample.prompt_id, index=sample.index, attempt=sample.attempt,
                            versions=tuple(VersionSpan(v, end, end) for v in sample.versions), reward=spec.reward,
                            finish_reason="abort" if aborted else "stop", num_tokens=end,
                            num_prompt_tokens=spec.prompt_tokens, num_generated_tokens=spec.output_tokens)
        self._issue(self.refill.on_sample_done(sample.request_id, self.t))
        if self.num_generated - self._generated_at_step > self._stall_samples:
            raise RuntimeError(
                f"no train step in the last {self.num_generated - self._generated_at_step} samples (step "
                f"{len(self.steps)} of {self.config.num_steps}, t={self.t:.3f}s): every group is dropped "
                f"({dict(self.dropped)}); with filter=nonzero_std a group whose rewards are all equal is dropped")
        if self.config.teacher_in_flight and not aborted:  # the slot is refilled; the teacher scores it now
            self.score_queue.append((record, trace, self.t))
            self._score_next()
            return
        if trace is not None:
            self.records.append(trace)
        self._grouped(record)

    def _grouped(self, record: Trajectory) -> None:
        key = (record.prompt_id, record.attempt)
        members = self.partial.setdefault(key, [])
        members.append(record)
        if len(members) == self.config.group_size:
            del self.partial[key]
            members.sort(key=lambda r: r.index)
            self._put(Group(prompt_id=record.prompt_id, samples=tuple(members), attempt=record.attempt))

    # ----- distillation: the teacher's scoring stage -----

    def _score_next(self) -> None:
        """Start scoring queued samples while fewer than teacher_in_flight requests are out."""
        while self.score_queue and self.scoring < self.config.teacher_in_flight:
            record, trace, queued_t = self.score_queue.popleft()
            self.scoring += 1
            score_s = self.costs.teacher.score_s(record.num_tokens)
            if trace is not None:
                trace = msgspec.structs.replace(trace, teacher_s=score_s, teacher_wait_s=self.t - queued_t)
            self._at(self.t + score_s, _SCORED, (record, trace))

    def _scored(self, obj: object, _gen: int) -> None:
        record, trace = obj  # type: ignore[misc]
        self.scoring -= 1
        if trace is not None:
            self.records.append(trace)
        self._grouped(record)
        self._score_next()

    def _load(self, sample: _Sample, on: bool) -> None:
        """A sample joins or leaves its engine's load: the decode rate changes, so reschedule."""
        if sample.loaded == on:
            return
        engine = sample.engine
        self._advance(engine)
        sample.loaded = on
        engine.load += 1 if on else -1
        self._schedule(engine)

    def _mark_issued(self, engine: _Engine, sample: _Sample, issued: bool) -> None:
        if self.record:
            self._lane(engine)
        if issued:
            engine.issued.add(sample)
            if engine.busy_since is None:
                engine.busy_since = self.t
        else:
            engine.issued.discard(sample)
            if not engine.issued and engine.busy_since is not None:
                engine.busy_s += self.t - engine.busy_since
                engine.busy_since = None
        if self.record:
            engine.lane_count = len(engine.issued)

    def _lane(self, engine: _Engine) -> None:
        if engine.lane_count and self.t > engine.lane_t:
            self.intervals.append(Interval(lane=engine.name, start=engine.lane_t, end=self.t, kind="generate",
                                           value=float(engine.lane_count)))
        engine.lane_t = self.t

    def _close_lanes(self, end: float) -> None:
        for engine in self.engines.values():
            self.t = end
            self._lane(engine)

    # ----- buffer -----

    def _put(self, group: Group) -> None:
        decision = self.buffer.put(group, self.t)
        if decision.status == "accepted":
            self._ask_batch()
        elif decision.status == "dropped":
            self.dropped[decision.reason or "aborted"] += 1
            self._issue(self.refill.on_groups_dropped([group.prompt_id], retry=decision.retry, now=self.t))
        else:
            self.waiting_puts.append(group)

    # ----- trainer -----

    def _ask_batch(self) -> None:
        if self.trainer_state != "ask":
            return
        drawn = self.buffer.get(self.config.batch_groups, self.version, self.t)
        if drawn.retry or drawn.discarded:
            self.dropped["stale"] += len(drawn.retry) + len(drawn.discarded)
            if drawn.retry:
                self._issue(self.refill.on_groups_dropped(drawn.retry, retry=True, now=self.t))
            if drawn.discarded:
                self._issue(self.refill.on_groups_dropped(drawn.discarded, retry=False, now=self.t))
        if not drawn.groups:
            return
        self.batch = drawn.groups
        self.trainer_state = "train"
        self.train_start = self.t
        num_tokens = sum(s.num_tokens for g in drawn.groups for s in g.samples)
        step = len(self.steps) + 1
        train_s = self.train_s_by_step.get(step)
        if train_s is None:
            train_s = self.costs.train.train_s(num_tokens, self.config.trainer_world_size)
        self._pending_tokens = num_tokens
        self._set_training(True)
        self._at(self.t + train_s, _TRAIN_DONE)
        while self.waiting_puts and not self.buffer.full:  # room again: the held groups go in, in order
            self._put(self.waiting_puts.popleft())

    def _set_training(self, on: bool) -> None:
        """Every engine's decode rate changes with the trainer's state when they share hardware."""
        if not self.shared:
            self.training = on
            return
        for engine in self.engines.values():
            self._advance(engine)
        self.training = on
        for engine in self.engines.values():
            self._schedule(engine)

    def _train_done(self, _obj: object, _gen: int) -> None:
        self._set_training(False)
        self._generated_at_step = self.num_generated
        self.version += 1
        groups, self.batch = self.batch, []
        staleness = [g.staleness(self.version - 1) for g in groups]
        step = StepRecord(step=len(self.steps) + 1, ask_s=self.ask_t, train_start_s=self.train_start, train_end_s=self.t,
                          num_samples=sum(len(g.samples) for g in groups), num_tokens=self._pending_tokens,
                          staleness=staleness, prompt_ids=[g.prompt_id for g in groups])
        self.steps.append(step)
        if len(self.steps) == 1:
            self._busy_at_first = {e.name: e.busy_s + (self.t - e.busy_since if e.busy_since is not None else 0.0)
                                   for e in self.engines.values()}
        if self.record:
            self.intervals.append(Interval(lane="trainer", start=self.ask_t, end=self.train_start, kind="wait_data"))
            self.intervals.append(Interval(lane="trainer", start=self.train_start, end=self.t, kind="train"))
        self._issue(self.refill.on_trainer_step(self.version, [g.prompt_id for g in groups], self.t))
        if len(self.steps) >= self.config.num_steps:
            self.done = True
            if self.record:
                self._record_step(self.t)
            return
        self.trainer_state = "export"
        self.export_start = self.t
        self._at(self.t + self.costs.update.export_s, _EXPORT_DONE)

    def _export_done(self, _obj: object, _gen: int) -> None:
        if self.push_version is not None:
            self.trainer_state = "settle"  # one push at a time, in version order: the commit resumes us
            return
        self._start_push()

    def _start_push(self) -> None:
        update = self.costs.update
        self.push_version = self.version
        if self.record:
            self.intervals.append(Interval(lane="trainer", start=self.export_start, end=self.t, kind="export"))
            self.intervals.append(Interval(lane="weights", start=self.t, end=self.t + update.push_s, kind="push"))
            self._record_step(self.export_start)
        if update.paused_s > 0 and self.config.costs != "replay":
            self._at(self.t + update.push_s - update.paused_s, _PAUSE, self.version)
        self._at(self.t + update.push_s, _COMMIT, self.version)
        self.push_start = self.t
        self.trainer_state = "pushed"
        self._after_update()

    def _record_step(self, export_start: float) -> None:
        """The last step's trace record, written once its update is under way (or the run is over)."""
        step = self.steps[-1]
        self.records.append(StepTrace(
            step=step.step, weight_version=self.version, start_s=step.ask_s, end_s=self.t,
            wait_data_s=step.train_start_s - step.ask_s, train_s=step.train_end_s - step.train_start_s,
            update_s=self.t - export_start, num_samples=step.num_samples, num_tokens=step.num_tokens,
            staleness_mean=sum(step.staleness) / len(step.staleness), staleness_max=max(step.staleness),
            prompt_ids=list(step.prompt_ids), train_end_s=step.train_end_s))

    def _after_update(self) -> None:
        every = self.config.eval_every
        if every and len(self.steps) % every == 0:
            if self.push_version is not None:
                self.trainer_state = "eval_settle"  # evaluate the weights just trained: wait for the push
                return
            self.trainer_state = "eval"
            self.eval_start = self.t
            self.held = self.held if self.held is not None else []
            self._at(self.t + self.costs.eval_s, _EVAL_DONE)
            return
        self.trainer_state = "overhead"
        self._at(self.t + self.costs.train.overhead_s, _ASK)

    def _eval_done(self, _obj: object, _gen: int) -> None:
        held, self.held = self.held or [], None
        if self.record:
            self.intervals.append(Interval(lane="trainer", start=self.eval_start, end=self.t, kind="eval"))
            self.records.append(EvalTrace(step=len(self.steps), score=0.0, num_samples=0, mode="shared",
                                          start_s=self.eval_start, end_s=self.t))
        self._issue(held)
        self.trainer_state = "overhead"
        self._at(self.t + self.costs.train.overhead_s, _ASK)

    def _overhead_done(self, _obj: object, _gen: int) -> None:
        self.trainer_state = "ask"
        self.ask_t = self.t
        self._ask_batch()

    # ----- weight updates -----

    def _pause(self, _version: int, _gen: int) -> None:
        for engine in self.engines.values():
            self._advance(engine)
            engine.paused = True
            engine.gen += 1  # its next tick is off until the commit
            engine.tick_t = None
            if self.record and engine.lane_count:
                self.intervals.append(Interval(lane=engine.name, start=self.t,
                                               end=self.t + self.costs.update.paused_s, kind="paused"))

    def _commit(self, version: int, _gen: int) -> None:
        abort = self.config.partial == "abort_retry"
        if self.record:
            self.versions.append((self.t, version))
            self.records.append(UpdateTrace(version=version, start_s=self.push_start, end_s=self.t,
                                            transport="simulated", num_bytes=0,
                                            paused_s=self.costs.update.paused_s))
        # Every engine takes the version first; only then are the samples that were in flight
        # aborted (their slots refill at once, and must not land on an engine still to be updated).
        in_flight: list[_Sample] = []
        for engine in self.engines.values():
            self._advance(engine)
            engine.paused = False
            engine.version = version
            in_flight.extend(engine.issued)
        in_flight.sort(key=lambda sample: sample.request_id)
        for sample in in_flight:
            if abort:
                if sample.state == 1:
                    sample.engine.num_decoding -= 1
                self._finish(sample, 0, aborted=True)
            elif sample.versions[-1] != version:
                sample.versions.append(version)
        for engine in self.engines.values():
            self._schedule(engine)
        for engine in self.engines.values():
            self._issue(self.refill.on_weight_version(engine.name, version, self.t))
        self.push_version = None
        if self.trainer_state == "settle":
            self._start_push()
        elif self.trainer_state == "eval_settle":
            self._after_update()


def simulate(config: SimConfig, costs: CostModel, workload: Workload, *, record: bool = False,
             train_s_by_step: dict[int, float] | None = None) -> SimResult:
    """Run the loop under `config` until `config.num_steps` steps are trained; see the module docstring."""
    return Simulator(config, costs, workload, record=record, train_s_by_step=train_s_by_step).run()
