"""`miles-async sim`: what-if settings, sweeps, JSON, pictures, synthetic scenarios and bad input.

In-process through `launch.cli.main` (the parsing and the work are what is under test; the
process boundary is covered by test_cli.py and the slow fidelity test)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from miles_async.launch import cli

TRACE = Path(__file__).resolve().parent.parent / "data" / "sim" / "reverse-async.trace.jsonl.gz"


def sim_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["sim", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_own_settings_report_predicted_measured_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    report = sim_json(capsys, str(TRACE), "--set", "num_steps=30")
    assert report["predicted"]["num_steps"] == 30
    assert "errors" not in report  # num_steps changed: no longer the run's own settings
    report = sim_json(capsys, str(TRACE))
    assert set(report) >= {"config", "costs", "predicted", "measured", "errors", "trace", "sim"}
    assert report["config"]["mode"] == "async" and report["config"]["max_staleness"] == 2
    assert abs(report["errors"]["step_s_mean"]) < 0.1


def test_human_report_and_pictures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["sim", str(TRACE), "--set", "num_steps=40", "--timeline", str(tmp_path / "t.png"),
                     "--window-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out and "staleness (fraction of groups)" in out
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "t-recorded.png").stat().st_size > 10_000


def test_sweep_table_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = sim_json(capsys, str(TRACE), "--set", "num_steps=30", "--sweep", "num_engines=1,2",
                      "--sweep-plot", str(tmp_path / "s.png"))
    rows = report["sweep"]
    assert [r["num_engines"] for r in rows] == [1, 2]
    assert rows[1]["step_s_mean"] < rows[0]["step_s_mean"]  # this run is engine-bound
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert cli.main(["sim", str(TRACE), "--set", "num_steps=20", "--sweep", "mode=sync,async",
                     "--sweep", "refill=sample,group"]) == 0
    table = capsys.readouterr().out
    assert "mode=sync,refill=group" in table and "step_s_mean" in table


def test_synthetic_scenario_written_and_replayed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl.gz"
    report = sim_json(capsys, "--synthetic", "math-8gpu", "--set", "num_steps=8", "--set", "workload.turns_max=2",
                      "--write", str(path))
    assert report["wrote_trace"] == str(path) and "measured" not in report
    with gzip.open(path, "rt") as f:
        assert json.loads(f.readline())["source"] == "synthetic"
    replayed = sim_json(capsys, str(path))
    assert abs(replayed["errors"]["step_s_mean"]) < 0.1  # the fit recovers what generated it


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "num_enginez=2"], "unknown setting 'num_enginez'"),
    (["--set", "num_engines=0"], "num_engines must be >= 1"),
    (["--set", "mode=fast"], "mode"),
    (["--set", "gen.token_z=1"], "no cost field 'gen.token_z'"),
    (["--set", "workload.turns_max=3"], "synthetic scenario only"),
    (["--set", "num_engines"], "write KEY=VALUE"),
    (["--sweep", "num_engines"], "write KEY=V1,V2"),
])
def test_bad_settings_are_named(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert cli.main(["sim", str(TRACE), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("miles-async sim: ") and message in err


def test_bad_trace_names_line_and_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with gzip.open(TRACE, "rt") as f:
        lines = f.read().splitlines()[:400]
    record = json.loads(lines[300])
    bad = [*lines[:300], json.dumps({k: v for k, v in record.items() if k != "end_s"}), *lines[301:]]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad) + "\n")
    assert cli.main(["sim", str(path)]) == 2
    err = capsys.readouterr().err
    assert ":301: field `end_s`: missing" in err
    assert cli.main(["sim", "--synthetic", "nope"]) == 2
    assert "no synthetic scenario 'nope'" in capsys.readouterr().err
