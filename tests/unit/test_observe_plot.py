"""plot_run writes the four PNGs from a synthetic metrics.jsonl and fails clearly on bad run folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles_async.observe import MetricsLog, plot_run, read_metrics
from miles_async.observe.plot import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, num_steps: int = 30) -> None:
    with MetricsLog(run_dir, tensorboard=False) as metrics:
        for step in range(1, num_steps + 1):
            row = {"step": step, "wall_s": 2.0 * step, "reward_mean": 1 - math.exp(-step / 10),
                   "logprob_abs_diff": 0.01 / step, "staleness_mean": 0.5, "staleness_max": 1,
                   "wait_data_s": 0.2, "train_s": 1.5, "update_s": 0.3, "samples_per_s": 30.0}
            if step % 10 == 0:
                row["eval_score"] = 0.1 * step / 10
            if step == 7:
                del row["update_s"]  # a row without a key leaves a gap, not an error
            metrics.log(row)


def test_plot_run_writes_the_four_pngs(tmp_path: Path, capsys):
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "mismatch.png", "step_time.png", "staleness.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000

    assert main(str(tmp_path)) == 0
    assert capsys.readouterr().out.splitlines() == [str(p) for p in paths]


def test_plots_are_written_even_when_keys_are_absent(tmp_path: Path):
    with MetricsLog(tmp_path, tensorboard=False) as metrics:
        metrics.log({"step": 1, "loss": 0.5})
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in plot_run(tmp_path))


def test_a_resumed_step_keeps_the_later_row(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                                                        {"step": 2, "loss": 3.0}]) + "\n")
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 3.0}]


def test_bad_run_dirs_fail_clearly(tmp_path: Path, capsys):
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        plot_run(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)  # an empty run folder
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: a metrics row is a JSON object"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: .*step"):
        plot_run(tmp_path)

    assert main(str(tmp_path / "absent")) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no such run folder" in err
