"""The numbers a simulation (or a recorded run) is judged by, computed the same way for both.

`RunStats`, from the train steps' times and the engines' busy time:

    step_s_*             time between consecutive trainings' ends (steps 2..N: the first step
                         includes start-up, as the seeds' "step 0 excluded"): mean, p50, p90, p99, max
    samples_per_s        samples trained in steps 2..N over the span from step 1's end to step N's
    tokens_per_s         the same for tokens (prompt + output)
    trainer_idle_fraction  1 - (training time of steps 2..N) / span
    engine_utilization   time an engine had a sample in flight, over engines x span
    staleness            fraction of trained groups at each staleness (trainer version - oldest
                         engine version of the group), over all steps
    dropped              groups dropped by the buffer, by reason (simulated runs; a trace does not
                         record them)

`measure(trace)` gives a recorded run's `RunStats`; `compare(predicted, measured)` the relative
errors and the staleness distributions' total-variation distance; `trace_intervals(trace)` a
recorded run as timeline lanes, to draw beside a simulated one.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict

import msgspec

from miles_async.sim.plot import Interval
from miles_async.sim.trace import Trace


class StepRecord(msgspec.Struct, kw_only=True):
    step: int
    ask_s: float
    train_start_s: float
    train_end_s: float
    num_samples: int
    num_tokens: int
    staleness: list[int]  # per group trained
    prompt_ids: list[int] = []


class RunStats(msgspec.Struct, kw_only=True):
    num_steps: int
    span_s: float
    step_s_mean: float
    step_s_p50: float
    step_s_p90: float
    step_s_p99: float
    step_s_max: float
    samples_per_s: float
    tokens_per_s: float
    trainer_idle_fraction: float
    engine_utilization: float
    staleness: dict[int, float]
    staleness_mean: float
    dropped: dict[str, int] = {}
    samples_generated: int = 0


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(steps: list[StepRecord], *, busy_s_total: float, busy_s_before_first: dict[str, float] | float,
              num_engines: int, dropped: dict[str, int] | None = None, samples_generated: int = 0) -> RunStats:
    """`RunStats` of a run's steps; busy time is the engines' total, and their total before step 1 ended."""
    if not steps:
        raise ValueError("no train steps to summarize")
    ends = [s.train_end_s for s in steps]
    intervals = sorted(b - a for a, b in itertools.pairwise(ends))
    later = steps[1:] or steps
    span = ends[-1] - ends[0] if len(steps) > 1 else ends[0]
    span = max(span, 1e-12)
    before = sum(busy_s_before_first.values()) if isinstance(busy_s_before_first, dict) else busy_s_before_first
    counts = Counter(x for s in steps for x in s.staleness)
    num_groups = sum(counts.values()) or 1
    return RunStats(
        num_steps=len(steps), span_s=span,
        step_s_mean=statistics.fmean(intervals) if intervals else span,
        step_s_p50=_percentile(intervals, 0.5), step_s_p90=_percentile(intervals, 0.9),
        step_s_p99=_percentile(intervals, 0.99), step_s_max=intervals[-1] if intervals else span,
        samples_per_s=sum(s.num_samples for s in later) / span, tokens_per_s=sum(s.num_tokens for s in later) / span,
        trainer_idle_fraction=max(0.0, 1.0 - sum(s.train_end_s - s.train_start_s for s in later) / span),
        engine_utilization=min(1.0, max(0.0, (busy_s_total - before) / (span * num_engines))),
        staleness={k: counts[k] / num_groups for k in sorted(counts)},
        staleness_mean=sum(k * n for k, n in counts.items()) / num_groups,
        dropped=dict(dropped or {}), samples_generated=samples_generated)


def measure(trace: Trace) -> RunStats:
    """A recorded run's `RunStats` (see the module docstring), from its trace alone."""
    steps = []
    # Which attempt of a prompt was trained: the last one complete before the step drew its batch.
    done_at: dict[tuple[int, int], list[float]] = defaultdict(list)
    versions: dict[tuple[int, int], int] = {}
    for s in trace.samples:
        if s.dropped:
            continue
        done_at[(s.prompt_id, s.attempt)].append(s.end_s)
        key = (s.prompt_id, s.attempt)
        versions[key] = min(versions.get(key, s.versions[0]), min(s.versions))
    attempts: dict[int, list[int]] = defaultdict(list)
    for prompt_id, attempt in done_at:
        attempts[prompt_id].append(attempt)
    n = trace.header.group_size
    for record in trace.steps:
        end = record.train_end_s or record.end_s
        start = end - record.train_s
        staleness = []
        for prompt_id in record.prompt_ids:
            complete = [a for a in sorted(attempts.get(prompt_id, ()))
                        if len(done_at[(prompt_id, a)]) >= n and max(done_at[(prompt_id, a)]) <= start + 1e-6]
            if complete:
                staleness.append(record.weight_version - 1 - versions[(prompt_id, complete[-1])])
        steps.append(StepRecord(step=record.step, ask_s=record.start_s, train_start_s=start, train_end_s=end,
                                num_samples=record.num_samples, num_tokens=record.num_tokens, staleness=staleness))
    first, last = steps[0].train_end_s, steps[-1].train_end_s
    busy = sum(_union_within([(s.submit_s, s.end_s) for s in samples], first, last)
               for samples in _by_engine(trace).values())
    return summarize(steps, busy_s_total=busy, busy_s_before_first=0.0, num_engines=trace.header.num_engines,
                     samples_generated=sum(1 for s in trace.samples if not s.dropped))


