"""Loading a run's `trace.jsonl` for the simulator: one segment, checked, on a clock that starts at 0.

A real run writes `RUN_DIR/trace.jsonl` (the schema, field by field, is in
`miles_async.observe.records`). The simulator replays one *segment* of it: the records of one
process, from its `run` header on. A resumed run appends a new header to the same file and its
clock restarts (times are seconds since that process started), so a file holds one or more
segments. `load_trace` reads the file, checks every record, picks a segment and returns it as a
`Trace` whose times are rebased so the header's `start_s` is 0.0. `write_trace` writes records
back as JSONL (synthetic traces, test fixtures).

    from miles_async.sim.trace import load_trace
    trace = load_trace("runs/x/trace.jsonl")           # the segment with the most train steps
    trace = load_trace("runs/x/trace.jsonl.gz", segment=0)
    trace.header.mode, len(trace.steps), trace.steps[-1].end_s

Try it on a finished run (it prints the first problem found, if any, as
`PATH:LINE: field `name`: what is wrong`):

    python -c "from miles_async.sim.trace import load_trace; t = load_trace('RUN_DIR/trace.jsonl');
               print(t.segment, t.num_segments, len(t.samples), len(t.steps), t.steps[-1].end_s)"

Segments. Every process writes a `run` header as its first record, so a segment is a header and
the records after it, up to the next header. Its RL phase starts with its first train step's
`start_s`: records before that (the weight pushes of an SFT warm start, a resumed run's first
push, an eval of the starting weights) belong to the warm-up; they are checked but not returned.

What a `Trace` holds (the selected segment; records in file order):
    header    the segment's `RunTrace`, its `start_s` rebased to 0.0
    samples   every `SampleTrace`
    steps     every `StepTrace` (at least one)
    updates   the rollout engines' `UpdateTrace`s (target "rollout"; a dedicated eval engine's
              pushes are left out) of the RL phase: those that started at or after the first
              step's start_s (the warm-up's pushes are left out)
    evals     the `EvalTrace`s, less the warm-up's: those that ended (or, with no end recorded,
              started) before the first step's start_s. An eval with no times is kept
Rebasing subtracts the header's original `start_s` (about 0 in a real run) from every time
field: `submit_s`/`end_s` (samples), `start_s`/`end_s`/`train_end_s` (steps), `start_s`/`end_s`
(updates, evals). Durations (`wait_data_s`, `train_s`, `update_s`, `paused_s`) are kept.
`StepTrace.train_end_s` and `EvalTrace.start_s`/`end_s` use 0.0 for "not recorded" (traces from
before those fields): a 0.0 there stays 0.0 and is neither rebased nor checked, so test for 0.0
before using them (`step.train_end_s or step.end_s`).

Validation (each failure a `TraceError`, `ValueError`'s subclass, whose message names the file,
the 1-based line and the field, e.g. `trace.jsonl:12: field `end_s`: 3.1 is before submit_s 3.5
(times must not go backwards)`). Every segment is checked, not just the one returned:
    any line    JSON, an object, a known `kind`, every required field present and of its type
                (unknown fields are ignored: the schema grows by appending fields). Blank lines
                are skipped. A last line with no newline that is not valid JSON is a write cut
                short by a crash and is skipped, as `JsonlWriter` does when it reopens the file.
    header      the first record of the file; `schema` == `TRACE_SCHEMA`; num_engines,
                trainer_world_size, group_size, batch_groups, target_in_flight,
                capacity_groups >= 1; max_staleness >= 0;
                max_in_flight_per_engine None or >= 1; mode in sync/one_step_off/async; refill in
                sample/group; partial in continue/abort_retry; filter in nonzero_std/none;
                on_stale and on_abort in retry/discard
    sample      end_s >= submit_s; submit_s >= the header's start_s (less 1 ms); versions not
                empty and never decreasing; prompt_tokens, output_tokens >= 0
    train_step  end_s >= start_s; step strictly increasing and end_s never going backwards
                from one step to the next (within a segment); wait_data_s, train_s, update_s
                >= 0; num_samples >= 1; train_end_s (when not 0.0) within [start_s, end_s]
                (1 ms slack)
    weight_update
                end_s >= start_s; version never decreasing within a segment (warm-up included).
                An equal version is allowed: with eval.mode = "dedicated" the controller pushes
                the same weights a second time, to the eval engine, and records that push too
    eval        end_s >= start_s when both were recorded
    engine      event one of serving/lost/restarted/gone; time_s not before the header. Checked,
                not returned: the simulator replays a fixed fleet of `num_engines` engines
    segment     the segment returned has at least one train step (an earlier one may have none:
                a process that stopped before its first step)
"""

