"""`miles-async bench optimizer` runs end to end on a small random model (~113M parameters, bf16)
and prints one JSON object: torch's in-memory AdamW and the streamed one, buffered and uncached,
beside the disk's measured rates (no speed asserted). Slow: ~40 s on 2 cores (three subprocesses
each build the model; the rate test writes the state's size twice)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_bench_optimizer_prints_every_side_and_the_disk_bound(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "miles_async.launch.cli", "bench", "optimizer", "--json", "--model",
                           "random", "--params", "1e8", "--dtype", "bfloat16", "--steps", "1", "--threads", "1",
                           "--bucket-mib", "16", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    numel = result["workload"]["num_params"]
    assert 0.9e8 < numel < 1.3e8 and result["workload"]["streamed_state_bytes"] == 12 * numel
    assert min(result["disk"][key] for key in ("first_write_bytes_per_s", "write_bytes_per_s", "read_bytes_per_s")) > 0
    memory = result["sides"]["memory"]
    assert memory["state_bytes"] >= 4 * numel  # bf16 moments
    for side in ("disk", "disk_uncached"):
        row = result["sides"][side]
        assert row["bytes_read_per_step"] == row["bytes_written_per_step"] == 12 * numel  # master + moments, fp32
        # a bucket: 16 MiB of 12-byte elements, cut on the 64-element grid
        assert row["ratio_peak_state_over_bucket"] <= 2.0 and (16 << 20) - 12 * 64 < row["bucket_bytes"] <= 16 << 20
        assert row["rss_added_bytes"] < memory["rss_added_bytes"] and row["io_bound_s"] > 0
        assert row["ratio_step_over_memory"] > 0
    assert list(tmp_path.iterdir()) == []  # the state files and the rate test's file have no names
