"""`miles-async bench weights` runs end to end and prints one JSON object (16 MiB; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_weights_prints_one_json_object_with_ratios():
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "weights", "--json", "--mib", "16", "--reps", "1",
         "--bucket-mib", "4"],
        capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["bench"] == "weights" and result["bytes"] >= 16 << 20
    for side in ("copy_", "shm", "broadcast", "raw_gloo_broadcast", "disk_delta"):
        assert result[side]["s_per_update"] > 0 and result[side]["gb_per_s"] > 0, side
    for side in ("shm", "broadcast", "disk_delta"):
        assert result[side]["bit_exact"] is True, side
    assert result["broadcast"]["num_buckets"] > 1
    assert 0 < result["disk_delta"]["payload_fraction"] < 1
    ratios = result["ratios"]
    assert set(ratios) >= {"shm_over_copy", "broadcast_over_raw", "delta_payload_fraction", "meets", "targets"}
    assert set(ratios["meets"]) == {"shm", "broadcast", "disk_delta"}
    assert "[bench weights] broadcast:" in done.stderr
