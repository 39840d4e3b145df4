"""Pictures of a simulated run: a Gantt timeline of engines, weight pushes and trainer, and sweeps.

    plot_timeline   one lane per engine (top, natural order: engine-2 before engine-10), then a
                    "weights" lane (pushes), then the "trainer" lane (train / export / wait_data /
                    eval) at the bottom; x is seconds. Engine bars are shaded by the number of
                    samples in flight (colorbar), paused spans are orange, and thin vertical lines
                    mark where the engines got a new weight version.
    plot_sweep      one subplot per metric against a swept setting (numeric or categorical x).
    sweep_table     the same rows as an aligned plain-text table; sweep_markdown as GitHub markdown.

Try it:

    from miles_async.sim.plot import Interval, plot_timeline, sweep_table
    ivs = [Interval(lane="engine-0", start=0, end=4, kind="generate", value=8),
           Interval(lane="trainer", start=4, end=6, kind="train")]
    plot_timeline(ivs, "/tmp/timeline.png", title="toy", versions=[(6.5, 1)])
    print(sweep_table([{"engines": 2, "samples_per_s": 41.2}, {"engines": 4, "samples_per_s": 80.4}], "engines"))

A simulation may produce 10^5-10^6 intervals, so bars are drawn as one artist per colour group
(a PathPatch of one compound path of rectangles, built from numpy arrays; never one artist per
interval): 5*10^5 intervals render in about 1.5 s. Intervals in hidden lanes or outside `window`
are skipped. Bars narrower than a pixel blend (antialiasing), so zoom in with `window`. As in `miles_async.observe.plot`,
matplotlib is imported lazily and used through `Figure` and the Agg canvas, never `pyplot`, so
no display is needed and the host's backend is left alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

__all__ = ["Interval", "plot_sweep", "plot_timeline", "sweep_markdown", "sweep_table", "timeline_figure"]

DEFAULT_METRICS: tuple[str, ...] = ("step_s_mean", "samples_per_s", "trainer_idle_fraction", "engine_utilization")

TRAINER_LANE = "trainer"
WEIGHTS_LANE = "weights"

# kind -> (face colour, hatch, legend label); wait_data is light and hatched: the trainer is idle.
_FIXED_STYLES: dict[str, tuple[str, str | None, str]] = {
    "train": ("tab:green", None, "train"),
    "export": ("tab:purple", None, "export"),
    "wait_data": ("#dddddd", "////", "wait_data"),
    "eval": ("tab:red", None, "eval"),
    "push": ("tab:brown", None, "weights push"),
    "paused": ("tab:orange", None, "engine paused"),
}
# Kinds outside the list above still get drawn, in these colours, and named in the legend.
_SPARE_COLOURS = ("tab:gray", "tab:olive", "tab:cyan", "tab:pink", "black")
_GENERATE = "generate"
_GENERATE_LEVELS = 128
_HATCH_COLOUR = "0.55"
_BAR_HEIGHT = 0.8
_MAX_VERSION_LABELS = 20


class Interval(msgspec.Struct, frozen=True, kw_only=True):
    """One span of one lane of the timeline.

    lane: "trainer", "weights", or an engine name such as "engine-0" (any other name is an engine).
    kind: trainer lane: "train", "export", "wait_data", "eval"; weights lane: "push";
          engine lanes: "generate" (value = samples in flight on that engine), "paused".
    """

    lane: str
    start: float  # seconds
    end: float
    kind: str
    value: float = 0.0


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), or ImportError saying how to get matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency of miles-async
        raise ImportError("miles_async.sim.plot needs matplotlib: pip install 'matplotlib>=3.7'") from e
    return Figure, FigureCanvasAgg


def _new_figure(width: float, height: float) -> Any:
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _natural_key(name: str) -> tuple[Any, ...]:
    """engine-2 before engine-10: digit runs compare as numbers (split() alternates str, int, str...)."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


# ---------------------------------------------------------------------------------------------
# Timeline


