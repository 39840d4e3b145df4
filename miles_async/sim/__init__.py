"""The built-in simulator (installed as `miles_async.sim`): replay a run's trace to choose settings.

A small real run records `RUN_DIR/trace.jsonl`. The simulator fits cost models to it (how long
a sample takes to generate on an engine at a given concurrency, a train step per token, a
weight update), then runs the loop's own refill and buffer policies on a virtual clock with
engines, trainer and pushes replaced by those models, under any settings: more engines, another
staleness, group-level refill, a bigger buffer. An answer takes seconds instead of GPU hours.

    trace.py     load and check a trace (one segment, times from 0)     `load_trace`, `write_trace`
    costs.py     the cost models and their fit                          `fit_costs`, `CostModel`
    workload.py  what the simulated samples are (recorded or drawn)     `RecordedWorkload`, `SyntheticWorkload`
    simulate.py  the discrete-event loop                                `simulate`, `SimConfig`, `SimResult`
    report.py    the numbers, measured the same way for runs and sims   `measure`, `compare`, `RunStats`
    synthetic.py planning scenarios at scales this machine cannot run    `SCENARIOS`, `synthesize`
    plot.py      the timeline and sweep pictures, the sweep table       `plot_timeline`, `plot_sweep`
    cli.py       `miles-async sim TRACE.jsonl [--set k=v] [--sweep k=v1,v2] [--json]`

It never imports an engine, a transport, an actor or ZeroMQ (the policies are pure); the import
rules in docs/design.md hold it to that.
"""

from miles_async.sim.costs import CostModel, GenCost, TeacherCost, TrainCost, UpdateCost, fit_costs
from miles_async.sim.report import RunStats, compare, measure, staleness_distance
from miles_async.sim.simulate import SimConfig, SimResult, simulate
from miles_async.sim.trace import Trace, TraceError, load_trace, write_trace
from miles_async.sim.workload import RecordedWorkload, SampleSpec, SyntheticWorkload

__all__ = [
    "CostModel", "GenCost", "RecordedWorkload", "RunStats", "SampleSpec", "SimConfig", "SimResult", "SyntheticWorkload",
    "TeacherCost", "Trace", "TraceError", "TrainCost", "UpdateCost", "compare", "fit_costs", "load_trace", "measure", "simulate",
    "staleness_distance", "write_trace",
]
