"""plot_run writes its PNGs from a synthetic metrics.jsonl (reward, loss, KL, entropy, grad norm, response
length, mismatch, step time, staleness), reads runs written with the old flat names, and fails clearly on
bad run folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles_async.observe import RENAMED, MetricsLog, plot_run, read_metrics
from miles_async.observe.plot import figures, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


PLOTS = ["reward.png", "loss.png", "kl.png", "entropy.png", "grad_norm.png", "response_len.png", "mismatch.png",
         "step_time.png", "staleness.png"]


def _row(step: int) -> dict:
    row = {"step": step, "perf/wall_s": 2.0 * step, "rollout/reward_mean": 1 - math.exp(-step / 10),
           "train/logprob_abs_diff": 0.01 / step, "train/staleness_mean": 0.5, "train/staleness_max": 1,
           "perf/wait_data_s": 0.2, "perf/train_s": 1.5, "perf/update_s": 0.3, "perf/samples_per_s": 30.0,
           "train/loss": 0.5 / step - 0.1, "train/pg_loss": 0.4 / step - 0.1, "train/kl": 0.0,
           "train/rollout_kl_k3": 0.001 * (1 + step % 3), "train/entropy": 2.0 - step / 30,
           "train/grad_norm": 1.0 + (step % 4) / 4, "rollout/response_len_mean": 20.0 + step}
    if step % 10 == 0:
        row["eval/score"] = 0.1 * step / 10
    if step == 7:
        del row["perf/update_s"]  # a row without a key leaves a gap, not an error
    return row


def _write_run(run_dir: Path, num_steps: int = 30) -> None:
    with MetricsLog(run_dir) as metrics:
        for step in range(1, num_steps + 1):
            metrics.log(_row(step))


def _labels(fig) -> list[str]:
    [ax] = fig.axes
    return [line.get_label() for line in ax.get_lines()] + [c.get_label() for c in ax.collections]


def test_plot_writes_every_png(tmp_path: Path, capsys):
    _write_run(tmp_path)
    assert main(str(tmp_path)) == 0  # `miles-async plot RUN_DIR`: plot_run, and the paths printed
    paths = [Path(line) for line in capsys.readouterr().out.splitlines()]
    assert [p.name for p in paths] == PLOTS
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plots_are_written_even_when_keys_are_absent(tmp_path: Path):
    with MetricsLog(tmp_path) as metrics:
        metrics.log({"step": 1, "train/loss": 0.5})
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in plot_run(tmp_path))


def test_each_panel_draws_its_series(tmp_path: Path):
    _write_run(tmp_path)
    drawn = {name: _labels(fig) for name, fig in figures(read_metrics(tmp_path / "metrics.jsonl"))}
    assert {"train/loss", "train/pg_loss", "train/loss, moving mean (3 steps)"} <= set(drawn["loss.png"])
    assert drawn["kl.png"] == ["train/kl", "train/rollout_kl_k3"]  # no teacher in this run: no teacher_kl line
    assert "train/entropy" in drawn["entropy.png"] and "train/grad_norm" in drawn["grad_norm.png"]
    assert "rollout/response_len_mean" in drawn["response_len.png"]
    assert {"rollout/reward_mean", "eval/score"} <= set(drawn["reward.png"])
    assert drawn["step_time.png"] == ["perf/wait_data_s", "perf/train_s", "perf/update_s"]


def test_a_run_written_with_the_old_flat_names_still_plots(tmp_path: Path):
    """Run folders from before the names were grouped: `reward_mean`, `loss`, `eval_score`, ..."""
    old = {new: old for old, new in RENAMED.items()}
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({old.get(k, k): v for k, v in _row(step).items()}) + "\n" for step in range(1, 21)))
    assert "reward_mean" in (tmp_path / "metrics.jsonl").read_text()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[9]["rollout/reward_mean"] == _row(10)["rollout/reward_mean"] and rows[9]["eval/score"] == 1 / 10
    drawn = {name: _labels(fig) for name, fig in figures(rows)}
    assert "train/loss" in drawn["loss.png"] and "rollout/reward_mean" in drawn["reward.png"]


def test_a_resumed_step_keeps_the_later_row(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 2.0},
                                                        {"step": 2, "train/loss": 3.0}]) + "\n")
    assert read_metrics(path) == [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 3.0}]


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