from __future__ import annotations

import gc
import gzip
import re
from collections.abc import Iterable
from pathlib import Path

import msgspec

from miles_async.observe.records import (
    ENGINE_EVENTS,
    TRACE_SCHEMA,
    EngineTrace,
    EvalTrace,
    RunTrace,
    SampleTrace,
    StepTrace,
    TraceRecord,
    UpdateTrace,
)

__all__ = ["Trace", "TraceError", "load_trace", "write_trace"]

TOLERANCE_S = 1e-3  # slack for comparisons of times taken by different clocks or processes

# Built once: the decoder compiles its tagged-union dispatch on construction.
_decoder = msgspec.json.Decoder(TraceRecord)
_encoder = msgspec.json.Encoder()

_MODES = ("sync", "one_step_off", "async")
_REFILLS = ("sample", "group")
_PARTIALS = ("continue", "abort_retry")
_FILTERS = ("nonzero_std", "none")
_ON_DROP = ("retry", "discard")
_KINDS = ("run", "sample", "train_step", "weight_update", "eval")


class TraceError(ValueError):
    """A trace that cannot be replayed: `PATH:LINE: field `name`: what is wrong`.

    `path`, `line` (1-based; None for a problem of the whole file) and `field` (None for a
    problem of a whole line) are kept as attributes too.
    """

    def __init__(self, message: str, *, path: str = "", line: int | None = None, field: str | None = None):
        super().__init__(message)
        self.path, self.line, self.field = path, line, field

    def __reduce__(self):  # keep the attributes across pickling (an actor may raise it)
        return _rebuild_error, (str(self), self.path, self.line, self.field)


def _rebuild_error(message: str, path: str, line: int | None, field: str | None) -> TraceError:
    return TraceError(message, path=path, line=line, field=field)


def _error(path: str, line: int | None, field: str | None, problem: str) -> TraceError:
    where = path if line is None else f"{path}:{line}"
    what = problem if field is None else f"field `{field}`: {problem}"
    return TraceError(f"{where}: {what}", path=path, line=line, field=field)


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of a trace, checked, its times rebased so the header's start_s is 0.0."""

    path: str
    header: RunTrace
    samples: list[SampleTrace]
    steps: list[StepTrace]
    updates: list[UpdateTrace]  # the RL phase's: started at or after the first step's start_s
    evals: list[EvalTrace]
    segment: int  # 0-based index of this segment in the file
    num_segments: int


# ----- decoding -----

_MISSING = re.compile(r"Object missing required field `([^`]+)`(?: - at `\$\.?(.*)`)?$")
_EXPECTED = re.compile(r"Expected `([^`]+)`(?:, got `([^`]+)`)?(?: - at `\$\.?(.*)`)?$")
_INVALID = re.compile(r"Invalid value (.*) - at `\$\.?(.*)`$")


