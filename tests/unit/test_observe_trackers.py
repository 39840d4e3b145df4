"""The trackers, with the real packages: wandb offline (WANDB_MODE=offline, its files read back from the
run folder: the .wandb transaction log through wandb's own protobuf records, and the samples' table
file), and TensorBoard (the event file read back with tensorboard's EventAccumulator)."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from miles_async.observe import MetricsLog, ObserveConfig, SampleText, TrackerError, open_trackers, trackers

SAMPLES = [SampleText(step=2, prompt_id=5, index=i, prompt="<|user|>reverse: abc", completion=f"cba{i}",
                      reward=float(i), versions=[1, 2], finish_reason="stop", num_prompt_tokens=6,
                      num_generated_tokens=3) for i in range(2)]
RECIPE = {"loop": {"num_steps": 2}, "rollout": {"server": {"api_key": "sk-not-for-wandb", "url": ""}}}


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """wandb with no network and nothing written outside tmp_path. wandb keeps the settings of its
    first run in the process (its singleton): torn down around each test, so each reads its own."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()
    yield
    wandb.teardown()


def wandb_records(run_file: Path) -> list:
    """The records of a .wandb file: wandb's protobuf `Record`s in LevelDB-log framing (32 KiB
    blocks, each chunk headed by crc32, length, type), after the 7-byte ":W&B" header."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind in (3, 4):  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def read_offline_run(run_dir: Path) -> tuple[list, list[dict]]:
    """(run records, history rows as {key: value}) of the newest offline run under RUN_DIR/wandb.
    wandb's service process writes the file out when it stops, as at the end of a run's process:
    `wandb.teardown()` stops it first (after `finish` the file may still be only its header)."""
    import wandb

    wandb.teardown()
    [run_file] = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))[-1:]
    records = wandb_records(run_file)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    return runs, history


def test_wandb_offline_gets_the_rows_the_recipe_and_the_samples_table(tmp_path: Path, offline_wandb: None):
    config = ObserveConfig(wandb=True, wandb_project="gsm8k", wandb_name="first", wandb_tags=["cpu", "test"])
    with MetricsLog(tmp_path, trackers=open_trackers(config, tmp_path, recipe=RECIPE)) as metrics:
        metrics.log({"step": 1, "rollout/reward_mean": 0.25, "train/loss": 1.5})
        metrics.log({"step": 2, "rollout/reward_mean": 0.5, "train/loss": 1.25, "eval/score": 0.75})
        metrics.log_samples(2, SAMPLES)
    run_id = (tmp_path / trackers.WANDB_ID_FILE).read_text().strip()
    [run], history = read_offline_run(tmp_path)
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (run_id, "gsm8k", "first", ["cpu", "test"])
    recipe = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert recipe["loop"] == {"num_steps": 2}
    assert recipe["rollout"]["server"]["api_key"] == "(redacted)"  # a tracker's config leaves the machine
    rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    assert rows[:2] == [{"step": 1, "rollout/reward_mean": 0.25, "train/loss": 1.5},
                        {"step": 2, "rollout/reward_mean": 0.5, "train/loss": 1.25, "eval/score": 0.75}]
    table_row = rows[2]
    assert table_row["step"] == 2 and table_row["rollout/samples/_type"] == "table-file"
    [table_file] = (tmp_path / "wandb").glob("offline-run-*/files/media/table/rollout/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == [f.name for f in msgspec.structs.fields(SampleText)]
    assert [row[table["columns"].index("completion")] for row in table["data"]] == ["cba0", "cba1"]
    assert table["data"][0][table["columns"].index("versions")] == "1, 2"


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, offline_wandb: None):
    config = ObserveConfig(wandb=True)
    with MetricsLog(tmp_path, trackers=open_trackers(config, tmp_path, recipe={})) as metrics:
        metrics.log({"step": 1, "train/loss": 1.0})
    first = (tmp_path / trackers.WANDB_ID_FILE).read_text()
    with MetricsLog(tmp_path, trackers=open_trackers(config, tmp_path, recipe={}, resume_step=1)) as metrics:
        metrics.log({"step": 2, "train/loss": 0.5})
    assert (tmp_path / trackers.WANDB_ID_FILE).read_text() == first
    [run], history = read_offline_run(tmp_path)  # the resumed process's file
    assert run.run_id == first.strip() and run.display_name == tmp_path.name
    assert [h["step"] for h in history] == [2]


def test_wandb_without_a_key_online_fails_in_one_line_naming_the_ways_out(tmp_path: Path, offline_wandb: None,
                                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc key either
    with pytest.raises(TrackerError, match="WANDB_MODE=offline") as caught:
        open_trackers(ObserveConfig(wandb=True, tensorboard=False), tmp_path / "run", recipe={})
    assert "\n" not in str(caught.value) and "API key" in str(caught.value)


def test_tensorboard_gets_the_scalars_and_the_samples_and_a_resume_hides_the_steps_run_again(tmp_path: Path):
    pytest.importorskip("tensorboard")
    # The accumulator TensorBoard's own data loading uses (scalars and text are both tensors there).
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    config = ObserveConfig(tensorboard=True)
    with MetricsLog(tmp_path, trackers=open_trackers(config, tmp_path, recipe={})) as metrics:
        for step in (1, 2, 3):
            metrics.log({"step": step, "train/loss": 1.0 / step, "rollout/reward_mean": 0.25 * step})
            metrics.log_samples(step, SAMPLES[:1])
    # resumed from a checkpoint after step 1: steps 2 and 3 run again, with other values
    with MetricsLog(tmp_path, trackers=open_trackers(config, tmp_path, recipe={}, resume_step=1)) as metrics:
        for step in (2, 3):
            metrics.log({"step": step, "train/loss": 10.0 * step, "rollout/reward_mean": 0.5})
            metrics.log_samples(step, SAMPLES[1:])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"train/loss", "rollout/reward_mean", "rollout/samples/text_summary"} <= set(events.Tags()["tensors"])
    assert [(e.step, float(make_ndarray(e.tensor_proto))) for e in events.Tensors("train/loss")] == [
        (1, 1.0), (2, 20.0), (3, 30.0)]
    texts = [(e.step, make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors("rollout/samples/text_summary")]
    assert [step for step, _ in texts] == [1, 2, 3]
    assert "cba0" in texts[0][1] and all("cba1" in text for _, text in texts[1:])
    assert "reverse: abc" in texts[0][1] and "reward 0" in texts[0][1]


def test_tensorboard_missing_is_said_once_at_info(tmp_path: Path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    monkeypatch.setattr(trackers, "_tensorboard_missing_said", False)
    with caplog.at_level(logging.INFO, logger="miles_async.observe"):
        for _ in range(2):
            assert open_trackers(ObserveConfig(tensorboard=True), tmp_path, recipe={}) == []
    said = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "pip install 'miles-async[tensorboard]'" in said[0].getMessage()
    assert not (tmp_path / "tensorboard").exists()


def test_observe_config_refuses_bad_values_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match="log_samples must be >= 0"):
        ObserveConfig(log_samples=-1)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'miles-async\[wandb\]'"):
        ObserveConfig(wandb=True)
    ObserveConfig(wandb=False)  # not asked for: not needed
