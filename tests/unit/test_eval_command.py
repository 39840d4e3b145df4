"""`[eval] mode = "command"`'s pieces: the config's check, lm-eval's results read back as metrics, the
score line, and a command that overruns killed with its children. (tests/e2e/test_lm_eval.py runs
a real lm-eval command line in a run.)"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from miles_async.actors.eval_config import EvalConfig
from miles_async.actors.evaluation import _score_line, read_lm_eval_results, run_shell

TIMEOUT_S = 30


def dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie: killed, not yet reaped
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return True


def test_a_command_must_name_what_it_evaluates():
    with pytest.raises(ValueError, match=r"needs eval.command naming what it evaluates \(\{url\}, \{model\}"):
        EvalConfig(mode="command", command="lm_eval --model hf --tasks arc_easy")
    with pytest.raises(ValueError, match="command_timeout_s must be > 0"):
        EvalConfig(mode="command", command="score {checkpoint}", command_timeout_s=0)
    assert EvalConfig(mode="command", command="lm_eval --model_args base_url={url}/generate").metric == ""


def test_lm_eval_results_become_task_metric_pairs(tmp_path: Path):
    # lm-eval writes OUTPUT/<model name>/results_<date>.json; a second run's file adds to (and overrides) the first's.
    first, second = tmp_path / "model_a" / "results_2026-01-01T00-00-00.json", tmp_path / "results_2.json"
    first.parent.mkdir()
    first.write_text(json.dumps({"results": {
        "arc_easy": {"alias": "arc_easy", "sample_len": 10, "acc,none": 0.5, "acc_stderr,none": 0.1,
                     "acc_norm,none": 0.625, "acc_norm_stderr,none": "N/A"},
        "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.05,
                  "exact_match,flexible-extract": 1}}}))
    second.write_text(json.dumps({"results": {"arc_easy": {"acc,none": 0.75}}, "config": {"model": "x"}}))
    os.utime(first, (1, 1))  # the older file
    assert read_lm_eval_results(tmp_path) == {"arc_easy/acc": 0.75, "arc_easy/acc_norm": 0.625,
                                              "gsm8k/exact_match,strict-match": 0.25,
                                              "gsm8k/exact_match,flexible-extract": 1.0}
    assert read_lm_eval_results(tmp_path / "model_a" / "none") == {}


def test_the_score_line():
    assert _score_line('{"score": 0.25}') == 0.25
    for line in ("|  Tasks  |Version|", '{"acc": 1}', "[1, 2]", '{"score": null}'):
        assert _score_line(line) is None


def test_a_command_past_its_time_is_killed_with_its_children(tmp_path: Path):
    pid_file = tmp_path / "pid"
    command = f"sleep 60 & echo $! > {pid_file}; wait"
    with pytest.raises(RuntimeError, match="ran past 0.5s"):
        asyncio.run(asyncio.wait_for(run_shell(command, None, 0.5), TIMEOUT_S))
    child = int(pid_file.read_text())
    deadline = time.monotonic() + TIMEOUT_S  # the orphaned child is reaped by init once killed
    while not dead(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dead(child)
    out, err, code = asyncio.run(asyncio.wait_for(run_shell("echo hi; echo oops >&2; exit 3", None, TIMEOUT_S),
                                                  TIMEOUT_S))
    assert (out, err, code) == ("hi\n", "oops\n", 3)
