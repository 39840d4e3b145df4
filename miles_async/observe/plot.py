"""Plots of a finished (or running) run, from `RUN_DIR/metrics.jsonl` into `RUN_DIR/plots/`.

    reward.png        rollout/reward_mean per step, its moving mean, and eval/score where evaluated
    loss.png          train/loss (and train/pg_loss) per step with its moving mean; eval/heldout_loss (SFT)
    kl.png            train/kl (to the reference), train/rollout_kl_k3 (rollout vs trainer), train/teacher_kl
    entropy.png       train/entropy per step with its moving mean
    grad_norm.png     train/grad_norm per step with its moving mean
    response_len.png  rollout/response_len_mean: generated tokens per trained sample
    mismatch.png      train/logprob_abs_diff per step: trainer vs engine log-probabilities
    step_time.png     perf/wait_data_s / perf/train_s / perf/update_s per step, stacked
    staleness.png     train/staleness_mean and train/staleness_max per step

Every plot is written even when its keys are absent from the rows (it then says so on the
canvas), so the set of files does not depend on the run's settings (an SFT run has no reward;
its loss.png is the one to read). When a resumed run logged a step twice, the later row wins. A
run written before the metric names were grouped (`reward_mean`, `loss`) is read with its names
upgraded (`observe.names.upgrade_row`).

Run it: `miles-async plot RUN_DIR`, or `plot_run(RUN_DIR)` from Python.

matplotlib is imported here lazily and used through `Figure` and the Agg canvas directly, never
`pyplot`, so no display is needed and the host process's backend is left alone.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_async.observe.logs import METRICS_FILE
from miles_async.observe.names import upgrade_row

__all__ = ["figures", "main", "plot_run", "read_metrics"]

PLOTS_DIR = "plots"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, one per step, sorted by step (a later duplicate wins), with
    the flat names of older runs upgraded to the grouped ones.

    Raises FileNotFoundError when the file is missing, ValueError naming the line for a line
    that is not a JSON object with a numeric `step`, and ValueError for a file with no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; is this a run folder written by miles-async?")
    by_step: dict[float, dict[str, Any]] = {}
    with path.open("r", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # A line cut short by a crash is the usual cause.
                raise ValueError(f"{path}:{line_number}: not valid JSON ({e.msg}); "
                                 f"line starts {line[:80]!r}") from e
            # A wrong shape is still a malformed file, hence ValueError (not TypeError) below.
            step = row.get("step") if isinstance(row, dict) else None
            problem = None
            if not isinstance(row, dict):
                problem = f"a metrics row is a JSON object, got {type(row).__name__}"
            elif isinstance(step, bool) or not isinstance(step, (int, float)):
                problem = f"a metrics row needs a numeric `step`, got {step!r}"
            if problem is not None:
                raise ValueError(f"{path}:{line_number}: {problem}")
            by_step[step] = upgrade_row(row)
    if not by_step:
        raise ValueError(f"{path}: no metrics rows yet (the file is empty); "
                         f"rows appear after the first train step")
    return [by_step[step] for step in sorted(by_step)]


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    """`key` of every row, NaN where absent or not a number (NaN is a gap in a matplotlib line)."""
    out = []
    for row in rows:
        value = row.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        out.append(float(value) if ok else math.nan)
    return out


def _moving_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values that are numbers; NaN until one is seen."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(seen) / len(seen) if seen else math.nan)
    return out


def _has_data(values: list[float]) -> bool:
    return any(not math.isnan(v) for v in values)


def _new_figure(title: str) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _say_no_data(ax: Any, keys: str) -> None:
    ax.text(0.5, 0.5, f"no {keys} in {METRICS_FILE}", transform=ax.transAxes,
            ha="center", va="center", color="gray")


def _plot_smoothed(ax: Any, steps: list[float], rows: list[dict[str, Any]], keys: Sequence[str], ylabel: str,
                   points: Sequence[str] = ()) -> None:
    """Each of `keys` per step, faint, with its moving mean over it; each of `points` (e.g. an
    eval's score, logged on some steps only) as dots."""
    series = {key: _series(rows, key) for key in [*keys, *points]}
    if not any(_has_data(values) for values in series.values()):
        _say_no_data(ax, " or ".join([*keys, *points]))
        return
    window = max(1, min(20, len(rows) // 10))
    for key, color in zip(keys, ("tab:blue", "tab:green", "tab:purple")):
        values = series[key]
        if not _has_data(values):
            continue
        ax.plot(steps, values, color=color, alpha=0.35 if window > 1 else 1.0, linewidth=1, label=key)
        if window > 1:
            ax.plot(steps, _moving_mean(values, window), color=color, linewidth=2,
                    label=f"{key}, moving mean ({window} steps)")
    for key, color in zip(points, ("tab:red", "tab:orange")):
        if _has_data(series[key]):
            ax.plot(steps, series[key], "o", color=color, markersize=5, label=key)
    ax.set_ylabel(ylabel)
    ax.legend(loc="best", fontsize="small")


def _plot_lines(ax: Any, steps: list[float], rows: list[dict[str, Any]], keys: list[str], ylabel: str) -> None:
    plotted = False
    for key in keys:
        values = _series(rows, key)
        if _has_data(values):
            ax.plot(steps, values, linewidth=1.5, label=key)
            plotted = True
    if not plotted:
        _say_no_data(ax, " or ".join(keys))
        return
    ax.set_ylabel(ylabel)
    ax.legend(loc="best")


def _plot_step_time(ax: Any, steps: list[float], rows: list[dict[str, Any]]) -> None:
    keys = ["perf/wait_data_s", "perf/train_s", "perf/update_s"]
    series = [_series(rows, key) for key in keys]
    if not any(_has_data(values) for values in series):
        _say_no_data(ax, " or ".join(keys))
        return
    # A missing part of a step counts as zero time: stacking needs a number in every column.
    stacked = [[0.0 if math.isnan(v) else v for v in values] for values in series]
    ax.stackplot(steps, *stacked, labels=keys, alpha=0.8)
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left")


def figures(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(file name, matplotlib Figure) of each plot of `rows` (as `read_metrics` returns them)."""
    steps = _series(rows, "step")
    out = []
    for name, title, draw in [
        ("reward.png", "Reward",
         lambda ax: _plot_smoothed(ax, steps, rows, ["rollout/reward_mean"], "reward", points=["eval/score"])),
        ("loss.png", "Loss", lambda ax: _plot_smoothed(ax, steps, rows, ["train/loss", "train/pg_loss"], "loss",
                                                       points=["eval/heldout_loss"])),
        ("kl.png", "KL divergence (per token)",
         lambda ax: _plot_lines(ax, steps, rows, ["train/kl", "train/rollout_kl_k3", "train/teacher_kl"], "nats")),
        ("entropy.png", "Entropy of the policy (per token)",
         lambda ax: _plot_smoothed(ax, steps, rows, ["train/entropy"], "nats")),
        ("grad_norm.png", "Gradient norm (before clipping)",
         lambda ax: _plot_smoothed(ax, steps, rows, ["train/grad_norm"], "norm")),
        ("response_len.png", "Response length",
         lambda ax: _plot_smoothed(ax, steps, rows, ["rollout/response_len_mean"], "generated tokens per sample")),
        ("mismatch.png", "Trainer vs engine log-prob mismatch",
         lambda ax: _plot_lines(ax, steps, rows, ["train/logprob_abs_diff"], "mean |logp_train - logp_engine|")),
        ("step_time.png", "Time per train step", lambda ax: _plot_step_time(ax, steps, rows)),
        ("staleness.png", "Staleness (weight versions behind)",
         lambda ax: _plot_lines(ax, steps, rows, ["train/staleness_mean", "train/staleness_max"], "versions")),
    ]:
        fig, ax = _new_figure(title)
        draw(ax)
        out.append((name, fig))
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots into RUN_DIR/plots/ and return their paths.

    Raises FileNotFoundError for a missing run folder or metrics.jsonl, ValueError for an empty
    or malformed metrics.jsonl (naming the line).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    rows = read_metrics(run_dir / METRICS_FILE)
    plots_dir = run_dir / PLOTS_DIR
    plots_dir.mkdir(exist_ok=True)
    written = []
    for name, fig in figures(rows):
        path = plots_dir / name
        fig.savefig(path, format="png")
        written.append(path)
    return written


def main(run_dir: str) -> int:
    """`miles-async plot RUN_DIR`: write the plots, print their paths; 2 for a bad run folder."""
    try:
        paths = plot_run(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"miles-async plot: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
