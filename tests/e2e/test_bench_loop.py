"""`miles-async bench loop --quick` runs end to end and prints one JSON object (tiny sizes; no speed asserted),
with each run's thread counts recorded and every ratio taken against the better sync and TRL runs."""

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
    threads = settings["threads_per_phase"]
    assert threads["sync"] == [1, 2] and threads["trl"] == [1, 2]
    assert threads["async"] == {"engine": 1, "trainer": 1}  # the recipe's: one core each, at once
    sync = result["sync"]
    assert set(sync) == {"threads_1", "threads_2", "best", "samples_per_s", "note"}
    runs = [("sync", 0, 1, sync["threads_1"]), ("sync", 0, 2, sync["threads_2"]),
            ("async", settings["max_staleness_async"], 1, result["async"])]
    for mode, staleness, num_threads, run in runs:
        assert run["mode"] == mode and run["max_staleness"] == staleness
        assert run["engine_threads"] == num_threads and run["trainer_threads"] == num_threads, (mode, num_threads)
        assert run["samples_per_s"] > 0 and 0.0 <= run["trainer_idle_fraction"] <= 1.0, mode
        assert run["measured_steps"] == settings["steps"] - settings["warmup_steps"]
        assert run["measured_samples"] == run["measured_steps"] * settings["samples_per_step"]
        assert set(run["time_split_s"]) == {"wait_data_s", "train_s", "update_s"}
        tokens = run["output_tokens"]
        assert set(tokens) == {"num_samples", "mean", "p50", "p90", "p99", "max", "at_cap_fraction"}
        assert tokens["num_samples"] >= settings["samples_per_run"]
        assert 1 <= tokens["p50"] <= tokens["p90"] <= tokens["p99"] <= tokens["max"] <= settings["max_new_tokens"]
        assert run["whole_rl_phase"]["steps"] == settings["steps"]
        if mode == "sync":
            assert run["staleness_mean"] == 0.0
    # the ratio's base is the better sync run, recomputed from the recorded figures
    better = max(sync["threads_1"]["samples_per_s"], sync["threads_2"]["samples_per_s"])
    assert sync[sync["best"]]["samples_per_s"] == better == sync["samples_per_s"]
    ratios = result["ratios"]
    assert ratios["sync_samples_per_s"] == better and ratios["sync_best"] == sync["best"]
    assert ratios["async_over_sync"] == round(result["async"]["samples_per_s"] / better, 3) > 0
    assert result["meets_targets"]["async_over_sync"] == (
        ratios["async_over_sync"] >= ratios["targets"]["async_over_sync_min"])
    assert set(result["meets_targets"]) == {"async_over_sync", "async_over_trl", "all"}
    assert isinstance(result["meets_targets"]["async_over_sync"], bool)
    if importlib.util.find_spec("trl") is None:
        assert result["trl"] is None and ratios["async_over_trl"] is None
        assert result["meets_targets"]["async_over_trl"] is None
    else:
        peer = result["trl"]
        assert set(peer) == {"threads_1", "threads_2", "best", "samples_per_s", "note"}
        for key, num_threads in (("threads_1", 1), ("threads_2", 2)):
            assert peer[key]["samples_per_s"] > 0 and peer[key]["torch_threads"] == num_threads
            assert peer[key]["measured_steps"] == settings["steps"] - settings["warmup_steps"]
            assert peer[key]["prompts_in_order"] and peer[key]["prompt_ids_match_ours"]
        trl_better = max(peer["threads_1"]["samples_per_s"], peer["threads_2"]["samples_per_s"])
        assert ratios["trl_samples_per_s"] == peer[peer["best"]]["samples_per_s"] == trl_better
        assert ratios["async_over_trl"] == round(result["async"]["samples_per_s"] / trl_better, 3) > 0
        assert ratios["sync_over_trl"] == round(better / trl_better, 3)
        assert isinstance(result["meets_targets"]["async_over_trl"], bool)
    assert result["machine"]["free_cores_before"] > 0 and result["machine"]["free_cores_after"] > 0
    assert "[bench loop] ours, async:" in done.stderr
    assert "[bench loop] ours, sync, 2 thread(s) per phase:" in done.stderr


def test_bench_loop_takes_every_ratio_against_the_better_sync_and_trl_runs():
    """Either thread count may win: the best is picked by figure, not by position."""
    from miles_async.bench.loop import _meets_targets, _ratios, _with_best

    for slow, fast in (("threads_1", "threads_2"), ("threads_2", "threads_1")):
        sync = _with_best({slow: {"samples_per_s": 100.0}, fast: {"samples_per_s": 200.0}}, "")
        peer = _with_best({fast: {"samples_per_s": 50.0}, slow: {"samples_per_s": 80.0}}, "")
        assert (sync["best"], sync["samples_per_s"], peer["best"]) == (fast, 200.0, slow)
        ratios = _ratios({"sync": sync, "async": {"samples_per_s": 290.0}, "trl": peer})
        assert (ratios["async_over_sync"], ratios["async_over_trl"], ratios["sync_over_trl"]) == (1.45, 3.625, 2.5)
        assert (ratios["sync_samples_per_s"], ratios["sync_best"], ratios["trl_samples_per_s"]) == (200.0, fast, 80.0)
        assert _meets_targets(ratios) == {"async_over_sync": False, "async_over_trl": True, "all": False}


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
