"""Append-only JSONL logs of a run: `metrics.jsonl` (one row per train step) and `trace.jsonl`.

Both files are opened in append mode, so a resumed run continues the same files; each line is
flushed as it is written, so a crash loses at most the line being written. A line torn by a
crash (no final newline) is cut off when the file is reopened, so that the first new line does
not fuse with it into one malformed line.

Metrics rows are plain dicts of numbers. The controller writes these keys (the plots in
`observe.plot` read them; any may be absent from a row):

    step, wall_s, reward_mean (scored samples only), unscored_fraction (the batch's samples whose
    environment gave no reward), eval_score (eval steps only; with an lm-eval command also
    eval/<task>/<metric> for each metric it returned), logprob_abs_diff, staleness_mean,
    staleness_max, num_samples, num_tokens, num_forward_tokens (num_tokens less the repeats of
    prompts the trainer ran once per group), samples_per_s, step_s, wait_data_s, train_s,
    update_s, trainer_idle_fraction, engine_busy_fraction, buffer_occupancy, dropped_stale,
    dropped_aborted, dropped_filtered, loss, grad_norm, entropy, tis_truncated_fraction and
    mis_masked_fraction (trained tokens whose TIS weight hit the cap, or which MIS dropped),
    response_len_mean (generated tokens per trained sample); with a distillation teacher also teacher_kl (mean per-token
    rollout log-prob - teacher log-prob over the trained tokens: the reverse KL's estimate),
    teacher_s and teacher_wait_s (the teacher's scoring requests and their queue, summed over the
    step's samples), teacher_busy_fraction (the share of the step the teacher had work); with
    loop.offload_engines also engine_resume_s (the engines taking their memory back before the
    push that preceded this step's batch; 0 on the first step) and engine_release_s (giving it
    back before this step trained); spec_accept_rate (the batch's draft tokens the engines
    accepted; 0 without speculative decoding), spec_accept_length (its tokens per decoding step; 1
    without) and draft_ce (the draft head's cross-entropy in this step's training; 0 when not trained)

`MetricsLog` also mirrors every numeric value to TensorBoard under `RUN_DIR/tensorboard/` when
`torch.utils.tensorboard` can be used (it needs the optional `tensorboard` package); otherwise
it says so once at INFO and carries on with the JSONL file alone.

Try it:

    with MetricsLog("runs/demo") as metrics, TraceLog("runs/demo") as trace:
        metrics.log({"step": 1, "reward_mean": 0.25})
        trace.write(EvalTrace(step=1, score=0.5, num_samples=64, mode="greedy"))
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from miles_async.observe.records import TraceRecord

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["METRICS_FILE", "TRACE_FILE", "JsonlWriter", "MetricsLog", "TraceLog"]

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


_tensorboard_unavailable_said = False


def _open_tensorboard(log_dir: Path) -> Any | None:
    """A SummaryWriter, or None (said once per process) when TensorBoard cannot be used."""
    global _tensorboard_unavailable_said
    # find_spec first: importing torch.utils.tensorboard costs a torch import, and without the
    # `tensorboard` package it can only fail.
    reason = None
    if importlib.util.find_spec("tensorboard") is None:
        reason = "the `tensorboard` package is not installed"
    else:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            reason = f"torch.utils.tensorboard does not import ({e})"
    if reason is not None:
        if not _tensorboard_unavailable_said:
            _tensorboard_unavailable_said = True
            log.debug("TensorBoard mirror off: %s; metrics go to %s only", reason, METRICS_FILE)
        return None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsLog:
    """`RUN_DIR/metrics.jsonl`, one row per train step, mirrored to TensorBoard when available.

    `tensorboard=False` turns the mirror off without a word.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self._writer = JsonlWriter(self.run_dir / METRICS_FILE)
        self._tensorboard = _open_tensorboard(self.run_dir / "tensorboard") if tensorboard else None

    @property
    def path(self) -> Path:
        return self._writer.path

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (a dict of numbers; `step` names the x-axis in TensorBoard)."""
        if not isinstance(row, dict):
            raise TypeError(f"a metrics row is a dict of numbers, got {type(row).__name__}: {row!r}")
        self._writer.write(row)
        if self._tensorboard is not None:
            step = row.get("step")
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

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