def _decode_error(path: str, line: int, e: msgspec.DecodeError, raw: bytes) -> TraceError:
    """msgspec's message, in this module's `field `x`: problem` form."""
    text = str(e)
    if not isinstance(e, msgspec.ValidationError):
        return _error(path, line, None, f"not JSON ({text}); the line starts {raw[:80]!r}")
    if m := _MISSING.match(text):
        field = f"{m.group(2)}.{m.group(1)}" if m.group(2) else m.group(1)
        if field == "kind":
            return _error(path, line, "kind", f"missing (every record is tagged by its kind, one of "
                                               f"{', '.join(_KINDS)})")
        return _error(path, line, field, "missing")
    if m := _EXPECTED.match(text):
        expected, got, field = m.groups()
        if not field:  # the line itself
            return _error(path, line, None, f"not a JSON object (got {got or 'something else'}); "
                                            f"the line starts {raw[:80]!r}")
        return _error(path, line, field, f"expected {expected}" + (f", got {got}" if got else ""))
    if m := _INVALID.match(text):
        value, field = m.groups()
        if field == "kind":
            return _error(path, line, "kind", f"unknown kind {value} (expected one of {', '.join(_KINDS)})")
        return _error(path, line, field, f"invalid value {value}")
    return _error(path, line, None, f"not a trace record ({text})")


