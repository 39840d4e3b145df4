"""`miles-async bench engine` runs end to end and prints one JSON object (tiny sizes; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_engine_prints_one_json_object_with_the_ratio_and_hit_rate():
    pytest.importorskip("transformers", reason="the peer, HF generate, needs transformers (the dev extra)")
    done = subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", "bench", "engine", "--json", "--num-requests", "12",
         "--max-output", "24", "--num-sessions", "3", "--num-turns", "3"],
        capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for side in ("embedded_engine", "embedded_engine_http", "hf_generate_static_batches"):
        assert result[side]["tokens_per_s"] > 0
        assert result[side]["useful_tokens"] == result["workload"]["useful_tokens"]
    assert result["ratios"]["throughput_vs_hf"] > 0
    assert result["hf_generate_static_batches"]["reference_point"]["tokens_per_s"] > 0
    assert 0 < result["multiturn"]["prefix_cache_hit_rate"] <= 1
    assert result["multiturn"]["hit_rate_by_turn"][0] == 0.0
    assert "[bench engine] embedded engine, in process" in done.stderr
