"""run_state.json (miles_async/actors/run_state.py): a resume reads the checkpoints of older runs, with the keys
the file always had, and cuts the logs back only to lengths the checkpoint recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_async.actors.run_state import RUN_STATE_FILE, RunState, roll_back_logs


def checkpoint_folder(run_dir: Path, step: int, state: dict) -> Path:
    """A finished checkpoint as the trainer leaves it (meta.json last), holding `state`."""
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / RUN_STATE_FILE).write_text(json.dumps(state))
    (folder / "meta.json").write_text(json.dumps({"step": step, "weight_version": step, "data_cursor": 0}))
    return folder


def logs(run_dir: Path, lines: int) -> None:
    for name in ("metrics.jsonl", "trace.jsonl", "samples.jsonl"):
        (run_dir / name).write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, lines + 1)))


def test_a_run_state_keeps_its_keys_and_reads_back(tmp_path: Path) -> None:
    state = RunState(rl_step=3, next_new_prompt=12, unfinished=[9, 11], metrics_bytes=10, trace_bytes=20,
                     samples_bytes=0)
    written = json.loads(state.encode())
    assert list(written) == ["rl_step", "next_new_prompt", "unfinished", "metrics_bytes", "trace_bytes",
                             "samples_bytes"]  # the keys runs always wrote: no next_prompt
    folder = checkpoint_folder(tmp_path, 5, written)
    assert RunState.read(folder) == state and state.first_prompt == 12


def test_an_old_checkpoint_resumes_and_leaves_its_logs(tmp_path: Path) -> None:
    """Before next_new_prompt and the log lengths: next_prompt, and logs left as they are."""
    logs(tmp_path, 4)
    before = (tmp_path / "metrics.jsonl").read_text()
    folder = checkpoint_folder(tmp_path, 7, {"rl_step": 2, "next_prompt": 6})
    latest, state = roll_back_logs(tmp_path) or (None, None)
    assert latest == folder and state is not None
    assert (state.rl_step, state.first_prompt, state.unfinished) == (2, 6, [])
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert not (tmp_path / "metrics.rolled_back.jsonl").exists()


def test_a_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path: Path) -> None:
    logs(tmp_path, 2)
    sizes = {name: (tmp_path / name).stat().st_size for name in ("metrics.jsonl", "trace.jsonl", "samples.jsonl")}
    checkpoint_folder(tmp_path, 2, {"rl_step": 2, "next_new_prompt": 8, "unfinished": [7],
                                    "metrics_bytes": sizes["metrics.jsonl"], "trace_bytes": sizes["trace.jsonl"],
                                    "samples_bytes": sizes["samples.jsonl"]})
    logs(tmp_path, 5)  # steps 3..5 ran after the checkpoint: they run again
    _, state = roll_back_logs(tmp_path) or (None, None)
    assert state is not None and (state.first_prompt, state.unfinished) == (8, [7])
    for name in sizes:
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2]
    assert (tmp_path / "metrics.rolled_back.jsonl").read_text().count("\n") == 3


def test_no_checkpoint_starts_over_and_a_bad_one_is_named(tmp_path: Path) -> None:
    logs(tmp_path, 3)
    assert roll_back_logs(tmp_path) is None
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # the run starts over: every step runs again
    checkpoint_folder(tmp_path, 1, {"metrics_bytes": 0})  # e.g. `miles-async sft`'s, no RL step
    with pytest.raises(ValueError, match="is not a run state"):
        roll_back_logs(tmp_path)
