"""`miles-async bench gpu` run on the CPU: every section of its JSON present, positive and consistent.

The bench's GPU path is the CPU path with the device swapped (torch.cuda.synchronize where it
times), so `--device cpu --tiny` runs the same code on the tiny qwen3 model: the trainer's real
step over gloo, the embedded engine, every weight transport the CPU has (colocated, shm, tensors
shared by file descriptor, a gloo broadcast; NCCL skipped with its reason) and the pause/resume
cycles. The run is a subprocess of `python -m miles_async.bench.gpu` with a timeout (13-25 s on
two cores: the tests that read it are marked slow). Then
`--device cuda` where no GPU is visible: one line on stderr, a JSON object with the reason, exit
0. A machine with a GPU hides it by CUDA_VISIBLE_DEVICES="" (no fake).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from miles_async.bench import gpu

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_async.bench.gpu", *args], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def result() -> dict:
    done = bench("--json", "--device", "cpu", "--tiny")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, "stdout carries the JSON alone, on one line"
    return json.loads(lines[0])


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


@pytest.mark.slow  # the tiny run they share takes 13-25 s on two cores
def test_the_model_and_the_machine(result):
    model, limits = result["model"], result["machine"]["limits"]
    assert result["bench"] == "gpu" and model["config"]["family"] == "qwen3" and model["config"]["qk_norm"]
    itemsize = {"torch.float32": 4, "torch.bfloat16": 2}[model["engine_dtype"]]
    assert model["num_params"] > 0 and model["weight_bytes"] == model["num_params"] * itemsize
    assert limits["matmul_flops_per_s"] > 0 and limits["published_peak_flops_per_s"] is None
    assert close(limits["copy"]["traffic_bytes_per_s"], 2 * limits["copy"]["copied_bytes_per_s"])
    assert result["settings"]["tiny"] and result["settings"]["device"] == "cpu"


@pytest.mark.slow  # the tiny run they share takes 13-25 s on two cores
def test_trainer_rows_have_prime_rls_shape_and_their_figures_follow_from_the_step_times(result):
    settings, limits = result["settings"], result["machine"]["limits"]
    cfg = gpu._tiny_config()
    rows = result["trainer"]
    assert [r["config"]["tokens_per_step"] for r in rows] == settings["tokens_per_step"] == [256, 1024]
    for row in rows:
        config, metrics, times = row["config"], row["metrics"], row["step_s"]
        tokens = config["tokens_per_step"]
        assert len(times) == settings["steps"] and min(times) > 0 and math.isfinite(row["loss"])
        assert set(metrics) == {"mfu", "throughput", "step_time", "peak_memory"}
        assert config["micro_batches"] == math.ceil(tokens / settings["micro_batch_tokens"])
        assert config["num_samples"] * config["sample_tokens"] == tokens
        assert row["flops_per_step"] == gpu.step_flops(cfg, tokens, config["sample_tokens"], config["trained_tokens"])
        assert close(metrics["step_time"]["mean"], sum(times) / len(times))
        assert close(metrics["throughput"]["min"], tokens / metrics["step_time"]["max"])
        assert close(metrics["throughput"]["mean"], sum(tokens / t for t in times) / len(times))
        # no published peak for a CPU: MFU is over the measured matmul rate, and says so
        assert row["mfu_peak"].startswith("measured") and metrics["mfu"] == row["mfu_of_measured_peak"]
        assert close(metrics["mfu"]["max"], 100 * row["flops_per_step"] / min(times) / limits["matmul_flops_per_s"])
        assert metrics["peak_memory"] == {"gib": None, "pct": None}
        assert row["peak_memory_source"] == "not measured on a CPU"


@pytest.mark.slow  # the tiny run they share takes 13-25 s on two cores
def test_engine_rows_sit_beside_the_weight_streaming_bound(result):
    limits = result["machine"]["limits"]
    rows = result["engine"]["batches"]
    assert [r["batch"] for r in rows] == [1, 64]
    for row in rows:
        assert row["step_s"] > 0 and close(row["tokens_per_s"], row["batch"] / row["step_s"])
        assert row["weight_bytes"] == result["model"]["weight_bytes"]  # tied: the whole table is read
        assert close(row["weight_streaming_bound_s"], row["weight_bytes"] / limits["copy"]["traffic_bytes_per_s"])
        assert close(row["over_bound"], row["step_s"] / row["weight_streaming_bound_s"])
        assert close(row["bound_tokens_per_s"], row["batch"] / row["weight_streaming_bound_s"])


@pytest.mark.slow  # the tiny run they share takes 13-25 s on two cores
def test_every_cpu_transport_lands_the_trained_weights_and_nccl_says_why_not(result):
    sync = result["weight_sync"]
    copy_rate = result["machine"]["limits"]["copy"]["copied_bytes_per_s"]
    for name in ("colocated", "shm", "ipc", "broadcast_gloo"):
        row = sync[name]
        assert row["equal"], name
        assert len(row["reps_s"]) == sync["reps"] and min(row["reps_s"]) > 0
        assert close(row["s_per_update"], statistics.median(row["reps_s"]))
        assert close(row["gb_per_s"], sync["bytes"] / row["s_per_update"] / 1e9)
        assert close(row["fraction_of_copy"], sync["bytes"] / copy_rate / row["s_per_update"])
    assert sync["colocated"]["num_aliased"] == sync["num_tensors"]  # the engine's dtype and device: no copy
    assert sync["ipc"]["handles"] == "file descriptors (shared memory)"
    assert "GPU memory only" in sync["broadcast_nccl"]["skipped"]


@pytest.mark.slow  # the tiny run they share takes 13-25 s on two cores
def test_pause_to_resume_around_an_update_keeps_requests_going(result):
    in_place, offload = result["pause_resume"]["in_place"], result["pause_resume"]["offload"]
    assert result["pause_resume_s"] == in_place["pause_to_resume_s"] > 0
    assert close(in_place["pause_to_resume_s"], in_place["pause_s"] + in_place["update_s"] + in_place["resume_s"])
    # paused in place mid-generation: every request finished at its length, its tokens from two versions
    assert in_place["all_finished"] and in_place["versions_per_request"] == 2
    assert offload["serves_after"] and offload["freed_bytes"] is None  # (CUDA's allocator counts it on a GPU)
    for cycle in (in_place, offload):
        assert close(cycle["over_copy_bound"], cycle["pause_to_resume_s"] / cycle["weights_copy_bound_s"])


def test_cuda_without_a_visible_gpu_skips_cleanly():
    done = bench("--json", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "gpu" and "needs a CUDA GPU and none is visible" in out["skipped"]
    assert out["machine"]["gpus_visible"] == 0
    assert "skipping" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_bad_sizes_are_refused_with_the_flag_named():
    done = bench("--device", "cpu", "--tiny", "--tokens-per-step", "300")
    assert done.returncode == 2 and "--tokens-per-step 300 is not a multiple of --sample-tokens 128" in done.stderr


def test_the_published_peak_is_the_devices_own_part():
    assert gpu.published_peak("NVIDIA H100 80GB HBM3") == (989e12, "NVIDIA H100 dense bf16, datasheet")
    assert gpu.published_peak("NVIDIA H100 PCIe")[0] == 756e12  # not the SXM part's
    assert gpu.published_peak("NVIDIA H200")[0] == 989e12 and gpu.published_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert gpu.published_peak("x86_64") == (None, None)
