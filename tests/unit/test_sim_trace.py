"""miles_async/sim/trace.py: loading, segments, rebasing and the checks of a run's trace.jsonl."""

from __future__ import annotations

import gzip
import pickle

import msgspec
import pytest

from miles_async.observe.records import EvalTrace, RunTrace, SampleTrace, StepTrace, UpdateTrace
from miles_async.sim.trace import Trace, TraceError, load_trace, write_trace

replace = msgspec.structs.replace


def header(start_s: float = 10.0, **kw) -> RunTrace:
    fields = {"schema": 1, "num_engines": 2, "trainer_world_size": 1, "mode": "async", "max_staleness": 1,
              "group_size": 2, "batch_groups": 1, "target_in_flight": 4, "capacity_groups": 4,
              "filter": "nonzero_std", "on_stale": "retry", "on_abort": "retry"}
    return RunTrace(start_s=start_s, **{**fields, **kw})


def sample(submit_s: float, end_s: float, versions: list[int] | None = None, **kw) -> SampleTrace:
    fields = {"prompt_id": 0, "index": 0, "engine": "engine-0", "prompt_tokens": 5, "output_tokens": 3,
              "finish_reason": "stop"}
    return SampleTrace(submit_s=submit_s, end_s=end_s, versions=versions or [0], **{**fields, **kw})


def step(n: int, start_s: float, end_s: float, train_end_s: float = 0.0, **kw) -> StepTrace:
    fields = {"weight_version": n, "wait_data_s": 0.1, "train_s": 0.5, "update_s": 0.05, "num_samples": 2,
              "num_tokens": 16, "staleness_mean": 0.0, "staleness_max": 0}
    return StepTrace(step=n, start_s=start_s, end_s=end_s, train_end_s=train_end_s, **{**fields, **kw})


def update(version: int, start_s: float, end_s: float) -> UpdateTrace:
    return UpdateTrace(version=version, start_s=start_s, end_s=end_s, transport="shm", num_bytes=100)


def base() -> list:
    """A valid one-segment trace; a record's line number is its index + 1."""
    return [
        header(),                                        # 1
        sample(10.1, 10.5),                              # 2
        sample(10.2, 10.6, index=1),                     # 3
        step(1, 10.0, 11.0, train_end_s=10.9),           # 4
        update(1, 11.0, 11.1),                           # 5
        sample(11.1, 11.5, versions=[0, 1]),             # 6
        step(2, 11.0, 12.0),                             # 7
        update(2, 12.0, 12.1),                           # 8
        EvalTrace(step=2, score=0.5, num_samples=4, mode="shared", start_s=12.0, end_s=12.5),  # 9
    ]


def test_round_trip_rebases_and_drops_the_warm_up(tmp_path):
    records = [
        header(start_s=0.5),
        update(1, 1.0, 1.5), update(2, 2.0, 2.5),        # the SFT warm start's pushes
        EvalTrace(step=0, score=0.1, num_samples=4, mode="shared", start_s=5.0, end_s=6.0),  # before step 1
        sample(9.5, 11.0, versions=[2]),                 # submitted before step 1 starts: kept
        step(1, 10.0, 12.0, train_end_s=11.8),           # the RL phase starts at 10.0
        update(3, 12.0, 12.5),
        step(2, 12.0, 13.0),                             # train_end_s not recorded: stays 0.0
        update(4, 13.0, 13.5),
        EvalTrace(step=2, score=0.5, num_samples=4, mode="shared", start_s=13.5, end_s=14.5),
        EvalTrace(step=2, score=0.6, num_samples=4, mode="command"),  # no times recorded: kept, stays 0.0
    ]
    path = write_trace(tmp_path / "run" / "trace.jsonl", records)
    trace = load_trace(path)
    assert isinstance(trace, Trace)
    assert (trace.path, trace.segment, trace.num_segments) == (str(path), 0, 1)
    assert trace.header == replace(records[0], start_s=0.0)
    assert [(s.submit_s, s.end_s) for s in trace.samples] == [(9.0, 10.5)]
    assert [(s.step, s.start_s, s.end_s, s.train_end_s) for s in trace.steps] == [
        (1, 9.5, 11.5, pytest.approx(11.3)), (2, 11.5, 12.5, 0.0)]
    assert trace.steps[0].wait_data_s == 0.1  # durations are not rebased
    assert [(u.version, u.start_s, u.end_s) for u in trace.updates] == [(3, 11.5, 12.0), (4, 12.5, 13.0)]
    assert [(e.score, e.start_s, e.end_s) for e in trace.evals] == [(0.5, 13.0, 14.0), (0.6, 0.0, 0.0)]


