"""sim.plot: the Gantt timeline (lanes, hiding, window, speed at 2*10^5 intervals) and sweep plot/tables."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from miles_async.sim.plot import (
    Interval,
    plot_sweep,
    plot_timeline,
    sweep_markdown,
    sweep_table,
    timeline_figure,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _small() -> list[Interval]:
    out = []
    for e in (10, 2, 0):  # out of order on purpose: lanes sort naturally
        out += [Interval(lane=f"engine-{e}", start=0.0, end=3.0, kind="generate", value=4 + e),
                Interval(lane=f"engine-{e}", start=3.0, end=3.5, kind="paused"),
                Interval(lane=f"engine-{e}", start=3.5, end=6.0, kind="generate", value=1)]
    out += [Interval(lane="trainer", start=0.0, end=2.0, kind="wait_data"),
            Interval(lane="trainer", start=2.0, end=4.0, kind="train"),
            Interval(lane="trainer", start=4.0, end=4.5, kind="export"),
            Interval(lane="trainer", start=4.5, end=5.0, kind="eval"),
            Interval(lane="weights", start=4.5, end=5.5, kind="push")]
    return out


def _rectangles(fig) -> int:
    """Bars drawn: every bar is a 5-vertex rectangle inside one PathPatch per colour group."""
    return sum(len(p.get_path().vertices) // 5 for p in fig.axes[0].patches)


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_timeline_small_set_is_written_with_lanes_in_natural_order(tmp_path: Path):
    path = plot_timeline(_small(), tmp_path / "deep" / "timeline.png", title="toy", versions=[(3.5, 1), (5.5, 2)])
    assert path == tmp_path / "deep" / "timeline.png"
    _png_ok(path)

    fig = timeline_figure(_small(), title="toy", versions=[(3.5, 1), (5.5, 2)])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["engine-0", "engine-2", "engine-10", "weights", "trainer"]
    assert ax.get_title() == "toy"
    assert _rectangles(fig) == len(_small())
    assert {"v1", "v2"} <= {t.get_text() for t in ax.texts}
    assert fig.axes[1].get_ylabel() == "samples in flight"  # the colorbar
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["train", "export", "wait_data", "eval", "weights push", "engine paused"]


def test_timeline_hides_engines_beyond_the_limit():
    intervals = [Interval(lane=f"engine-{e}", start=0.0, end=1.0, kind="generate", value=1) for e in range(40)]
    intervals.append(Interval(lane="trainer", start=1.0, end=2.0, kind="train"))
    fig = timeline_figure(intervals, title="big", max_engine_lanes=16)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 18 and labels[0] == "engine-0" and labels[-2:] == ["weights", "trainer"]
    assert labels[15] == "engine-15 (+24 hidden)"
    assert ax.get_title() == "big (16 of 40 engines shown, 24 hidden)"
    assert _rectangles(fig) == 17  # the hidden engines' bars are not drawn

    fig = timeline_figure(intervals, max_engine_lanes=40)
    assert "hidden" not in fig.axes[0].get_title()
    assert len(fig.axes[0].get_yticklabels()) == 42


def test_timeline_window_crops_and_skips_outside_intervals(tmp_path: Path):
    intervals = [Interval(lane="engine-0", start=float(t), end=t + 1.0, kind="generate", value=t % 5)
                 for t in range(100)]
    intervals += [Interval(lane="trainer", start=float(t), end=t + 0.5, kind="train") for t in range(100)]
    fig = timeline_figure(intervals, window=(10.0, 20.0), versions=[(5.0, 1), (15.0, 2)])
    ax = fig.axes[0]
    assert ax.get_xlim() == (10.0, 20.0)
    # engine bars [t, t+1] touching [10, 20]: t = 9..20; trainer bars [t, t+0.5]: t = 10..20
    assert _rectangles(fig) == 12 + 11
    assert {t.get_text() for t in ax.texts} == {"v2"}  # the mark at 5 s is outside the window

    fig = timeline_figure(intervals, window=(500.0, 600.0))
    assert _rectangles(fig) == 0
    assert any("no intervals" in t.get_text() for t in fig.axes[0].texts)
    _png_ok(plot_timeline(intervals, tmp_path / "w.png", window=(10.0, 20.0)))


def test_timeline_of_200k_intervals_renders_quickly(tmp_path: Path):
    rng = np.random.default_rng(0)
    intervals = []
    for e in range(20):
        ends = np.cumsum(rng.uniform(0.05, 1.0, 10_000))
        starts = np.concatenate([[0.0], ends[:-1]])
        values = rng.integers(0, 64, ends.size)
        for i in range(ends.size):
            kind = "paused" if i % 17 == 0 else "generate"
            intervals.append(Interval(lane=f"engine-{e}", start=float(starts[i]), end=float(ends[i]),
                                      kind=kind, value=float(values[i])))
    trainer_kinds = ("wait_data", "train", "export")
    for i in range(3000):
        intervals.append(Interval(lane="trainer", start=1.7 * i, end=1.7 * i + 1.6, kind=trainer_kinds[i % 3]))
    versions = [(5.1 * i, i) for i in range(1000)]
    assert len(intervals) > 200_000

    t0 = time.perf_counter()
    path = plot_timeline(intervals, tmp_path / "big.png", title="200k", versions=versions)
    elapsed = time.perf_counter() - t0
    _png_ok(path)
    assert elapsed < 10.0, f"200k intervals took {elapsed:.1f} s"


def test_timeline_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="`intervals` is empty"):
        plot_timeline([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="end before they start"):
        timeline_figure([Interval(lane="trainer", start=2.0, end=1.0, kind="train")])
    with pytest.raises(ValueError, match="window"):
        timeline_figure(_small(), window=(5.0, 5.0))
    assert not (tmp_path / "x.png").exists()


ROWS = [
    {"engines": 2, "step_s_mean": 12.3456, "samples_per_s": 41.2, "trainer_idle_fraction": 0.41234,
     "engine_utilization": 0.9},
    {"engines": 4, "step_s_mean": 6.5, "samples_per_s": 12345.6, "trainer_idle_fraction": 0.1,
     "engine_utilization": 0.000012345},
    {"engines": 8, "step_s_mean": 3, "samples_per_s": 160.0, "trainer_idle_fraction": None},
]


def test_sweep_plot_numeric_and_categorical(tmp_path: Path):
    _png_ok(plot_sweep(ROWS, "engines", tmp_path / "sweep" / "engines.png", title="engines"))
    rows = [{"policy": name, "samples_per_s": s} for name, s in [("fifo", 10.0), ("lifo", 12.5), ("fair", 11.0)]]
    _png_ok(plot_sweep(rows, "policy", tmp_path / "policy.png"))


def test_sweep_table_formats_numbers_compactly():
    table = sweep_table(ROWS, "engines")
    lines = table.splitlines()
    assert lines[0].split() == ["engines", "step_s_mean", "samples_per_s", "trainer_idle_fraction",
                                "engine_utilization"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["2", "12.3", "41.2", "0.412", "0.9"]
    assert lines[3].split() == ["4", "6.5", "12346", "0.1", "1.23e-05"]
    assert lines[4].split() == ["8", "3", "160", "-", "-"]
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule equally wide
    assert lines[2].index("0.412") + len("0.412") == lines[3].index("0.1") + len("0.1")  # right-aligned

    # metrics no row has are left out; categorical keys are shown as they are
    rows = [{"policy": "fifo", "samples_per_s": 10.0}, {"policy": "lifo", "samples_per_s": 12.5}]
    assert sweep_table(rows, "policy").splitlines()[0].split() == ["policy", "samples_per_s"]
    assert sweep_table(rows, "policy").splitlines()[3].split() == ["lifo", "12.5"]


def test_sweep_markdown():
    md = sweep_markdown(ROWS, "engines", ("samples_per_s", "trainer_idle_fraction"))
    assert md.splitlines() == [
        "| engines | samples_per_s | trainer_idle_fraction |",
        "| --- | --: | --: |",
        "| 2 | 41.2 | 0.412 |",
        "| 4 | 12346 | 0.1 |",
        "| 8 | 160 | - |",
    ]


def test_sweep_errors(tmp_path: Path):
    for fn in (sweep_table, sweep_markdown, lambda rows, key: plot_sweep(rows, key, tmp_path / "s.png")):
        with pytest.raises(ValueError, match="`rows` is empty"):
            fn([], "engines")
        with pytest.raises(ValueError, match=r"1 of 3 rows lack the key 'engines' \(row indices 1\)"):
            fn([ROWS[0], {"samples_per_s": 1.0}, ROWS[2]], "engines")
        with pytest.raises(ValueError, match="none of the metrics"):
            fn([{"engines": 1, "other": 2.0}], "engines")
    assert not (tmp_path / "s.png").exists()
