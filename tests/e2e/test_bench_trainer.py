"""`miles-async bench trainer` runs end to end on SmolLM2-135M at a tiny size and prints one JSON
object: ours and transformers' step in both precisions, each with its fraction of the measured
matmul peak, and the RL-shaped workload's three sides (no speed asserted), every side stepping the
same fused AdamW as its recorded settings show. Slow: each loads the
real model several times (~1 min each on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles_async.models import smollm2

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_bench_trainer_prints_both_sides_in_both_precisions():
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "trainer", "--json", "--batch", "2",
                           "--seq-len", "16", "--steps", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=380, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["workload"]["tokens_per_step"] == 32 and result["model"]["matmul_params"] > 130e6
    assert set(result["precisions"]) == {"float32", "bf16_autocast"}
    for row in result["precisions"].values():
        for side in ("ours", "transformers"):
            assert row[side]["tokens_per_s"] > 0 and 0 < row[side]["fraction_of_matmul_peak"] < 1.5
        assert row["ratio_ours_over_transformers"] > 0
        assert row["ours"]["optimizer"] == row["transformers"]["optimizer"]
        assert row["ours"]["optimizer"]["kernel"] == "fused" and row["ours"]["optimizer"]["lr"] == 1e-6
    assert result["matmul_flops_per_s"]["float32"] > 0


@pytest.mark.timeout(400)
def test_bench_trainer_grpo_workload_times_shared_unshared_and_padded_steps():
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "trainer", "--json", "--workload",
                           "grpo", "--groups", "2", "--group-size", "2", "--prompt-len", "6", "--steps", "1",
                           "--threads", "1", "--precisions", "float32"],  # bf16: emulated, slow, without AVX512-BF16
                          capture_output=True, text=True, timeout=380, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    workload = result["workload"]
    assert workload["kind"] == "grpo" and workload["tokens_per_step"] < workload["padded_tokens_per_step"]
    row = result["precisions"]["float32"]
    for side in ("ours", "ours_unshared", "transformers"):
        assert row[side]["tokens_per_s"] > 0
    assert row["ratio_ours_over_transformers"] > 0 and row["ratio_ours_over_unshared"] > 0
    settings = [row[side]["optimizer"] for side in ("ours", "ours_unshared", "transformers")]
    assert settings[0]["kernel"] == "fused" and settings.count(settings[0]) == 3


def test_bench_trainer_refuses_an_unknown_precision():
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "trainer", "--precisions", "fp8"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--precisions takes float32, bf16_autocast" in done.stderr
