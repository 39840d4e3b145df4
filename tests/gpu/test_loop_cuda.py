"""The main job on CUDA, trainer and engine: `miles-async run recipes/reverse.toml`, shortened,
weights to the engine by `weights.transport = "broadcast"`, every push verified.

What goes on the GPU:
- the trainer: `trainer.backend = "nccl"` puts its rank on `cuda:LOCAL_RANK` (trainer/fsdp.py
  `init_distributed`); a run that finishes with it trained on CUDA (NCCL takes device tensors only);
- the embedded engine: `rollout.engine.device = "cuda"` puts its weights, KV cache, step tensors and
  sampling on a GPU (engine/core.py; a run that finishes with it generated there, since a device it
  cannot use fails the engine at start). A one-node run with an engine on CUDA hands each engine a
  GPU of its own after the trainer ranks' (`one_node_gpus`, `Fleet._gpu_env`: CUDA_VISIBLE_DEVICES);
  with one GPU the engine shares the trainer's;
- weights over gloo (`weights.backend = "gloo"`): received on the host, copied into the engine's GPU
  weights (`EngineActor.receive_broadcast`);
- weights over NCCL (`weights.backend = "nccl"`): from the pusher's GPU straight into the engine's.
  The pusher (the controller's process, GPU 0) and the engine must be on two different GPUs (NCCL
  refuses two ranks of one communicator on one GPU: "Duplicate GPU detected"), so that case is
  skipped below two GPUs.

GPU only: skipped, with the reason, where no CUDA GPU (or no NCCL) is available. The engine alone on
CUDA: test_engine_cuda.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _support_gpu import cuda_nccl_skip_reason

from miles_async.observe import RunTrace, StepTrace, UpdateTrace, decode_trace

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))  # the main-job helpers, shared with tests/e2e
from _support_run import SHORT

RECIPE = Path(__file__).parents[2] / "recipes" / "reverse.toml"
NUM_STEPS = 4
RUN_TIMEOUT_S = 240.0


pytestmark = pytest.mark.skipif(cuda_nccl_skip_reason() is not None, reason=str(cuda_nccl_skip_reason()))

NCCL_WEIGHTS = pytest.param("nccl", id="weights-nccl", marks=[
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="weights over NCCL need the pusher and the engine on two GPUs (NCCL refuses two "
                              f"ranks on one GPU); {torch.cuda.device_count()} visible")])


def run_main_job(args: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """The CLI in a session of its own, killed with everything it started if it outlives
    `timeout_s` (a stuck NCCL collective does not time out by itself soon): (rc or None, out, err)."""
    proc = subprocess.Popen([sys.executable, "-m", "miles_async.launch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("weights_backend", [pytest.param("gloo", id="weights-gloo"), NCCL_WEIGHTS])
def test_the_main_job_trains_on_cuda_with_verified_broadcast_updates(tmp_path: Path, weights_backend: str) -> None:
    out = tmp_path / "run"
    rc, stdout, stderr = run_main_job(
        ["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, f"loop.num_steps={NUM_STEPS}", "eval.every=0",
         "loop.mode=sync",  # every batch from the version just pushed: the engine's log-probs are the trainer's
         "trainer.backend=nccl", "rollout.engine.device=cuda", "weights.transport=broadcast",
         f"weights.backend={weights_backend}",
         "weights.verify=always", "weights.timeout_s=60"], RUN_TIMEOUT_S)
    assert rc == 0, f"rc {rc} (None: killed after {RUN_TIMEOUT_S:g}s)\n{stderr[-4000:]}"
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["num_steps"] == NUM_STEPS and not summary["interrupted"]
    config = json.loads((out / "config.json").read_text())
    assert config["trainer"]["backend"] == "nccl"  # the trainer's rank was on CUDA, or the run had failed
    assert config["rollout"]["engine"]["device"] == "cuda"  # so was the engine, or it had failed to start
    assert (config["weights"]["transport"], config["weights"]["backend"]) == ("broadcast", weights_backend)

    records = decode_trace(out / "trace.jsonl")
    header = records[0]
    assert isinstance(header, RunTrace) and header.transport == "broadcast"
    updates = [r for r in records if isinstance(r, UpdateTrace) and r.target == "rollout"]
    steps = [r for r in records if isinstance(r, StepTrace)]
    # one push after the warm start and one per RL step (the last one's may end the run), each by
    # broadcast; with weights.verify = "always" each was checked against the sender's checksums
    assert len(updates) >= NUM_STEPS and {u.transport for u in updates} == {"broadcast"}
    assert all(u.num_bytes > 0 and u.end_s >= u.start_s for u in updates)
    assert len(steps) == NUM_STEPS

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean")), m
        assert m["train/staleness_max"] == 0 and m["train/num_samples"] > 0
        # the engine sampled from the pushed version; the trainer scores the same tokens with the
        # same weights, both on CUDA: only float rounding between their kernels apart
        assert m["train/logprob_abs_diff"] < 1e-3, m
