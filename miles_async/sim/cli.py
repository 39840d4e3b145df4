"""`miles-async sim`: replay a trace (or a synthetic scenario) under what-if settings.

    miles-async sim runs/x/trace.jsonl                          # the run's own settings: predicted vs measured
    miles-async sim runs/x/trace.jsonl --set num_engines=4 --set mode=sync
    miles-async sim runs/x/trace.jsonl --sweep max_staleness=0,1,2,4 --sweep-plot sweep.png
    miles-async sim runs/x/trace.jsonl --timeline timeline.png --json
    miles-async sim --synthetic agentic-64gpu --write agentic.jsonl

`--set KEY=VALUE` changes one setting: a `SimConfig` field (num_engines, trainer_world_size, mode,
max_staleness, group_size, batch_groups, target_in_flight, max_in_flight_per_engine, refill,
partial, capacity_groups, filter, on_stale, on_abort, eval_every, num_steps, costs), a cost-model
field (`gen.token_s`, `train.per_token_s`, `update.push_s`, `eval_s`, ...) or, for a synthetic
scenario, a workload field (`workload.turns_max`, ...). `--sweep KEY=V1,V2,...` runs one
simulation per value (several `--sweep`s: every combination) and prints a table.

The argument parsing is in `miles_async.launch.cli`; this module does the work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from miles_async.sim.costs import CostModel, fit_costs
from miles_async.sim.plot import plot_sweep, plot_timeline, sweep_table
from miles_async.sim.report import RunStats, compare, measure, trace_intervals
from miles_async.sim.simulate import SimConfig, SimResult, simulate
from miles_async.sim.synthetic import scenario, write
from miles_async.sim.trace import Trace, load_trace
from miles_async.sim.workload import RecordedWorkload, SyntheticWorkload, Workload

SWEEP_METRICS = ("step_s_mean", "step_s_p90", "samples_per_s", "trainer_idle_fraction", "engine_utilization",
                 "staleness_mean", "dropped")


class Setup(msgspec.Struct, kw_only=True):
    """What one simulation needs; `trace` is None for a synthetic scenario."""

    config: SimConfig
    costs: CostModel
    workload: Any
    trace: Trace | None = None
    train_s_by_step: dict[int, float] = {}


def parse_value(text: str) -> Any:
    """A --set value: JSON (numbers, true/false, null, quoted strings), else the bare word."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def apply_setting(setup: Setup, key: str, value: Any) -> Setup:
    """`setup` with one setting changed; ValueError naming the key and what keys there are."""
    head, _, rest = key.partition(".")
    try:
        if not rest and key in SimConfig.__struct_fields__:
            config = msgspec.convert({**msgspec.structs.asdict(setup.config), key: value}, SimConfig, strict=False)
            return msgspec.structs.replace(setup, config=config)
        if head in ("gen", "train", "update") and rest:
            part = getattr(setup.costs, head)
            if rest not in part.__struct_fields__:
                raise ValueError(f"no cost field {key!r}; {head}.* has: {', '.join(part.__struct_fields__)}")
            new = msgspec.convert({**msgspec.structs.asdict(part), rest: value}, type(part), strict=False)
            return msgspec.structs.replace(setup, costs=msgspec.structs.replace(setup.costs, **{head: new}))
        if key == "eval_s":
            return msgspec.structs.replace(setup, costs=msgspec.structs.replace(setup.costs, eval_s=float(value)))
        if head == "workload" and rest:
            if not isinstance(setup.workload, SyntheticWorkload):
                raise ValueError(f"{key!r}: workload fields are settable for a synthetic scenario only (a trace's "
                                 "samples are what was recorded)")
            if rest not in SyntheticWorkload.__struct_fields__:
                raise ValueError(f"no workload field {rest!r}; workload.* has: "
                                 f"{', '.join(SyntheticWorkload.__struct_fields__)}")
            workload = msgspec.convert({**msgspec.structs.asdict(setup.workload), rest: value}, SyntheticWorkload,
                                       strict=False)
            return msgspec.structs.replace(setup, workload=workload)
    except msgspec.ValidationError as e:
        raise ValueError(f"--set {key}={value!r}: {e}") from e
    raise ValueError(f"unknown setting {key!r}; settings are {', '.join(SimConfig.__struct_fields__)}, "
                     "gen.*, train.*, update.*, eval_s (and workload.* for a synthetic scenario)")


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: write KEY=V1,V2,..., e.g. --sweep num_engines=1,2,4")
    return key, [parse_value(v) for v in values.split(",")]


