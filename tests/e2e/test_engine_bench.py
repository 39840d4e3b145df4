"""`miles-async bench engine` runs end to end and prints one JSON object (tiny sizes; no speed asserted);
with vLLM's CPU server as the second peer where `.venv-vllm` exists (slow: compiled, as it runs by
default, it starts in ~60 s), every vLLM run's settings recorded as they were set. The default set
of settings vLLM's figure is the best of: tests/unit/test_bench_engine_peers.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles_async.bench.engine_peers import vllm_available
from miles_async.models import smollm2


def bench(*extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "engine", "--json", "--num-requests", "12",
         "--max-output", "24", "--num-sessions", "3", "--num-turns", "3", *extra],
        capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow  # ~7 s: the benchmark and its peer
def test_bench_engine_prints_one_json_object_with_the_ratio_and_hit_rate():
    pytest.importorskip("transformers", reason="the peer, HF generate, needs transformers (the dev extra)")
    done = bench("--no-vllm")
    result = json.loads(done.stdout)
    assert result["vllm_server"] is None and result["vllm_skipped"] == "--no-vllm"
    assert result["ratios"]["http_throughput_vs_vllm"] is None
    for side in ("embedded_engine", "embedded_engine_http", "hf_generate_static_batches"):
        assert result[side]["tokens_per_s"] > 0
        assert result[side]["useful_tokens"] == result["workload"]["useful_tokens"]
    assert result["ratios"]["throughput_vs_hf"] > 0
    hf = result["hf_generate_static_batches"]
    assert hf["reference_point"]["tokens_per_s"] > 0
    assert hf["process"].startswith("its own") and hf["torch_threads"] == result["versions"]["torch_threads"]
    assert 0 < result["multiturn"]["prefix_cache_hit_rate"] <= 1
    assert result["multiturn"]["hit_rate_by_turn"][0] == 0.0
    assert "[bench engine] embedded engine, in process" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))
def test_bench_engine_measures_vllm_compiled_with_our_batch_limit_on_the_same_workload():
    pytest.importorskip("transformers", reason="the peer, HF generate, needs transformers (the dev extra)")
    result = json.loads(bench("--vllm-placements", "own").stdout)  # one compiled start, not both placements
    vllm = result["vllm_server"]
    assert vllm["useful_tokens"] == result["workload"]["useful_tokens"] and vllm["tokens_per_s"] > 0
    assert vllm["best_of"] == len(vllm["runs"]) == 1 and vllm["runs"][0]["tokens_per_s"] == vllm["tokens_per_s"]
    settings = vllm["settings"]
    assert settings["api"] == "server" and settings["torch_compile"] and settings["reserved_cpus"] is None
    assert settings["max_num_seqs"] == result["engine_config"]["max_running_requests"]
    assert settings["kv_cache_bytes"] == result["engine_config"]["kv_cache_mib"] * 2**20
    assert "--enforce-eager" not in vllm["flags"] and f"--max-num-seqs {settings['max_num_seqs']}" in vllm["flags"]
    assert vllm["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in vllm["env"]
    assert (vllm["env"].get("LD_PRELOAD", "").split(":")[0] == vllm["tcmalloc"]) == bool(settings["preload"])
    assert vllm["version"].startswith("vllm-cpu 0.")
    assert result["vllm_skipped"] is None and result["ratios"]["http_throughput_vs_vllm"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))
def test_bench_engine_vs_vllm_per_model_and_thread_count_with_step_times_beside_the_limits():
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "engine", "--vs-vllm", "--json", "--models", "smollm2",
         "--threads", "1", "--smollm2-requests", "4", "--max-output", "16", "--step-batches", "1,2",
         "--vllm-eager", "--vllm-placements", "none"],  # two eager starts (server, offline), for time
        capture_output=True, text=True, timeout=580, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    run = result["workloads"]["smollm2"]["threads"]["1"]
    sides = ("embedded_engine", "embedded_engine_http", "vllm_server", "vllm_offline")
    assert [run[side]["useful_tokens"] for side in sides] == [64] * 4
    for side, api in (("vllm_server", "server"), ("vllm_offline", "offline")):
        settings = run[side]["settings"]
        assert (settings["api"], settings["threads"], settings["reserved_cpus"]) == (api, 1, 0)
        assert not settings["torch_compile"] and run[side]["env"]["OMP_NUM_THREADS"] == "1"
    assert "enforce_eager=True" in run["vllm_offline"]["flags"] and "--enforce-eager" in run["vllm_server"]["flags"]
    assert run["ratio"] == round(run["embedded_engine_http"]["tokens_per_s"] / run["vllm_server"]["tokens_per_s"], 2)
    assert run["ratio_in_process"] == round(run["embedded_engine"]["tokens_per_s"]
                                            / run["vllm_offline"]["tokens_per_s"], 2)
    assert result["ratios"]["vs_vllm_cpu"] == {"smollm2": {"1": run["ratio"]}} and run["ratio"] > 0
    assert result["ratios"]["vs_vllm_cpu_in_process"] == {"smollm2": {"1": run["ratio_in_process"]}}
    steps = result["decode_steps"]["smollm2"]["1"]
    assert [row["batch"] for row in steps["steps"]] == [1, 2]
    for row in steps["steps"]:
        assert row["step_ms"] > 0 and row["weight_streaming_bound_ms"] > 0 and row["compute_bound_ms"] > 0
        # a bound is a bound: no step beats the weight-streaming floor by more than timer noise
        assert row["step_ms"] > 0.5 * row["weight_streaming_bound_ms"]
    assert steps["weight_bytes"] > 500e6  # SmolLM2-135M in fp32, the tied vocabulary projection included


def test_bench_engine_vs_vllm_refuses_an_unknown_model():
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "engine", "--vs-vllm",
                           "--models", "gpt2"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--models takes bench and/or smollm2" in done.stderr


@pytest.mark.slow  # ~15 s: a few distillation steps, then batch 1 and 2 with and without drafts
def test_bench_engine_speculative_prints_speedups_and_acceptance():
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "engine", "--speculative", "--json",
         "--spec-batches", "1,2", "--spec-tokens", "16", "--spec-k", "2", "--spec-distill-steps", "3"],
        capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["results"]) == {"greedy/batch_1", "greedy/batch_2", "temperature_1/batch_1",
                                      "temperature_1/batch_2"}
    for row in result["results"].values():
        assert row["plain_tokens_per_s"] > 0 and row["k2"]["speedup"] > 0
        assert 0 <= row["k2"]["accept_rate"] <= 1 and row["k2"]["accept_length"] >= 1
    assert result["draft"]["distill_steps"] == 3