def timeline_figure(intervals: Sequence[Interval], *, title: str = "",
                    window: tuple[float, float] | None = None, max_engine_lanes: int = 16,
                    versions: Sequence[tuple[float, int]] = ()) -> Any:
    """The matplotlib Figure that `plot_timeline` saves (Agg canvas attached), for notebooks and tests.

    The axes' y tick labels are the lanes shown, top to bottom; when engines are hidden, the
    title says "N of M engines shown, K hidden" and the last engine label ends in "(+K hidden)".
    """
    if not intervals:
        raise ValueError("plot_timeline: `intervals` is empty; nothing to draw")
    if max_engine_lanes < 1:
        raise ValueError(f"plot_timeline: max_engine_lanes must be >= 1, got {max_engine_lanes}")
    if window is not None:
        lo, hi = float(window[0]), float(window[1])
        if not lo < hi:
            raise ValueError(f"plot_timeline: window must be (start, end) with start < end, got {window!r}")

    engines = sorted({iv.lane for iv in intervals} - {TRAINER_LANE, WEIGHTS_LANE}, key=_natural_key)
    shown = engines[:max_engine_lanes]
    hidden = len(engines) - len(shown)
    lanes = [*shown, WEIGHTS_LANE, TRAINER_LANE]
    row_of = {lane: i for i, lane in enumerate(lanes)}

    # One pass over the intervals into flat lists; everything after is numpy.
    rows: list[int] = []
    starts: list[float] = []
    ends: list[float] = []
    kinds: list[str] = []
    values: list[float] = []
    for iv in intervals:
        row = row_of.get(iv.lane)
        if row is None:
            continue  # a hidden engine
        rows.append(row)
        starts.append(iv.start)
        ends.append(iv.end)
        kinds.append(iv.kind)
        values.append(iv.value)
    row_a = np.asarray(rows, dtype=np.float64)
    start_a = np.asarray(starts, dtype=np.float64)
    end_a = np.asarray(ends, dtype=np.float64)
    value_a = np.asarray(values, dtype=np.float64)
    kind_a = np.asarray(kinds, dtype=object)

    backwards = np.flatnonzero(end_a < start_a)
    if backwards.size:
        i = int(backwards[0])
        raise ValueError(f"plot_timeline: {backwards.size} interval(s) end before they start, e.g. lane "
                         f"{lanes[int(row_a[i])]!r} kind {kind_a[i]!r} start={start_a[i]} end={end_a[i]}")

    if window is not None:
        keep = (end_a >= lo) & (start_a <= hi)
        row_a, start_a, end_a, value_a, kind_a = (a[keep] for a in (row_a, start_a, end_a, value_a, kind_a))
        x_lo, x_hi = lo, hi
    elif start_a.size:
        x_lo, x_hi = float(start_a.min()), float(end_a.max())
        pad = 0.01 * (x_hi - x_lo) or 0.5
        x_lo, x_hi = x_lo - pad, x_hi + pad
    else:
        x_lo, x_hi = 0.0, 1.0

    fig = _new_figure(12, max(2.5, 1.5 + 0.3 * len(lanes)))
    ax = fig.add_subplot()
    _draw_bars(fig, ax, row_a, start_a, end_a, value_a, kind_a)
    _draw_versions(ax, versions, len(shown), x_lo, x_hi)

    labels = list(lanes)
    if hidden:
        labels[len(shown) - 1] = f"{labels[len(shown) - 1]} (+{hidden} hidden)"
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first engine at the top, trainer at the bottom
    ax.set_xlim(x_lo, x_hi)
    ax.set_xlabel("time (s)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(axis="y", length=0)
    if shown:
        ax.axhline(len(shown) - 0.5, color="0.6", linewidth=0.8)

    full_title = title
    if hidden:
        note = f"{len(shown)} of {len(engines)} engines shown, {hidden} hidden"
        full_title = f"{title} ({note})" if title else note
    if start_a.size == 0:
        ax.text(0.5, 0.5, "no intervals in this window", transform=ax.transAxes,
                ha="center", va="center", color="gray")
    if full_title:
        ax.set_title(full_title, pad=14 if versions else 6)
    return fig


def _draw_bars(fig: Any, ax: Any, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
               values: np.ndarray, kinds: np.ndarray) -> None:
    """One artist per colour group: each "generate" colour level, then each other kind.

    Each group is a single compound Path of rectangles (one PathPatch), which Agg fills in one
    pass; a PolyCollection of 5*10^5 polygons takes seconds to build and to rasterize. Samples in
    flight are quantized to at most `_GENERATE_LEVELS` colours (integer counts up to that are exact).
    """
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize
    from matplotlib.patches import Patch

    generate = kinds == _GENERATE
    if generate.any():
        # Blues from 25%: a bar with few samples in flight is still visible against white.
        cmap = ListedColormap(colormaps["Blues"](np.linspace(0.25, 1.0, 256)), name="samples_in_flight")
        gen_values = values[generate]
        vmax = float(gen_values.max())
        norm = Normalize(0.0, vmax if vmax > 0 else 1.0)
        levels, inverse = np.unique(gen_values, return_inverse=True)
        if levels.size > _GENERATE_LEVELS:
            step = norm.vmax / _GENERATE_LEVELS
            bins = np.clip(np.floor(gen_values / step), 0, _GENERATE_LEVELS - 1)
            levels, inverse = np.unique(bins, return_inverse=True)
            levels = (levels + 0.5) * step
        gen_idx = np.flatnonzero(generate)
        order = np.argsort(inverse, kind="stable")
        splits = np.flatnonzero(np.diff(inverse[order])) + 1
        for level, members in zip(levels, np.split(gen_idx[order], splits)):
            _add_boxes(ax, rows[members], starts[members], ends[members], facecolor=cmap(norm(level)))
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.02, pad=0.01, aspect=30)
        bar.set_label("samples in flight")

    handles = []
    others = set(kinds[~generate].tolist())
    spare = iter(_SPARE_COLOURS * (1 + len(others) // len(_SPARE_COLOURS)))
    for kind in [k for k in _FIXED_STYLES if k in others] + sorted(others - set(_FIXED_STYLES)):
        colour, hatch, label = _FIXED_STYLES.get(kind) or (next(spare), None, kind)
        members = np.flatnonzero(kinds == kind)
        _add_boxes(ax, rows[members], starts[members], ends[members], facecolor=colour, hatch=hatch)
        handles.append(Patch(facecolor=colour, hatch=hatch, edgecolor=_HATCH_COLOUR if hatch else colour,
                             label=label))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small",
                   frameon=False)


def _add_boxes(ax: Any, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, facecolor: Any,
               hatch: str | None = None) -> None:
    """Add one PathPatch holding a rectangle per (row, start, end), bar height `_BAR_HEIGHT`."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as MplPath

    n = rows.size
    y0, y1 = rows - _BAR_HEIGHT / 2, rows + _BAR_HEIGHT / 2
    verts = np.empty((n, 5, 2))
    verts[:, 0] = np.stack([starts, y0], -1)
    verts[:, 1] = np.stack([starts, y1], -1)
    verts[:, 2] = np.stack([ends, y1], -1)
    verts[:, 3] = np.stack([ends, y0], -1)
    verts[:, 4] = verts[:, 0]
    codes = np.tile(np.array([MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO,
                              MplPath.CLOSEPOLY], dtype=MplPath.code_type), n)
    patch = PathPatch(MplPath(verts.reshape(-1, 2), codes), facecolor=facecolor, linewidth=0,
                      hatch=hatch, edgecolor=_HATCH_COLOUR if hatch else "none")
    ax.add_artist(patch)  # not add_patch: its data-limit update walks every vertex in Python


def _draw_versions(ax: Any, versions: Sequence[tuple[float, int]], num_engines: int,
                   x_lo: float, x_hi: float) -> None:
    """Thin vertical lines across the engine lanes where a weight version landed; "v3" labels if few."""
    if not versions or num_engines == 0:
        return
    inside = [(float(t), v) for t, v in versions if x_lo <= t <= x_hi]
    if not inside:
        return
    # Lines typically closer than ~3 pixels (the axes are ~1300 px wide) would paint the lanes
    # black: fade them.
    times = np.sort(np.array([t for t, _ in inside]))
    pixels_apart = float(np.median(np.diff(times))) * 1300 / (x_hi - x_lo) if times.size > 1 else math.inf
    ax.vlines(times, -0.5, num_engines - 0.5, colors="black", linewidths=0.6,
              alpha=0.6 if pixels_apart >= 3 else 0.15, zorder=3)
    if len(inside) <= _MAX_VERSION_LABELS:
        for t, v in inside:
            ax.text(t, -0.5, f"v{v}", ha="center", va="bottom", fontsize="x-small", clip_on=False)


def plot_timeline(intervals: list[Interval], path: str | Path, *, title: str = "",
                  window: tuple[float, float] | None = None, max_engine_lanes: int = 16,
                  versions: list[tuple[float, int]] = ()) -> Path:
    """Write the Gantt timeline of `intervals` as a PNG at `path` (folders created); return the path.

    `window` (start_s, end_s) crops the x range and skips intervals outside it. Engines beyond the
    first `max_engine_lanes` (natural order) are hidden and counted in the title. `versions` are
    (time_s, version) marks of a new weight version on the engines. Raises ValueError for an
    empty `intervals`, a bad window, or an interval that ends before it starts.
    """
    fig = timeline_figure(intervals, title=title, window=window, max_engine_lanes=max_engine_lanes,
                          versions=versions)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Sweeps


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _check_rows(rows: Sequence[dict[str, Any]], key: str, metrics: Sequence[str], what: str) -> list[str]:
    """The metrics present (a value in at least one row), after checking rows and key."""
    if not rows:
        raise ValueError(f"{what}: `rows` is empty; nothing to show")
    missing = [i for i, row in enumerate(rows) if key not in row]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ValueError(f"{what}: {len(missing)} of {len(rows)} rows lack the key {key!r} "
                         f"(row indices {shown}); each row needs the swept setting")
    present = [m for m in metrics if any(row.get(m) is not None for row in rows)]
    if not present:
        seen = sorted({k for row in rows for k in row} - {key})
        raise ValueError(f"{what}: none of the metrics {list(metrics)} appear in the rows; "
                         f"their other keys are {seen}")
    return present


def plot_sweep(rows: list[dict[str, Any]], key: str, path: str | Path, *,
               metrics: tuple[str, ...] = DEFAULT_METRICS, title: str = "") -> Path:
    """One subplot per metric present in `rows`, against `key` in row order; write a PNG, return its path.

    x is numeric when every key value is a number, else categorical (the values as tick labels).
    A row without a metric leaves a gap in that line. Raises ValueError for empty rows, rows
    without `key`, or rows with none of `metrics`.
    """
    present = _check_rows(rows, key, metrics, "plot_sweep")
    keys = [row[key] for row in rows]
    numeric = all(_is_number(k) for k in keys)
    xs = [float(k) for k in keys] if numeric else list(range(len(keys)))

    ncols = len(present) if len(present) <= 3 else 2
    nrows = math.ceil(len(present) / ncols)
    fig = _new_figure(4.2 * ncols, 3.0 * nrows + (0.4 if title else 0))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, metric in zip(axes, present):
        ys = [float(row[metric]) if _is_number(row.get(metric)) else math.nan for row in rows]
        ax.plot(xs, ys, marker="o", linewidth=1.5)
        ax.set_ylabel(metric)
        ax.set_xlabel(key)
        ax.grid(True, alpha=0.3)
        if not numeric:
            ax.set_xticks(xs, [str(k) for k in keys], rotation=30 if len(keys) > 6 else 0)
    for ax in axes[len(present):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _format(value: Any) -> str:
    """Compact: ints as-is, floats to 3 significant digits (0.412, 12.3, 1.23e-05), 1000+ without decimals."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)) or not _is_number(value):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "-"
    if math.isinf(value) or value == 0:
        return "0" if value == 0 else str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _cells(rows: Sequence[dict[str, Any]], key: str, metrics: Sequence[str], what: str) -> list[list[str]]:
    present = _check_rows(rows, key, metrics, what)
    header = [key, *present]
    return [header] + [[_format(row[key]), *(_format(row.get(m)) for m in present)] for row in rows]


def sweep_table(rows: list[dict[str, Any]], key: str, metrics: tuple[str, ...] = DEFAULT_METRICS) -> str:
    """An aligned plain-text table: the key column (left-aligned), then each metric present (right-aligned).

    Metrics absent from every row are left out; a missing cell reads "-". No trailing newline.
    """
    table = _cells(rows, key, metrics, "sweep_table")
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(table[0]), rule, *(line(r) for r in table[1:])])


def sweep_markdown(rows: list[dict[str, Any]], key: str, metrics: tuple[str, ...] = DEFAULT_METRICS) -> str:
    """The same table as GitHub markdown (metric columns right-aligned). No trailing newline."""
    table = _cells(rows, key, metrics, "sweep_markdown")

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "| " + " | ".join(["---"] + ["--:"] * (len(table[0]) - 1)) + " |"
    return "\n".join([line(table[0]), rule, *(line(r) for r in table[1:])])