def _by_engine(trace: Trace) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for s in trace.samples:
        if not s.dropped:
            out[s.engine].append(s)
    return out


def _union_within(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(spans):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def staleness_distance(a: dict[int, float], b: dict[int, float]) -> float:
    """Total-variation distance between two staleness distributions (0: equal, 1: disjoint)."""
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def compare(predicted: RunStats, measured: RunStats) -> dict[str, float]:
    """Relative errors (predicted / measured - 1) of the headline numbers, and the staleness distance."""
    def rel(p: float, m: float) -> float:
        return p / m - 1.0 if m else float("inf") if p else 0.0

    return {
        "step_s_mean": rel(predicted.step_s_mean, measured.step_s_mean),
        "step_s_p50": rel(predicted.step_s_p50, measured.step_s_p50),
        "samples_per_s": rel(predicted.samples_per_s, measured.samples_per_s),
        "trainer_idle_fraction_abs": predicted.trainer_idle_fraction - measured.trainer_idle_fraction,
        "engine_utilization_abs": predicted.engine_utilization - measured.engine_utilization,
        "staleness_tv": staleness_distance(predicted.staleness, measured.staleness),
    }


def trace_intervals(trace: Trace) -> tuple[list[Interval], list[tuple[float, int]]]:
    """A recorded run as timeline lanes (the same picture the simulator draws of its own runs):
    engines shaded by samples in flight, pauses, pushes, and the trainer's wait / train / export."""
    intervals: list[Interval] = []
    for engine, samples in _by_engine(trace).items():
        changes = sorted([(s.submit_s, 1) for s in samples] + [(s.end_s, -1) for s in samples])
        count, last = 0, changes[0][0]
        for t, delta in changes:
            if count and t > last:
                intervals.append(Interval(lane=engine, start=last, end=t, kind="generate", value=float(count)))
            count += delta
            last = t
        for u in trace.updates:
            if u.paused_s > 0:
                intervals.append(Interval(lane=engine, start=u.end_s - u.paused_s, end=u.end_s, kind="paused"))
    versions = []
    for u in trace.updates:
        intervals.append(Interval(lane="weights", start=u.start_s, end=u.end_s, kind="push"))
        versions.append((u.end_s, u.version))
    for s in trace.steps:
        end = s.train_end_s or s.end_s
        start = end - s.train_s
        intervals.append(Interval(lane="trainer", start=start - s.wait_data_s, end=start, kind="wait_data"))
        intervals.append(Interval(lane="trainer", start=start, end=end, kind="train"))
        intervals.append(Interval(lane="trainer", start=end, end=end + s.update_s, kind="export"))
    for e in trace.evals:
        if e.end_s > 0:
            intervals.append(Interval(lane="trainer", start=e.start_s, end=e.end_s, kind="eval"))
    return intervals, versions
