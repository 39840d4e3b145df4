"""Run observability: metrics.jsonl, trace.jsonl, the live progress display and plots.

Every run writes into its own folder RUN_DIR:

    RUN_DIR/metrics.jsonl   one row (a dict of numbers) per train step      `MetricsLog`
    RUN_DIR/trace.jsonl     tagged records: samples, train steps, weight     `TraceLog`,
                            updates, evals, engines leaving and coming       `decode_trace`
                            back; the simulator's input
    RUN_DIR/tensorboard/    the metrics mirrored, when `tensorboard` is installed
    RUN_DIR/plots/*.png     written by `plot_run` (`miles-async plot RUN_DIR`)

and shows itself live in the terminal through `Progress`.

The trace schema (field, unit, meaning) is in `observe.records`; the metrics keys in
`observe.logs`; the plots in `observe.plot`.

This package is a leaf: it imports msgspec, the standard library, and rich and matplotlib
lazily (only when the live view starts or a plot is drawn), never the actors, engine or
transport, so any process (the controller, a tool reading a finished run, the simulator) can use
it cheaply.
"""

from miles_async.observe.logs import METRICS_FILE, TRACE_FILE, JsonlWriter, MetricsLog, TraceLog, roll_back
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

__all__ = [
    "ENGINE_EVENTS",
    "METRICS_FILE",
    "TRACE_FILE",
    "TRACE_SCHEMA",
    "EngineTrace",
    "EvalTrace",
    "JsonlWriter",
    "MetricsLog",
    "Progress",
    "RunTrace",
    "SampleTrace",
    "StepTrace",
    "TraceLog",
    "TraceRecord",
    "UpdateTrace",
    "decode_trace",
    "plot_run",
    "read_metrics",
    "roll_back",
]
