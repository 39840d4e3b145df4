"""Trace records round-trip through JsonlWriter/decode_trace; metrics rows append across resumes."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from miles_async.observe import (
    EvalTrace,
    JsonlWriter,
    MetricsLog,
    SampleTrace,
    StepTrace,
    TraceLog,
    UpdateTrace,
    decode_trace,
    logs,
)

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
    with MetricsLog(tmp_path, tensorboard=False) as metrics:
        metrics.log({"step": 1, "reward_mean": 0.25, "num_samples": 64})
        metrics.log({"step": 2, "reward_mean": 0.5, "num_samples": 64})
    with MetricsLog(tmp_path, tensorboard=False) as metrics:  # the run resumes
        metrics.log({"step": 3, "reward_mean": 0.75, "eval_score": 0.5})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[2] == {"step": 3, "reward_mean": 0.75, "eval_score": 0.5}


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
    with MetricsLog(tmp_path, tensorboard=False) as metrics:
        metrics.log({"step": np.int64(1), "loss": np.float32(0.5)})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5}


def test_without_tensorboard_it_says_so_once(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr(logs.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(logs, "_tensorboard_unavailable_said", False)
    with caplog.at_level(logging.DEBUG, logger="miles_async.observe"):
        for _ in range(2):
            with MetricsLog(tmp_path) as metrics:
                metrics.log({"step": 1, "loss": 1.0})
    said = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # a detail: the terminal stays quiet


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
