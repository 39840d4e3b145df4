"""Cost models: how long generation, a train step and a weight update take, fitted from a trace.

The simulator replaces engines, trainer ranks and weight pushers with these. Each is a few
numbers with a physical meaning, so a fitted model can be read, checked and edited by hand
(`miles-async sim TRACE --json` prints it) and a synthetic scenario can be written as one.

Generation (`GenCost`): an engine decodes its active sequences together (continuous batching);
one decode step for a batch of `b` sequences takes `token_s + token_s_per_seq * b` seconds and
gives each of them one token, so every sequence on an engine advances at the same rate
(processor sharing). A sample first waits `dispatch_s` (scheduler to engine) and `prefill_s`
(per turn), then decodes its output tokens; a multi-turn episode spends `tool_s` outside the
engine between turns (its own, from the workload). Fitted by non-negative least squares on every
recorded sample:

    duration - tool_s - paused = prefill_s * turns + tokens * (token_s + token_s_per_seq * b)
                                 + tokens * f * (shared_token_s + shared_token_s_per_seq * b)

where `b` is the time-averaged number of samples in flight on its engine over its lifetime (from
the trace itself), `paused` the part of its lifetime that weight updates paused generation (the
simulator adds those pauses back itself) and `f` the fraction of it during which the trainer
trained. The `shared_*` terms are what training costs generation when the two share hardware
(colocated engines, or this CPU machine, where trainer and engine share two cores); with separate
GPU pools they fit to about 0. A trace recorded in sync mode (nothing overlaps) cannot show them. `dispatch_s` is the median gap between what frees a slot or opens admission
(a sample ending, an update committing, a step ending) and the submit that follows.

Training (`TrainCost`): `base_s + per_token_s * tokens * fit_world_size / world_size` per step
(data-parallel ranks split the token-proportional work; `base_s` is not split), plus
`overhead_s` of controller work between a step's update and the next batch request. Fitted by
least squares on the recorded steps (the first, a warm-up, is left out when there are others).

Distillation (`TeacherCost`): the teacher scores each finished sample in `request_s + token_s *
tokens` (prompt and output), at most `SimConfig.teacher_in_flight` requests at once (the run's
`teacher.max_in_flight`), the rest queued in order; a group reaches the buffer once all its
samples are scored. Fitted by non-negative least squares on the recorded samples' `teacher_s`
(each request's time as measured, so the teacher's own batching of concurrent requests is in the
fitted numbers, not modelled: in sample for the run's concurrency).

Weight updates (`UpdateCost`): the trainer is blocked `export_s` per step; the push then runs in
the background for `push_s`, generation pauses for the last `paused_s` of it, and the engines
hold the new version at its end. Medians of the recorded updates. `eval_s`: a shared evaluation's
duration (medians of recorded evals that have times).

Try it: `python -c "from miles_async.sim import load_trace, fit_costs; print(fit_costs(load_trace('runs/x/trace.jsonl')))"`.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from itertools import combinations

import msgspec

from miles_async.sim.trace import Trace

# Sample finishes that say nothing about generation speed.
_NOT_TIMED = ("abort", "error", "reward_error")


def _check_nonneg(obj: msgspec.Struct, fields: tuple[str, ...]) -> None:
    for field in fields:
        value = getattr(obj, field)
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"{type(obj).__name__}.{field} must be >= 0 seconds, got {value}")


class GenCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    dispatch_s: float = 0.0
    prefill_s: float = 0.0
    token_s: float = 0.01
    token_s_per_seq: float = 0.0
    shared_token_s: float = 0.0
    shared_token_s_per_seq: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self, ("dispatch_s", "prefill_s", "token_s", "token_s_per_seq", "shared_token_s",
                             "shared_token_s_per_seq"))
        if self.token_s <= 0 and self.token_s_per_seq <= 0:
            raise ValueError("GenCost needs token_s > 0 or token_s_per_seq > 0: a decode step cannot take no time")

    def step_s(self, batch: int, training: bool = False) -> float:
        """Seconds of one decode step for `batch` sequences (`training`: while the trainer trains)."""
        step = self.token_s + self.token_s_per_seq * batch
        if training:
            step += self.shared_token_s + self.shared_token_s_per_seq * batch
        return step


class TrainCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    base_s: float = 0.0
    per_token_s: float = 1e-4
    fit_world_size: int = 1
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self, ("base_s", "per_token_s", "overhead_s"))
        if self.fit_world_size < 1:
            raise ValueError(f"TrainCost.fit_world_size must be >= 1, got {self.fit_world_size}")

    def train_s(self, num_tokens: int, world_size: int) -> float:
        return self.base_s + self.per_token_s * num_tokens * self.fit_world_size / world_size


class UpdateCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    export_s: float = 0.0
    push_s: float = 0.0
    paused_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self, ("export_s", "push_s", "paused_s"))
        if self.paused_s > self.push_s:
            raise ValueError(f"UpdateCost.paused_s ({self.paused_s}) cannot exceed push_s ({self.push_s}): "
                             "generation pauses within the push")


class TeacherCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    request_s: float = 0.0
    token_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self, ("request_s", "token_s"))

    def score_s(self, num_tokens: int) -> float:
        return self.request_s + self.token_s * num_tokens


class CostModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gen: GenCost = GenCost()
    train: TrainCost = TrainCost()
    update: UpdateCost = UpdateCost()
    eval_s: float = 0.0
    teacher: TeacherCost = TeacherCost()

    def __post_init__(self) -> None:
        _check_nonneg(self, ("eval_s",))


# ----- fitting -----

def fit_costs(trace: Trace) -> CostModel:
    """The cost model of a recorded (or synthetic) trace; see the module docstring."""
    return CostModel(gen=fit_gen(trace), train=fit_train(trace), update=fit_update(trace), eval_s=_fit_eval(trace),
                     teacher=fit_teacher(trace))


def engine_concurrency(trace: Trace) -> dict[tuple[int, int, int], float]:
    """Per sample key (prompt_id, index, attempt): the time-averaged number of samples in flight on
    its engine (itself included) over its lifetime, from the submit/end times of the trace."""
    by_engine: dict[str, list] = defaultdict(list)
    for s in trace.samples:
        if not s.dropped:
            by_engine[s.engine].append(s)
    out: dict[tuple[int, int, int], float] = {}
    for samples in by_engine.values():
        out.update(_mean_in_flight(samples))
    return out


def _mean_in_flight(samples: list) -> dict[tuple[int, int, int], float]:
    """For one engine's samples: each one's time-averaged count in flight over its lifetime."""
    # The count is a step function; `areas[i]` is its integral up to change i, `counts[i]` its
    # value after change i.
    changes = sorted([(s.submit_s, 1) for s in samples] + [(s.end_s, -1) for s in samples])
    times, areas, counts = [], [], []
    count, area, last = 0, 0.0, changes[0][0]
    for t, delta in changes:
        area += count * (t - last)
        count += delta
        last = t
        times.append(t)
        areas.append(area)
        counts.append(count)

    def area_at(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        return areas[i] + counts[i] * (t - times[i]) if i >= 0 else 0.0

    out = {}
    for s in samples:
        span = s.end_s - s.submit_s
        if span > 0:
            mean = (area_at(s.end_s) - area_at(s.submit_s)) / span
        else:
            mean = float(counts[max(0, bisect.bisect_right(times, s.submit_s) - 1)])
        out[(s.prompt_id, s.index, s.attempt)] = max(mean, 1.0)
    return out


def fit_gen(trace: Trace) -> GenCost:
    concurrency = engine_concurrency(trace)
    paused = _overlap([(u.end_s - u.paused_s, u.end_s) for u in trace.updates if u.paused_s > 0])
    training = _overlap([((s.train_end_s or s.end_s) - s.train_s, s.train_end_s or s.end_s) for s in trace.steps])
    rows, targets = [], []
    for s in trace.samples:
        if s.dropped or s.finish_reason in _NOT_TIMED or s.output_tokens <= 0:
            continue
        b = concurrency[(s.prompt_id, s.index, s.attempt)]
        span = s.end_s - s.submit_s
        shared = training(s.submit_s, s.end_s) / span if span > 0 else 0.0  # the part of its life the trainer trained
        tokens = float(s.output_tokens)
        rows.append((float(s.num_turns), tokens, tokens * b, tokens * shared, tokens * b * shared))
        # The simulator pauses generation for each update itself: what the pauses cost this
        # sample is taken out here, or it would be counted twice.
        targets.append(max(s.end_s - s.submit_s - s.tool_s - paused(s.submit_s, s.end_s), 0.0))
    if not rows:
        raise ValueError(f"{trace.path}: no completed samples to fit generation time from")
    prefill_s, token_s, token_s_per_seq, shared_token_s, shared_token_s_per_seq = nnls(rows, targets)
    if token_s <= 0 and token_s_per_seq <= 0:  # degenerate (e.g. every sample one token): all per-token
        token_s = statistics.fmean(t / r[1] for r, t in zip(rows, targets))
        prefill_s = shared_token_s = shared_token_s_per_seq = 0.0
    return GenCost(dispatch_s=_dispatch_gap(trace), prefill_s=prefill_s, token_s=token_s,
                   token_s_per_seq=token_s_per_seq, shared_token_s=shared_token_s,
                   shared_token_s_per_seq=shared_token_s_per_seq)


def _overlap(spans: list[tuple[float, float]]):
    """A function (start, end) -> seconds of [start, end] covered by these (non-overlapping) spans."""
    windows = sorted(spans)
    starts = [w[0] for w in windows]

    def overlap(start: float, end: float) -> float:
        total = 0.0
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(windows) and windows[i][0] < end:
            total += max(0.0, min(end, windows[i][1]) - max(start, windows[i][0]))
            i += 1
        return total

    return overlap


def _dispatch_gap(trace: Trace) -> float:
    """The scheduler's trip from a refill's cause to its submit: the median gap from the latest
    event that can open a slot or admission (a sample ending on any engine, an update committing,
    a train step ending) to each submit, over the gaps short enough to be a refill (under a quarter
    of the median sample's duration; longer ones are engines idling, with no dispatch in them)."""
    samples = [s for s in trace.samples if not s.dropped]
    if not samples:
        return 0.0
    causes = sorted([s.end_s for s in samples] + [u.end_s for u in trace.updates]
                    + [s.train_end_s or s.end_s for s in trace.steps])
    limit = 0.25 * statistics.median(s.end_s - s.submit_s for s in samples)
    gaps = []
    for s in samples:
        i = bisect.bisect_right(causes, s.submit_s) - 1
        if i >= 0 and s.submit_s - causes[i] <= limit:
            gaps.append(s.submit_s - causes[i])
    return statistics.median(gaps) if gaps else 0.0


def fit_train(trace: Trace) -> TrainCost:
    steps = trace.steps[1:] if len(trace.steps) > 2 else trace.steps
    rows = [(1.0, float(s.num_tokens)) for s in steps]
    base_s, per_token_s = nnls(rows, [s.train_s for s in steps])
    if per_token_s <= 0 and base_s <= 0:
        base_s = statistics.fmean(s.train_s for s in steps)
    # Controller time between a step's update (and eval) and its next batch request: what is left
    # of the gap between two trainings once the update, the wait for data and an eval are taken out.
    eval_at = {e.step: e.end_s - e.start_s for e in trace.evals if e.end_s > 0}
    overheads = []
    for prev, step in zip(trace.steps, trace.steps[1:]):
        if prev.train_end_s <= 0 or step.train_end_s <= 0:
            continue
        gap = (step.train_end_s - step.train_s) - prev.train_end_s
        overheads.append(gap - prev.update_s - step.wait_data_s - eval_at.get(prev.step, 0.0))
    overhead_s = max(statistics.median(overheads), 0.0) if overheads else 0.0
    return TrainCost(base_s=base_s, per_token_s=per_token_s, fit_world_size=trace.header.trainer_world_size,
                     overhead_s=overhead_s)


def fit_update(trace: Trace) -> UpdateCost:
    steps = trace.steps[1:] if len(trace.steps) > 2 else trace.steps
    export_s = statistics.median(s.update_s for s in steps)
    if not trace.updates:
        return UpdateCost(export_s=export_s)
    push_s = statistics.median(u.end_s - u.start_s for u in trace.updates)
    paused_s = min(statistics.median(u.paused_s for u in trace.updates), push_s)
    return UpdateCost(export_s=export_s, push_s=push_s, paused_s=paused_s)


def fit_teacher(trace: Trace) -> TeacherCost:
    """Least squares of each scored sample's `teacher_s` on its tokens (zero without a teacher)."""
    scored = [s for s in trace.samples if s.teacher_s > 0]
    if not scored:
        return TeacherCost()
    request_s, token_s = nnls([(1.0, float(s.prompt_tokens + s.output_tokens)) for s in scored],
                              [s.teacher_s for s in scored])
    if request_s <= 0 and token_s <= 0:
        request_s = statistics.fmean(s.teacher_s for s in scored)
    return TeacherCost(request_s=request_s, token_s=token_s)


def _fit_eval(trace: Trace) -> float:
    timed = [e.end_s - e.start_s for e in trace.evals if e.end_s > 0]
    return statistics.median(timed) if timed else 0.0


def nnls(rows: list[tuple[float, ...]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0, for a handful of columns: the best unconstrained
    fit over every subset of columns whose solution is non-negative (exact for small problems).
    The Gram matrix is built once; each subset solves its own few-by-few normal equations."""
    num_cols = len(rows[0])
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(num_cols)] for i in range(num_cols)]
    moments = [sum(r[i] * t for r, t in zip(rows, targets)) for i in range(num_cols)]
    best: tuple[float, list[float]] | None = None
    for size in range(num_cols, 0, -1):
        for cols in combinations(range(num_cols), size):
            coef = _solve([[gram[i][j] for j in cols] for i in cols], [moments[i] for i in cols])
            if coef is None or any(c < 0 for c in coef):
                continue
            # residual minus the constant sum(t^2): -2 x.A'b + x.A'A x
            loss = sum(x * (sum(gram[i][j] * y for j, y in zip(cols, coef)) - 2 * moments[i])
                       for i, x in zip(cols, coef))
            if best is None or loss < best[0] - 1e-15 * (abs(best[0]) + 1e-30):
                best = (loss, [0.0] * num_cols)
                for c, value in zip(cols, coef):
                    best[1][c] = value
    return best[1] if best is not None else [0.0] * num_cols


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the columns are (nearly) collinear."""
    n = len(b)
    a = [row[:] for row in a]
    b = b[:]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None  # collinear columns: another subset covers this fit
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]