def test_gzip_and_blank_lines(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl.gz", base())
    with gzip.open(path, "rb") as f:
        assert f.read().startswith(b'{"kind":"run"')
    assert len(load_trace(path).steps) == 2
    plain = tmp_path / "blank.jsonl"
    plain.write_bytes(b"\n" + write_trace(tmp_path / "x.jsonl", base()).read_bytes().replace(b"\n", b"\n  \n"))
    assert len(load_trace(plain).samples) == 3


def two_segments(steps_a: int = 2, steps_b: int = 3) -> list:
    a = [header(start_s=0.0), update(1, 1.0, 1.5), sample(10.1, 10.5)]
    a += [step(n, 10.0 + n, 11.0 + n) for n in range(1, steps_a + 1)]
    a += [update(1 + n, 11.0 + n, 11.5 + n) for n in range(1, steps_a + 1)]
    # The resumed process: its clock restarts; it first pushes the checkpoint's weights (version 2).
    b = [header(start_s=0.01), update(2, 3.0, 3.5), sample(5.1, 5.5, versions=[2])]
    b += [step(n, 5.0 + n, 6.0 + n) for n in range(2, steps_b + 2)]
    b += [update(n + 1, 6.0 + n, 6.2 + n) for n in range(2, steps_b + 2)]
    return a + b


def test_segments(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl", two_segments())
    later = load_trace(path)  # the one with the most steps
    assert (later.segment, later.num_segments, len(later.steps)) == (1, 2, 3)
    assert [s.start_s for s in later.steps] == [pytest.approx(6.99), pytest.approx(7.99), pytest.approx(8.99)]
    assert [u.version for u in later.updates] == [3, 4, 5]  # not the resume's push of version 2
    earlier = load_trace(path, segment=0)
    assert (earlier.segment, len(earlier.steps)) == (0, 2)
    assert [(u.version, u.end_s) for u in earlier.updates] == [(2, 12.5), (3, 13.5)]
    assert load_trace(write_trace(tmp_path / "tie.jsonl", two_segments(2, 2))).segment == 1
    assert load_trace(write_trace(tmp_path / "first.jsonl", two_segments(3, 1))).segment == 0
    for bad in (2, -1):
        with pytest.raises(ValueError, match="has 2 segments") as e:
            load_trace(path, segment=bad)
        assert not isinstance(e.value, TraceError)


def test_segment_without_steps(tmp_path):
    records = [header(start_s=10.0), sample(10.1, 10.5), header(start_s=1.0)]  # both stopped before a step
    path = write_trace(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError, match="no train steps recorded") as e:
        load_trace(path)
    assert e.value.line is None and str(e.value).startswith(f"{path}: ")
    ok = write_trace(tmp_path / "ok.jsonl", [*base(), header(start_s=1.0)])  # an empty last segment
    assert load_trace(ok).segment == 0
    with pytest.raises(TraceError, match="no train steps recorded in segment 1 of 2"):
        load_trace(ok, segment=1)


def test_a_repeated_version_is_allowed(tmp_path):
    # eval.mode = "dedicated": the same weights are pushed again, to the eval engine.
    records = [*base(), update(2, 12.6, 12.7)]
    assert [u.version for u in load_trace(write_trace(tmp_path / "t.jsonl", records)).updates] == [1, 2, 2]


def expect(tmp_path, records, line: int | None, field: str | None, fragment: str) -> TraceError:
    path = write_trace(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    err = e.value
    assert (err.path, err.line, err.field) == (str(path), line, field), str(err)
    prefix = f"{path}:{line}: " + (f"field `{field}`: " if field else "")
    assert str(err).startswith(prefix), str(err)
    assert fragment in str(err), str(err)
    return err


CHECKS = [  # (record index, changes, field, fragment)
    (0, {"schema": 7}, "schema", "version 7 is not supported (this version reads 1)"),
    (0, {"num_engines": 0}, "num_engines", "expected >= 1"),
    (0, {"trainer_world_size": 0}, "trainer_world_size", "expected >= 1"),
    (0, {"group_size": 0}, "group_size", "expected >= 1"),
    (0, {"batch_groups": 0}, "batch_groups", "expected >= 1"),
    (0, {"target_in_flight": 0}, "target_in_flight", "expected >= 1"),
    (0, {"capacity_groups": 0}, "capacity_groups", "expected >= 1"),
    (0, {"max_staleness": -1}, "max_staleness", "expected >= 0"),
    (0, {"max_in_flight_per_engine": 0}, "max_in_flight_per_engine", "null or >= 1"),
    (0, {"mode": "eventually"}, "mode", "'eventually' is not one of 'sync', 'one_step_off', 'async'"),
    (0, {"refill": "x"}, "refill", "not one of"),
    (0, {"partial": "x"}, "partial", "not one of"),
    (0, {"filter": "x"}, "filter", "not one of"),
    (0, {"on_stale": "x"}, "on_stale", "not one of"),
    (0, {"on_abort": "x"}, "on_abort", "not one of"),
    (1, {"end_s": 10.0}, "end_s", "10.0 is before submit_s 10.1 (times must not go backwards)"),
    (1, {"submit_s": 9.9}, "submit_s", "before the run header's start_s 10.0"),
    (1, {"versions": []}, "versions", "empty"),
    (5, {"versions": [1, 0]}, "versions[1]", "must not decrease"),
    (1, {"prompt_tokens": -1}, "prompt_tokens", "negative"),
    (1, {"output_tokens": -1}, "output_tokens", "negative"),
    (3, {"end_s": 9.5}, "end_s", "before start_s 10.0"),
    (6, {"step": 1}, "step", "1 does not follow step 1"),
    (6, {"start_s": 10.5, "end_s": 10.95}, "end_s", "before the previous step's end_s 11.0"),
    (3, {"wait_data_s": -0.1}, "wait_data_s", "negative"),
    (3, {"train_s": -0.1}, "train_s", "negative"),
    (3, {"update_s": -0.1}, "update_s", "negative"),
    (3, {"num_samples": 0}, "num_samples", "expected >= 1"),
    (3, {"train_end_s": 11.5}, "train_end_s", "outside the step's [start_s, end_s]"),
    (3, {"train_end_s": 9.5}, "train_end_s", "outside"),
    (4, {"end_s": 10.9}, "end_s", "before start_s 11.0"),
    (7, {"version": 0}, "version", "0 is below the previous update's 1"),
    (8, {"end_s": 11.9}, "end_s", "before start_s 12.0"),
]


@pytest.mark.parametrize(("index", "changes", "field", "fragment"), CHECKS,
                         ids=[f"{i}-{'-'.join(c)}" for i, c, _, _ in CHECKS])
def test_checks(tmp_path, index, changes, field, fragment):
    records = base()
    records[index] = replace(records[index], **changes)
    expect(tmp_path, records, index + 1, field, fragment)


def test_tolerances(tmp_path):
    records = base()
    records[1] = replace(records[1], submit_s=10.0 - 5e-4)  # within 1 ms of the header's start_s
    records[3] = replace(records[3], train_end_s=11.0 + 5e-4)
    load_trace(write_trace(tmp_path / "t.jsonl", records))


def raw(tmp_path, records, line: int, text: bytes):
    """The trace of `records` with line `line` (1-based) replaced by `text`."""
    path = write_trace(tmp_path / "trace.jsonl", records)
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = text
    path.write_bytes(b"\n".join(lines))
    return path


def good_sample(**changes) -> bytes:
    fields = msgspec.to_builtins(sample(10.1, 10.5))
    fields.update(changes)
    return msgspec.json.encode({k: v for k, v in fields.items() if v is not None})


DECODING = [  # (line text, field, fragment)
    (b"{not json", None, "not JSON"),
    (b"[1, 2]", None, "not a JSON object (got array)"),
    (b'"a string"', None, "not a JSON object (got str)"),
    (b'{"kind": "bogus"}', "kind", "unknown kind 'bogus' (expected one of run, sample"),
    (b'{"step": 1}', "kind", "missing"),
    (b'{"kind": 3}', "kind", "expected str"),
    (good_sample(end_s=None), "end_s", "missing"),
    (good_sample(end_s="late"), "end_s", "expected float, got str"),
    (good_sample(versions=[0, "one"]), "versions[1]", "expected int, got str"),
]


@pytest.mark.parametrize(("text", "field", "fragment"), DECODING, ids=[d[2] for d in DECODING])
def test_decoding_errors(tmp_path, text, field, fragment):
    path = raw(tmp_path, base(), 3, text)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert (e.value.line, e.value.field) == (3, field), str(e.value)
    assert str(e.value).startswith(f"{path}:3: " + (f"field `{field}`: " if field else "")), str(e.value)
    assert fragment in str(e.value)


def test_line_numbers_count_blank_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n" + write_trace(tmp_path / "x.jsonl", base()).read_bytes().replace(b"\n", b"\n\n", 1)
                     .replace(b'"output_tokens":3', b'"output_tokens":-3', 1))
    with pytest.raises(TraceError, match=r"trace.jsonl:4: field `output_tokens`: -3 is negative"):
        load_trace(path)


def test_torn_last_line(tmp_path):
    path = write_trace(tmp_path / "trace.jsonl", base())
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"kind":"sample","prompt_id":')  # a crash mid-write: skipped
    assert len(load_trace(path).samples) == 3
    path.write_bytes(whole + b'{"kind":"sample","prompt_id":\n')  # a whole line: an error
    with pytest.raises(TraceError, match=r":10: not JSON"):
        load_trace(path)


def test_no_header(tmp_path):
    err = expect(tmp_path, base()[1:], 1, "kind", "the trace has no header: its first record is 'sample'")
    assert "re-record" in str(err) and "schema 1" in str(err)
    expect(tmp_path, [update(1, 1.0, 2.0), *base()], 1, "kind", "first record is 'weight_update'")
    (tmp_path / "empty.jsonl").write_bytes(b"\n")
    with pytest.raises(TraceError, match="empty"):
        load_trace(tmp_path / "empty.jsonl")


def test_earlier_segments_are_checked_too(tmp_path):
    records = two_segments()
    records[2] = replace(records[2], end_s=10.0)
    expect(tmp_path, records, 3, "end_s", "before submit_s")


def test_error_pickles():
    err = TraceError("t.jsonl:3: field `x`: bad", path="t.jsonl", line=3, field="x")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.path, back.line, back.field) == (str(err), "t.jsonl", 3, "x")


def test_the_garbage_collector_is_left_as_found(tmp_path):
    import gc

    bad = write_trace(tmp_path / "bad.jsonl", base()[1:])
    with pytest.raises(TraceError):
        load_trace(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        load_trace(write_trace(tmp_path / "ok.jsonl", base()))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_dedicated_eval_engines_pushes_are_not_the_rollout_engines(tmp_path) -> None:
    records = [*base(), UpdateTrace(version=2, start_s=12.6, end_s=12.9, transport="shm", num_bytes=8, target="eval")]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", records))
    assert [(u.version, u.target) for u in trace.updates] == [(1, "rollout"), (2, "rollout")]
    records[-1] = UpdateTrace(version=2, start_s=12.6, end_s=12.9, transport="shm", num_bytes=8, target="x")
    with pytest.raises(TraceError, match=r":10: field `target`: 'x' is not 'rollout' or 'eval'"):
        load_trace(write_trace(tmp_path / "bad.jsonl", records))
