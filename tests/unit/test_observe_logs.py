"""Trace records round-trip through JsonlWriter/decode_trace; metrics rows append across resumes and
fan out to trackers; samples.jsonl; the metric names' table."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from miles_async.observe import (
    METRICS,
    RENAMED,
    EvalTrace,
    JsonlWriter,
    MetricsLog,
    SampleText,
    SampleTrace,
    StepTrace,
    TraceLog,
    UpdateTrace,
    decode_trace,
    logs,
    read_samples,
    roll_back,
    upgrade_row,
)
from miles_async.observe.names import NAMESPACES, is_known
from miles_async.observe.samples import pick

RECORDS = [
    SampleTrace(prompt_id=7, index=1, attempt=2, engine="engine-0", submit_s=0.5, end_s=1.75,
                prompt_tokens=12, output_tokens=30, versions=[3, 4], reward=1.0, finish_reason="stop",
                dropped=""),
    SampleTrace(prompt_id=8, index=0, engine="engine-1", submit_s=1.0, end_s=2.0, prompt_tokens=5,
                output_tokens=3, versions=[1], finish_reason="abort", dropped="aborted"),
    StepTrace(step=4, weight_version=4, start_s=10.0, end_s=12.5, wait_data_s=0.5, train_s=1.5,
              update_s=0.5, num_samples=64, num_tokens=4096, staleness_mean=0.75, staleness_max=2),
    UpdateTrace(version=4, start_s=12.0, end_s=12.5, transport="shm", num_bytes=1 << 20, paused_s=0.25),
    EvalTrace(step=4, score=0.6, num_samples=128, mode="greedy"),
]


def test_every_record_kind_round_trips(tmp_path: Path):
    with TraceLog(tmp_path) as trace:
        for record in RECORDS:
            trace.write(record)
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["sample", "sample", "train_step",
                                                             "weight_update", "eval"]
    assert decode_trace(tmp_path / "trace.jsonl") == RECORDS


def test_a_malformed_line_is_named_by_its_number(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(RECORDS[-1])
        writer.write({"kind": "eval", "step": 1})  # missing fields
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: .*score"):
        decode_trace(path)

    path.write_text(json.dumps({"kind": "eval", "step": 1, "score": 0.5, "num_samples": 1, "mode": "g"})
                    + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"trace\.jsonl:3: "):
        decode_trace(path)

    path.write_text('{"kind": "mystery"}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: .*mystery"):
        decode_trace(path)


def test_metrics_rows_append_across_two_writers(tmp_path: Path):
    with MetricsLog(tmp_path) as metrics:
        metrics.log({"step": 1, "rollout/reward_mean": 0.25, "train/num_samples": 64})
        metrics.log({"step": 2, "rollout/reward_mean": 0.5, "train/num_samples": 64})
    with MetricsLog(tmp_path) as metrics:  # the run resumes
        metrics.log({"step": 3, "rollout/reward_mean": 0.75, "eval/score": 0.5})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[2] == {"step": 3, "rollout/reward_mean": 0.75, "eval/score": 0.5}
    assert not (tmp_path / "tensorboard").exists()  # TensorBoard is asked for ([observe] tensorboard), not implied


def test_a_torn_last_line_is_cut_off_when_the_run_resumes(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 0.5}\n{"step": 2, "lo')  # a crash mid-write
    with JsonlWriter(path) as writer:
        writer.write({"step": 2, "loss": 0.25})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_each_line_is_on_disk_before_close(tmp_path: Path):
    writer = JsonlWriter(tmp_path / "sub" / "x.jsonl")
    writer.write({"step": 1})
    assert (tmp_path / "sub" / "x.jsonl").read_text() == '{"step":1}\n'
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 2})


def test_numpy_scalars_are_written_as_numbers(tmp_path: Path):
    np = pytest.importorskip("numpy")
    with MetricsLog(tmp_path) as metrics:
        metrics.log({"step": np.int64(1), "loss": np.float32(0.5)})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5}


def test_observe_stays_a_leaf():
    """observe is imported by tools that must not pull in the actors, engine or transport."""
    folder = Path(logs.__file__).parent
    for source in folder.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("miles_async.") or name.startswith("miles_async.observe"), (
                    f"{source.name} imports {name}")
                assert name.split(".")[0] not in ("actors", "transport"), f"{source.name}: {name}"


class ListTracker:
    """A tracker that keeps what it is given: MetricsLog's fan-out is under test, not a tracker."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.samples: list[tuple[int, list[SampleText]]] = []
        self.closed = 0

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def log_samples(self, step: int, samples) -> None:
        self.samples.append((step, list(samples)))

    def close(self) -> None:
        self.closed += 1


