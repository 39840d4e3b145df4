"""Append-only JSONL logs of a run: `metrics.jsonl` (one row per train step), `samples.jsonl` and `trace.jsonl`.

The files are opened in append mode, so a resumed run continues the same files; each line is
flushed as it is written, so a crash loses at most the line being written. A line torn by a
crash (no final newline) is cut off when the file is reopened, so that the first new line does
not fuse with it into one malformed line.

Metrics rows are plain dicts of numbers, keyed by grouped names: `rollout/...` (what generation
produced: `rollout/reward_mean`, `rollout/response_len_mean`), `train/...` (the optimizer step:
`train/loss`, `train/grad_norm`, `train/entropy`, `train/kl`, `train/logprob_abs_diff`),
`perf/...` (time and throughput: `perf/step_s`, `perf/samples_per_s`), `eval/...` (`eval/score`,
an lm-eval command's `eval/<task>/<metric>`), `buffer/...` (`buffer/occupancy`,
`buffer/dropped_stale`), and the plain `step`, the x-axis. Every key, what it means and which
run writes it (the RL controller, `miles-async sft`) is in ONE table, `observe.names.METRICS`
(`python -m miles_async.observe.names` prints it; the RL controller builds its rows typed, as
`observe.names.RLRow`); any key may be absent from a row. Runs written before the names were
grouped used flat names (`reward_mean`, `loss`, `eval_score`): `observe.names.upgrade_row`
renames them for readers.

`MetricsLog` fans each row out to the trackers `[observe]` asks for (`observe.trackers`: wandb,
TensorBoard) under the same names, and with `observe.log_samples` writes the decoded samples of
each step to `samples.jsonl` (`observe.samples.SampleText`) and the trackers' tables.

Try it:

    with MetricsLog("runs/demo") as metrics, TraceLog("runs/demo") as trace:
        metrics.log({"step": 1, "rollout/reward_mean": 0.25})
        trace.write(EvalTrace(step=1, score=0.5, num_samples=64, mode="greedy"))
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from miles_async.observe.records import TraceRecord
from miles_async.observe.samples import SAMPLES_FILE, SampleText

if TYPE_CHECKING:
    from typing_extensions import Self

    from miles_async.observe.trackers import Tracker

__all__ = ["METRICS_FILE", "SAMPLES_FILE", "TRACE_FILE", "JsonlWriter", "MetricsLog", "TraceLog", "roll_back"]

log = logging.getLogger("miles_async.observe")

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.jsonl"


def _to_builtin(obj: Any) -> Any:
    # numpy and torch scalars reach the metrics from the trainer; `.item()` makes them plain.
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"cannot write a {type(obj).__name__} to a JSONL log: {obj!r}")


_encoder = msgspec.json.Encoder(enc_hook=_to_builtin)


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line that has no newline: the remains of a write cut short by a crash."""
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Walk back in blocks to the last newline; a whole-file read could be large.
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        log.warning("%s: cutting off a torn last line (%d bytes) left by an earlier run",
                    path, size - keep)
        f.truncate(keep)


def roll_back(path: Path, size: int) -> int:
    """Cut the JSONL file at `path` back to its first `size` bytes (what it held when a checkpoint
    was taken), appending the lines cut to `<stem>.rolled_back.jsonl` beside it: a resumed run
    writes those steps again, so the file keeps one line per step. Returns the bytes moved."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end <= size:
            return 0
        f.seek(size)
        cut = f.read()
        with path.with_name(f"{path.stem}.rolled_back.jsonl").open("ab") as out:
            out.write(cut if cut.endswith(b"\n") else cut + b"\n")
        f.truncate(size)
    return len(cut)


class JsonlWriter:
    """Appends one JSON object per line to `path`, flushing each line. A context manager.

    `write` takes a msgspec Struct (a trace record) or a dict. The parent folder is created.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _cut_torn_tail(self.path)
        self._file: IO[bytes] | None = self.path.open("ab")

    def write(self, record: msgspec.Struct | dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"JsonlWriter({self.path}) is closed; open a new one to append")
        self._file.write(_encoder.encode(record) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MetricsLog:
    """`RUN_DIR/metrics.jsonl`, one row per train step, fanned out to `trackers` (closed with it);
    `RUN_DIR/samples.jsonl`, made on the first `log_samples`."""

    def __init__(self, run_dir: str | Path, *, trackers: Sequence[Tracker] = ()) -> None:
        self.run_dir = Path(run_dir)
        self._writer = JsonlWriter(self.run_dir / METRICS_FILE)
        self._samples: JsonlWriter | None = None
        self.trackers: list[Tracker] = list(trackers)

    @property
    def path(self) -> Path:
        return self._writer.path

    @property
    def samples_path(self) -> Path:
        return self.run_dir / SAMPLES_FILE

    def samples_bytes(self) -> int:
        """How long samples.jsonl is (0: not written): a checkpoint's record of it."""
        return self.samples_path.stat().st_size if self.samples_path.exists() else 0

    def add_trackers(self, trackers: Sequence[Tracker]) -> None:
        """Trackers opened after the log was (their rows start with the next one)."""
        self.trackers.extend(trackers)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (a dict of numbers; `step` is the x-axis of the trackers)."""
        if not isinstance(row, dict):
            raise TypeError(f"a metrics row is a dict of numbers, got {type(row).__name__}: {row!r}")
        self._writer.write(row)
        for tracker in self.trackers:
            tracker.log(row)

    def log_samples(self, step: int, samples: Sequence[SampleText]) -> None:
        """The decoded samples of step `step`: one line each in samples.jsonl, a table in the trackers."""
        if not samples:
            return
        if self._samples is None:
            self._samples = JsonlWriter(self.samples_path)
        for sample in samples:
            self._samples.write(sample)
        for tracker in self.trackers:
            tracker.log_samples(step, samples)

    def close(self) -> None:
        """Close the files and the trackers (wandb's run finishes). Safe to call twice."""
        self._writer.close()
        if self._samples is not None:
            self._samples.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TraceLog:
    """`RUN_DIR/trace.jsonl`: the run's trace records (schema in `observe.records`)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._writer = JsonlWriter(self.run_dir / TRACE_FILE)

    @property
    def path(self) -> Path:
        return self._writer.path

    def write(self, record: TraceRecord) -> None:
        if not isinstance(record, msgspec.Struct):
            raise TypeError(f"a trace record is a RunTrace/SampleTrace/StepTrace/UpdateTrace/EvalTrace/EngineTrace, "
                            f"got {type(record).__name__}")
        self._writer.write(record)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
