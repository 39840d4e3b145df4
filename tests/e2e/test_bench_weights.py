"""`miles-async bench weights` runs end to end and prints one JSON object (16 MiB; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~7 s: every transport and format
def test_bench_weights_prints_one_json_object_with_ratios():
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "weights", "--json", "--mib", "16", "--reps", "1",
         "--bucket-mib", "4", "--formats", "nvfp4,int4"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["bench"] == "weights" and result["bytes"] >= 16 << 20
    for side in ("copy_", "colocated", "shm", "broadcast", "raw_gloo_broadcast", "disk_delta"):
        assert result[side]["s_per_update"] > 0 and result[side]["gb_per_s"] > 0, side
    for side in ("colocated", "shm", "broadcast", "disk_delta"):
        assert result[side]["bit_exact"] is True, side
    assert result["colocated"]["num_aliased"] == result["num_tensors"], "fp32 into fp32: every tensor aliased"
    assert result["broadcast"]["num_buckets"] > 1
    assert result["broadcast"]["bytes_sent"] == result["raw_gloo_broadcast"]["bytes_sent"] == result["bytes"]
    delta = result["disk_delta"]
    assert 0 < delta["changed_fraction"] < 1 and 0 < delta["payload_fraction"] < 1
    assert "AdamW" in delta["step"] and delta["lr"] == 1e-6
    ratios = result["ratios"]
    assert set(ratios) >= {"shm_over_copy", "colocated_over_copy", "broadcast_over_raw", "delta_payload_fraction",
                           "targets"}
    assert set(result["meets_targets"]) == {"shm", "broadcast", "disk_delta", "all"}
    assert all(isinstance(v, bool) for v in result["meets_targets"].values())
    for fmt in ("nvfp4", "int4"):  # quantized pushes: smaller than bf16, their deltas smaller still, exact
        figures = result["formats"][fmt]
        assert 0 < figures["delta_payload_fraction"] < figures["push_fraction"] < 0.5 and figures["bit_exact"], fmt
    assert "[bench weights] broadcast:" in done.stderr and "[bench weights] colocated:" in done.stderr