def _text(step: int, index: int) -> SampleText:
    return SampleText(step=step, prompt_id=3, index=index, prompt="reverse: abc", completion="cba", reward=1.0,
                      versions=[step - 1], finish_reason="stop", num_prompt_tokens=4, num_generated_tokens=2)


def test_rows_and_samples_fan_out_and_samples_roll_back_with_a_resume(tmp_path: Path):
    tracker = ListTracker()
    with MetricsLog(tmp_path, trackers=[tracker]) as metrics:
        assert metrics.samples_bytes() == 0 and not metrics.samples_path.exists()  # made on first use
        metrics.log({"step": 1, "train/loss": 0.5})
        metrics.log_samples(1, [_text(1, 0), _text(1, 1)])
        kept = metrics.samples_bytes()  # a checkpoint after step 1 records this
        metrics.log({"step": 2, "train/loss": 0.25})
        metrics.log_samples(2, [_text(2, 0)])
    assert tracker.rows == [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.25}]
    assert [(step, [s.index for s in texts]) for step, texts in tracker.samples] == [(1, [0, 1]), (2, [0])]
    assert tracker.closed == 1
    assert read_samples(tmp_path / "samples.jsonl") == [_text(1, 0), _text(1, 1), _text(2, 0)]
    roll_back(tmp_path / "samples.jsonl", kept)  # --resume from that checkpoint: step 2 runs again
    assert [s.step for s in read_samples(tmp_path / "samples.jsonl")] == [1, 1]
    assert [s.step for s in read_samples(tmp_path / "samples.rolled_back.jsonl")] == [2]


def test_pick_spreads_the_chosen_samples_over_the_batch():
    assert pick(32, 4) == [0, 8, 16, 24]  # a batch of 4 groups of 8: one sample of each group
    assert pick(3, 8) == [0, 1, 2]
    assert pick(5, 0) == []


def test_every_metric_name_is_grouped_and_old_names_are_upgraded():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(name == "step" or name.split("/")[0] in NAMESPACES for name in names)
    assert len(RENAMED) == len(set(RENAMED.values()))  # no two old names onto one
    old = {"step": 3, "reward_mean": 0.5, "eval_score": 0.25, "buffer_occupancy": 0.5, "loss": 1.0,
           "eval/gsm8k/exact_match": 0.2}
    assert upgrade_row(old) == {"step": 3, "rollout/reward_mean": 0.5, "eval/score": 0.25, "buffer/occupancy": 0.5,
                                "train/loss": 1.0, "eval/gsm8k/exact_match": 0.2}
    new = {"step": 3, "rollout/reward_mean": 0.5}
    assert upgrade_row(new) == new
    assert is_known("perf/samples_per_s") and is_known("eval/gsm8k/exact_match") and not is_known("reward_mean")


def test_every_rl_row_field_is_a_documented_name_and_every_rl_name_a_field():
    """`RLRow` and the table name the same keys: a metric added to one and not the other fails here,
    naming it. A row leaves out what it does not have and flattens an lm-eval command's metrics."""
    import msgspec

    from miles_async.observe.names import RLRow

    fields = {f.encode_name for f in msgspec.structs.fields(RLRow) if f.name != "lm_eval"}
    documented = {m.name for m in METRICS if m.writer in ("rl", "both")}
    assert sorted(fields - documented) == [], "RLRow fields with no line in observe.names.METRICS"
    assert sorted(documented - fields) == [], "METRICS lines the RL row never writes (writer 'rl' or 'both')"
    values: dict[str, object] = {f.name: 1 for f in msgspec.structs.fields(RLRow) if f.required}
    row = RLRow(**values, eval_score=0.5, lm_eval={"eval/gsm8k/exact_match": 0.25}).as_dict()  # type: ignore[arg-type]
    assert row["rollout/reward_mean"] == 1 and row["eval/score"] == 0.5 and row["eval/gsm8k/exact_match"] == 0.25
    assert "perf/checkpoint_s" not in row and "train/teacher_kl" not in row and "lm_eval" not in row
    assert all(is_known(key) for key in row)