def base_setup(args: argparse.Namespace) -> Setup:
    if args.synthetic:
        chosen = scenario(args.synthetic)
        return Setup(config=chosen.config, costs=chosen.costs, workload=chosen.workload)
    if not args.trace:
        raise ValueError("give a TRACE.jsonl to replay, or --synthetic NAME")
    trace = load_trace(args.trace, segment=args.segment)
    config = SimConfig.from_header(trace.header, num_steps=len(trace.steps), costs=args.costs)
    return Setup(config=config, costs=fit_costs(trace), workload=RecordedWorkload(trace), trace=trace,
                 train_s_by_step={s.step: s.train_s for s in trace.steps} if args.costs == "replay" else {})


def run_one(setup: Setup, *, record: bool = False) -> SimResult:
    workload: Workload = setup.workload
    by_step = setup.train_s_by_step if setup.config.costs == "replay" else None
    return simulate(setup.config, setup.costs, workload, record=record, train_s_by_step=by_step)


def _row(stats: RunStats) -> dict[str, Any]:
    row = msgspec.structs.asdict(stats)
    row["dropped"] = sum(stats.dropped.values())
    return row


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except (ValueError, OSError, RuntimeError) as e:  # bad input: one clear line, no traceback
        print(f"miles-async sim: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    setup = base_setup(args)
    own = setup.config
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set num_engines=4")
        setup = apply_setting(setup, key, parse_value(value))
    record = bool(args.timeline or args.write)
    result = run_one(setup, record=record)
    report: dict[str, Any] = {"config": msgspec.to_builtins(setup.config), "costs": msgspec.to_builtins(setup.costs),
                              "predicted": msgspec.to_builtins(result.stats),
                              "sim": {"wall_s": result.wall_s, "num_events": result.num_events}}
    if setup.trace is not None:
        measured = measure(setup.trace)
        report["trace"] = {"path": setup.trace.path, "segment": setup.trace.segment,
                           "num_segments": setup.trace.num_segments, "num_samples": len(setup.trace.samples)}
        report["measured"] = msgspec.to_builtins(measured)
        if setup.config == own:  # the run's own settings: how far the prediction is from what happened
            report["errors"] = compare(result.stats, measured)
    if args.write:
        report["wrote_trace"] = str(write(result, args.write))
    if args.timeline:
        window = _window(result.intervals, args.window_steps)
        report["timeline"] = str(plot_timeline(result.intervals, args.timeline, versions=result.versions,
                                               title="simulated: " + _title(setup), window=window))
        if setup.trace is not None:  # the recorded run beside it, over its own last steps
            intervals, versions = trace_intervals(setup.trace)
            path = Path(args.timeline)
            report["timeline_recorded"] = str(plot_timeline(
                intervals, path.with_name(f"{path.stem}-recorded{path.suffix}"), versions=versions,
                title="recorded: " + _title(msgspec.structs.replace(setup, config=own)),
                window=_window(intervals, args.window_steps)))
    if args.sweep:
        report["sweep"] = sweep(setup, [parse_sweep(s) for s in args.sweep], args.sweep_plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(human(report))
    return 0


def sweep(setup: Setup, axes: list[tuple[str, list[Any]]], plot_path: str | None) -> list[dict[str, Any]]:
    rows = []
    for values in itertools.product(*(v for _, v in axes)):
        changed = setup
        for (key, _), value in zip(axes, values):
            changed = apply_setting(changed, key, value)
        row = {key: value for (key, _), value in zip(axes, values)}
        if len(axes) > 1:
            row["setting"] = ",".join(f"{k}={v}" for (k, _), v in zip(axes, values))
        row.update(_row(run_one(changed).stats))
        rows.append(row)
    key = axes[0][0] if len(axes) == 1 else "setting"
    if plot_path:
        plot_sweep(rows, key, plot_path, metrics=("step_s_mean", "samples_per_s", "trainer_idle_fraction",
                                                  "engine_utilization"), title=f"sweep of {key}")
    return rows


def _title(setup: Setup) -> str:
    c = setup.config
    source = Path(setup.trace.path).name if setup.trace is not None else "synthetic"
    return (f"{source}: {c.mode} (staleness {c.staleness}), {c.num_engines} engine(s), "
            f"{c.batch_groups}x{c.group_size} samples/step, {c.refill}-level refill")


def _window(intervals: list, num_steps: int) -> tuple[float, float] | None:
    """The last `num_steps` steps (the whole run when 0): a long run's bars are too thin to see."""
    ends = sorted(i.end for i in intervals if i.lane == "trainer" and i.kind == "train")
    if num_steps <= 0 or len(ends) <= num_steps:
        return None
    return (ends[-num_steps - 1], ends[-1])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def human(report: dict[str, Any]) -> str:
    lines = []
    if "trace" in report:
        t = report["trace"]
        lines.append(f"trace {t['path']} (segment {t['segment'] + 1} of {t['num_segments']}, {t['num_samples']} "
                     "samples)")
    c = report["config"]
    staleness = {"sync": 0, "one_step_off": 1}.get(c["mode"], c["max_staleness"])
    lines.append(f"settings: {c['mode']} (staleness {staleness}), {c['num_engines']} engine(s), "
                 f"{c['trainer_world_size']} trainer rank(s), {c['batch_groups']}x{c['group_size']} samples/step, "
                 f"{c['target_in_flight']} in flight, {c['refill']}-level refill, partial {c['partial']}, "
                 f"{c['num_steps']} steps, {c['costs']} costs")
    g, tr, u = report["costs"]["gen"], report["costs"]["train"], report["costs"]["update"]
    lines.append(f"costs: decode step {g['token_s'] * 1e3:.3g} ms + {g['token_s_per_seq'] * 1e3:.3g} ms/sequence"
                 + (f" (+ {g['shared_token_s'] * 1e3:.3g} ms + {g['shared_token_s_per_seq'] * 1e3:.3g} ms/sequence "
                    "while the trainer trains)" if g['shared_token_s'] or g['shared_token_s_per_seq'] else "")
                 + f", prefill {g['prefill_s'] * 1e3:.3g} ms, dispatch {g['dispatch_s'] * 1e3:.3g} ms; train "
                 f"{tr['base_s']:.3g} s + {tr['per_token_s'] * 1e6:.3g} us/token; update export {u['export_s']:.3g} s, "
                 f"push {u['push_s']:.3g} s (paused {u['paused_s']:.3g} s)")
    keys = ("step_s_mean", "step_s_p50", "step_s_p90", "step_s_p99", "samples_per_s", "tokens_per_s",
            "trainer_idle_fraction", "engine_utilization", "staleness_mean")
    p, m = report["predicted"], report.get("measured")
    header = f"{'':24}{'predicted':>12}" + (f"{'measured':>12}" if m else "")
    lines.append(header)
    for key in keys:
        lines.append(f"{key:24}{_fmt(p[key]):>12}" + (f"{_fmt(m[key]):>12}" if m else ""))
    lines.append(f"staleness (fraction of groups): predicted {_dist(p['staleness'])}"
                 + (f"; measured {_dist(m['staleness'])}" if m else ""))
    if p["dropped"]:
        lines.append("dropped groups (predicted): " + ", ".join(f"{n} {why}" for why, n in p["dropped"].items()))
    if "errors" in report:
        e = report["errors"]
        lines.append(f"prediction error: step time {e['step_s_mean']:+.1%}, throughput {e['samples_per_s']:+.1%}, "
                     f"staleness distribution distance {e['staleness_tv']:.3f}")
    lines.append(f"simulated in {report['sim']['wall_s']:.2f} s ({report['sim']['num_events']} events)")
    for key in ("timeline", "timeline_recorded", "wrote_trace"):
        if key in report:
            lines.append(f"wrote {report[key]}")
    if "sweep" in report:
        rows = report["sweep"]
        key = "setting" if "setting" in rows[0] else next(iter(rows[0]))
        lines.append(sweep_table(rows, key, metrics=SWEEP_METRICS))
    return "\n".join(lines)


def _dist(staleness: dict) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in sorted(staleness.items(), key=lambda kv: int(kv[0])))


__all__ = ["Setup", "apply_setting", "base_setup", "human", "main", "parse_sweep", "parse_value", "run_one", "sweep"]