def _read_records(path: Path) -> tuple[list[TraceRecord], list[int]]:
    """Every record with its 1-based line number; blank lines and a torn last line skipped."""
    name = str(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            data = f.read()
    else:
        data = path.read_bytes()
    lines = data.split(b"\n")
    last = len(lines)
    torn = not data.endswith(b"\n")  # then lines[-1] is a line without its newline
    records: list[TraceRecord] = []
    numbers: list[int] = []
    decode = _decoder.decode
    append, append_number = records.append, numbers.append
    for number, line in enumerate(lines, 1):
        if not line or line.isspace():
            continue
        try:
            append(decode(line))
        except msgspec.ValidationError as e:
            raise _decode_error(name, number, e, line) from None
        except msgspec.DecodeError as e:
            if number == last and torn:
                continue  # a write cut short by a crash (JsonlWriter cuts it off when it reopens)
            raise _decode_error(name, number, e, line) from None
        append_number(number)
    return records, numbers


# ----- checking -----

def _check_header(path: str, line: int, h: RunTrace) -> None:
    if h.schema != TRACE_SCHEMA:
        raise _error(path, line, "schema", f"version {h.schema} is not supported (this version reads {TRACE_SCHEMA})")
    for field in ("num_engines", "trainer_world_size", "group_size", "batch_groups", "target_in_flight",
                  "capacity_groups"):
        value = getattr(h, field)
        if value < 1:
            raise _error(path, line, field, f"{value} is out of range (expected >= 1)")
    if h.max_staleness < 0:
        raise _error(path, line, "max_staleness", f"{h.max_staleness} is out of range (expected >= 0)")
    if h.max_in_flight_per_engine is not None and h.max_in_flight_per_engine < 1:
        raise _error(path, line, "max_in_flight_per_engine",
                     f"{h.max_in_flight_per_engine} is out of range (expected null or >= 1)")
    for field, allowed in (("mode", _MODES), ("refill", _REFILLS), ("partial", _PARTIALS), ("filter", _FILTERS),
                           ("on_stale", _ON_DROP), ("on_abort", _ON_DROP)):
        value = getattr(h, field)
        if value not in allowed:
            raise _error(path, line, field, f"{value!r} is not one of {', '.join(map(repr, allowed))}")


def _check_eval(path: str, line: int, r: EvalTrace) -> None:
    if r.start_s != 0.0 and r.end_s != 0.0 and r.end_s < r.start_s:
        raise _error(path, line, "end_s", f"{r.end_s} is before start_s {r.start_s} (times must not go backwards)")


def _check_segment(path: str, header: RunTrace, records: list[TraceRecord], numbers: list[int],
                   lo: int, hi: int) -> int:
    """Check records[lo:hi], the body of one segment; the number of train steps in it."""
    start = header.start_s
    earliest = start - TOLERANCE_S
    num_steps = 0
    prev_step: StepTrace | None = None
    prev_update: UpdateTrace | None = None
    for i in range(lo, hi):
        r = records[i]
        t = type(r)
        if t is SampleTrace:
            if r.end_s < r.submit_s:
                raise _error(path, numbers[i], "end_s", f"{r.end_s} is before submit_s {r.submit_s} "
                                                        f"(times must not go backwards)")
            if r.submit_s < earliest:
                raise _error(path, numbers[i], "submit_s",
                             f"{r.submit_s} is before the run header's start_s {start} (samples are "
                             f"submitted in the RL phase, after the header)")
            v = r.versions
            if not v:
                raise _error(path, numbers[i], "versions", "empty (expected the weight version of each engine call)")
            if len(v) > 1:
                for k in range(1, len(v)):
                    if v[k] < v[k - 1]:
                        raise _error(path, numbers[i], f"versions[{k}]",
                                     f"{v[k]} is below the version before it, {v[k - 1]} (versions must not decrease)")
            if r.prompt_tokens < 0:
                raise _error(path, numbers[i], "prompt_tokens", f"{r.prompt_tokens} is negative")
            if r.output_tokens < 0:
                raise _error(path, numbers[i], "output_tokens", f"{r.output_tokens} is negative")
        elif t is StepTrace:
            _check_step(path, numbers[i], r, prev_step)
            prev_step = r
            num_steps += 1
        elif t is UpdateTrace:
            if r.end_s < r.start_s:
                raise _error(path, numbers[i], "end_s", f"{r.end_s} is before start_s {r.start_s} "
                                                        f"(times must not go backwards)")
            if r.target not in ("rollout", "eval"):
                raise _error(path, numbers[i], "target", f"{r.target!r} is not 'rollout' or 'eval'")
            if r.target != "rollout":
                continue  # the dedicated eval engine's pushes have versions of their own order
            if prev_update is not None and r.version < prev_update.version:
                raise _error(path, numbers[i], "version",
                             f"{r.version} is below the previous update's {prev_update.version} "
                             f"(weight versions must not decrease within a run)")
            prev_update = r
        elif t is EvalTrace:
            _check_eval(path, numbers[i], r)
        elif t is EngineTrace:
            if r.event not in ENGINE_EVENTS:
                raise _error(path, numbers[i], "event",
                             f"{r.event!r} is not one of {', '.join(map(repr, ENGINE_EVENTS))}")
            if r.time_s < earliest:
                raise _error(path, numbers[i], "time_s", f"{r.time_s} is before the run header's start_s {start}")
    return num_steps


def _check_step(path: str, line: int, r: StepTrace, prev: StepTrace | None) -> None:
    if r.end_s < r.start_s:
        raise _error(path, line, "end_s", f"{r.end_s} is before start_s {r.start_s} (times must not go backwards)")
    if prev is not None:
        if r.step <= prev.step:
            raise _error(path, line, "step", f"{r.step} does not follow step {prev.step} (steps must increase)")
        if r.end_s < prev.end_s:
            raise _error(path, line, "end_s", f"{r.end_s} is before the previous step's end_s {prev.end_s} "
                                              f"(times must not go backwards)")
    for field in ("wait_data_s", "train_s", "update_s"):
        value = getattr(r, field)
        if value < 0:
            raise _error(path, line, field, f"{value} is negative (expected a duration >= 0)")
    if r.num_samples < 1:
        raise _error(path, line, "num_samples", f"{r.num_samples} is out of range (expected >= 1)")
    te = r.train_end_s
    if te != 0.0 and not (r.start_s - TOLERANCE_S <= te <= r.end_s + TOLERANCE_S):
        raise _error(path, line, "train_end_s", f"{te} is outside the step's [start_s, end_s] = "
                                                f"[{r.start_s}, {r.end_s}]")


# ----- the segment returned -----

def _rebased(header: RunTrace, records: list[TraceRecord], lo: int, hi: int, path: str, segment: int,
             num_segments: int) -> Trace:
    t0 = header.start_s
    rl_start = next(r.start_s for r in records[lo:hi] if type(r) is StepTrace)  # the caller made sure of one
    replace = msgspec.structs.replace
    samples: list[SampleTrace] = []
    steps: list[StepTrace] = []
    updates: list[UpdateTrace] = []
    evals: list[EvalTrace] = []
    add_sample = samples.append
    for i in range(lo, hi):
        r = records[i]
        t = type(r)
        if t is SampleTrace:
            add_sample(replace(r, submit_s=r.submit_s - t0, end_s=r.end_s - t0))
        elif t is StepTrace:
            te = r.train_end_s
            steps.append(replace(r, start_s=r.start_s - t0, end_s=r.end_s - t0,
                                 train_end_s=te - t0 if te != 0.0 else 0.0))
        elif t is UpdateTrace:
            if r.start_s >= rl_start and r.target == "rollout":  # a dedicated eval engine's pushes are its own
                updates.append(replace(r, start_s=r.start_s - t0, end_s=r.end_s - t0))
        elif t is EvalTrace:
            s, e = r.start_s, r.end_s
            at = e or s
            if at != 0.0 and at < rl_start:
                continue  # the warm-up's
            evals.append(replace(r, start_s=s - t0 if s != 0.0 else 0.0, end_s=e - t0 if e != 0.0 else 0.0))
    return Trace(path=path, header=replace(header, start_s=0.0), samples=samples, steps=steps, updates=updates,
                 evals=evals, segment=segment, num_segments=num_segments)


def _segments(path: str, records: list[TraceRecord], numbers: list[int]) -> list[tuple[int, int, int]]:
    """(header index, first body index, end index) per segment; the headers checked."""
    if not records:
        raise _error(path, None, None, "no records: the trace is empty")
    first = records[0]
    if type(first) is not RunTrace:
        raise _error(path, numbers[0], "kind",
                     f"the trace has no header: its first record is {first.__struct_config__.tag!r}, expected "
                     f"\"run\". Traces from before schema {TRACE_SCHEMA} cannot be replayed: re-record with "
                     f"this version")
    heads = [i for i, r in enumerate(records) if type(r) is RunTrace]
    for h in heads:
        _check_header(path, numbers[h], records[h])  # type: ignore[arg-type]
    ends = [*heads[1:], len(records)]
    return [(h, h + 1, end) for h, end in zip(heads, ends)]


def load_trace(path: str | Path, *, segment: int | None = None) -> Trace:
    """One segment of a `trace.jsonl` (or `.jsonl.gz`), checked, its times rebased to its header.

    `segment` None picks the segment with the most train steps (the later one on a tie).
    Raises `TraceError` for a trace that breaks a rule of the module docstring, ValueError for a
    `segment` out of range, OSError for a file that cannot be read.
    """
    p = Path(path)
    # The cyclic GC would scan the growing heap of records again and again (half the time of a
    # 100k-line load); the records hold no cycles, so it is paused while they are built.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(p, segment)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load(p: Path, segment: int | None) -> Trace:
    name = str(p)
    records, numbers = _read_records(p)
    segments = _segments(name, records, numbers)
    counts = [_check_segment(name, records[h], records, numbers, lo, hi) for h, lo, hi in segments]  # type: ignore[arg-type]
    n = len(segments)
    if segment is None:
        segment = max(range(n), key=lambda k: (counts[k], k))
    elif not 0 <= segment < n:
        raise ValueError(f"{name}: segment {segment} is out of range: the trace has {n} segment"
                         f"{'s' if n != 1 else ''} (0..{n - 1})")
    h, lo, hi = segments[segment]
    if counts[segment] == 0:
        raise _error(name, None, None,
                     f"no train steps recorded in segment {segment} of {n} (its header is line {numbers[h]}): the "
                     f"run stopped before its first step, so there is nothing to replay")
    header = records[h]
    assert isinstance(header, RunTrace)
    return _rebased(header, records, lo, hi, name, segment, n)


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> Path:
    """Write `records` (a `run` header first) as JSONL, gzip-compressed when `path` ends in .gz.

    The parent folder is created; an existing file is replaced. Returns the path.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = _encoder.encode_lines(list(records))
    if p.name.endswith(".gz"):
        with gzip.open(p, "wb") as f:
            f.write(data)
    else:
        p.write_bytes(data)
    return p

