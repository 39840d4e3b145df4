"""`miles-async bench runtime` runs end to end and prints one JSON object (tiny counts; no speed asserted);
the Ray peer pipelines its calls each way Ray's users do and reports the best."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles_async.bench.runtime_peers import RAY_PIPELINED, ray_actor


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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_peer_reports_each_pipelining_strategy_and_takes_the_best():
    result = ray_actor(50, 400, reps=1, window=16, timeout_s=60.0)
    assert result is not None, "ray is a dev dependency"
    strategies = result["pipelined_strategies"]
    assert set(strategies) == set(RAY_PIPELINED) == {"get_oldest", "wait", "batched_get"}
    assert all(rate > 0 for rate in strategies.values())
    assert result["pipelined_best"] == max(strategies, key=strategies.__getitem__)
    assert result["pipelined_per_s"] == strategies[result["pipelined_best"]]
    assert result["settings"]["window"] == 16 and result["settings"]["ray"]
