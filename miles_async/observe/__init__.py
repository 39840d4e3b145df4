"""Run observability: metrics.jsonl, samples.jsonl, trace.jsonl, trackers, the live display and plots.

Every run writes into its own folder RUN_DIR:

    RUN_DIR/metrics.jsonl   one row (a dict of numbers) per train step      `MetricsLog`
    RUN_DIR/samples.jsonl   observe.log_samples decoded samples per step    `SampleText`
    RUN_DIR/trace.jsonl     tagged records: samples, train steps, weight     `TraceLog`,
                            updates, evals, engines leaving and coming       `decode_trace`
                            back; the simulator's input
    RUN_DIR/tensorboard/    observe.tensorboard: the metrics and samples     `TensorBoardTracker`
    RUN_DIR/wandb/          observe.wandb: the wandb run's files             `WandbTracker`
    RUN_DIR/plots/*.png     written by `plot_run` (`miles-async plot RUN_DIR`)

and shows itself live in the terminal through `Progress`. The recipe's `[observe]` is
`ObserveConfig`.

The trace schema (field, unit, meaning) is in `observe.records`; the metric names in
`observe.names` (described in `observe.logs`; the RL controller's row is its `RLRow`); the
plots in `observe.plot`.

This package is a leaf: it imports msgspec, the standard library, and rich, matplotlib, wandb
and torch's TensorBoard writer lazily (only when the live view starts, a plot is drawn or a
tracker opens), never the actors, engine or transport, so any process (the controller, a tool
reading a finished run, the simulator) can use it cheaply.
"""

from miles_async.observe.config import ObserveConfig
from miles_async.observe.logs import METRICS_FILE, TRACE_FILE, JsonlWriter, MetricsLog, TraceLog, roll_back
from miles_async.observe.names import METRICS, RENAMED, RLRow, upgrade_row
from miles_async.observe.plot import plot_run, read_metrics
from miles_async.observe.progress import Progress
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
    decode_trace,
)
from miles_async.observe.samples import SAMPLES_FILE, SampleText, read_samples
from miles_async.observe.trackers import (
    TensorBoardTracker,
    Tracker,
    TrackerError,
    WandbTracker,
    check_trackers,
    open_trackers,
)

__all__ = [
    "ENGINE_EVENTS",
    "METRICS",
    "METRICS_FILE",
    "RENAMED",
    "SAMPLES_FILE",
    "TRACE_FILE",
    "TRACE_SCHEMA",
    "EngineTrace",
    "EvalTrace",
    "JsonlWriter",
    "MetricsLog",
    "ObserveConfig",
    "Progress",
    "RLRow",
    "RunTrace",
    "SampleText",
    "SampleTrace",
    "StepTrace",
    "TensorBoardTracker",
    "TraceLog",
    "TraceRecord",
    "Tracker",
    "TrackerError",
    "UpdateTrace",
    "WandbTracker",
    "check_trackers",
    "decode_trace",
    "open_trackers",
    "plot_run",
    "read_metrics",
    "read_samples",
    "roll_back",
    "upgrade_row",
]
