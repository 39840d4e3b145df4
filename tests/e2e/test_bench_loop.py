"""`miles-async bench loop --quick` runs end to end and prints one JSON object (tiny sizes; no speed asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_loop_quick_prints_sync_async_and_trl_side_by_side():
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "loop", "--json", "--quick"],
                          capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["bench"] == "loop" and result["settings"]["quick"] is True
    settings = result["settings"]
    assert settings["samples_per_run"] == settings["steps"] * settings["batch_groups"] * settings["group_size"]
    assert result["warm_start"]["sft_steps"] > 0
    for mode, staleness in (("sync", 0), ("async", settings["max_staleness_async"])):
        run = result[mode]
        assert run["mode"] == mode and run["max_staleness"] == staleness
        assert run["samples_per_s"] > 0 and 0.0 <= run["trainer_idle_fraction"] <= 1.0, mode
        assert run["measured_steps"] == settings["steps"] - settings["warmup_steps"]
        assert run["measured_samples"] == run["measured_steps"] * settings["samples_per_step"]
        assert set(run["time_split_s"]) == {"wait_data_s", "train_s", "update_s"}
        tokens = run["output_tokens"]
        assert set(tokens) == {"num_samples", "mean", "p50", "p90", "p99", "max", "at_cap_fraction"}
        assert tokens["num_samples"] >= settings["samples_per_run"]
        assert 1 <= tokens["p50"] <= tokens["p90"] <= tokens["p99"] <= tokens["max"] <= settings["max_new_tokens"]
        assert run["whole_rl_phase"]["steps"] == settings["steps"]
    assert result["sync"]["staleness_mean"] == 0.0
    ratios = result["ratios"]
    assert ratios["async_over_sync"] > 0
    assert set(result["meets_targets"]) == {"async_over_sync", "async_over_trl", "all"}
    assert isinstance(result["meets_targets"]["async_over_sync"], bool)
    if importlib.util.find_spec("trl") is None:
        assert result["trl"] is None and ratios["async_over_trl"] is None
        assert result["meets_targets"]["async_over_trl"] is None
    else:
        peer = result["trl"]
        assert set(peer) == {"threads_1", "threads_2", "best", "note"}
        for key, threads in (("threads_1", 1), ("threads_2", 2)):
            assert peer[key]["samples_per_s"] > 0 and peer[key]["torch_threads"] == threads
            assert peer[key]["measured_steps"] == settings["steps"] - settings["warmup_steps"]
            assert peer[key]["prompts_in_order"] and peer[key]["prompt_ids_match_ours"]
        assert ratios["trl_samples_per_s"] == peer[peer["best"]]["samples_per_s"]
        assert ratios["async_over_trl"] > 0 and isinstance(result["meets_targets"]["async_over_trl"], bool)
    assert result["machine"]["free_cores_before"] > 0 and result["machine"]["free_cores_after"] > 0
    assert "[bench loop] ours, async:" in done.stderr


@pytest.mark.timeout(60)
def test_bench_loop_rejects_steps_not_past_the_warm_up():
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "loop", "--steps", "2",
                           "--warmup-steps", "2"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "must exceed --warmup-steps" in done.stderr
    assert done.stdout == ""


def test_bench_loop_on_smollm2_takes_the_recipes_workload_without_the_long_tail():
    from miles_async.bench.loop import LONG_TAIL, SMOLLM2_RECIPE, _settings, main

    args = argparse.Namespace(model="smollm2", recipe=SMOLLM2_RECIPE, quick=False, steps=0, batch_groups=0,
                              group_size=0, max_new_tokens=0, warmup_steps=None, set=["trainer.lr=1e-6"], keep="")
    settings = _settings(args)
    assert (settings["steps"], settings["batch_groups"], settings["group_size"], settings["max_new_tokens"]) == \
        (12, 4, 8, 32)
    assert settings["overrides"] == ["trainer.lr=1e-6"] and not set(LONG_TAIL) & set(settings["overrides"])
    assert settings["sft_max_steps"] is None and settings["model"] == "smollm2"
    tiny = _settings(argparse.Namespace(**{**vars(args), "model": "tiny"}))
    assert tiny["overrides"][:len(LONG_TAIL)] == LONG_TAIL and tiny["steps"] == 30
    with pytest.raises(SystemExit):
        main(["--model", "gpt2"])
