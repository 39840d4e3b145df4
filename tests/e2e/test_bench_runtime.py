"""`miles-async bench runtime` runs end to end and prints one JSON object (tiny counts; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runtime_prints_one_json_object_with_ratios():
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "runtime", "--json", "--no-ray", "--reps", "1",
         "--num-sequential", "200", "--num-pipelined", "1000"],
        capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for side in ("miles_async_ipc", "miles_async_tcp", "raw_zmq_ipc", "raw_zmq_tcp"):
        assert result[side]["sequential_per_s"] > 0 and result[side]["pipelined_per_s"] > 0
        assert 0 < result[side]["p50_us"] <= result[side]["p99_us"]
    assert result["ray_actor"] is None
    assert set(result["ratios"]["ipc"]) >= {"raw_zmq_over_ours_sequential", "raw_zmq_over_ours_pipelined"}
    assert "[bench runtime] ipc round 1/1" in done.stderr
