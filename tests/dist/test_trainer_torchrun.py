"""The trainer's pieces under torchrun itself: rendezvous from the env variables torchrun sets.

`TrainerRank` sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK from its constructor; here
torchrun sets them, and the same `init_distributed` + `Trainer` run 2 ranks over gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from miles_async.models import init_model

TIMEOUT_S = 90.0

SCRIPT = """
import json, sys
import msgspec, torch, torch.distributed as dist
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import init_distributed
from miles_async.trainer.packing import TrainSample
from miles_async.trainer.step import Trainer

torch.set_num_threads(1)
device = init_distributed("gloo", timeout_s=60)
trainer = Trainer(TrainerConfig(model_dir=sys.argv[1], lr=1e-3, micro_batch_tokens=16), device)
samples = [TrainSample(tokens=list(range(1, n + 1)), loss_mask=[0] + [1] * (n - 1), rollout_logprobs=[0.0] * n,
                       advantage=1.0) for n in (12, 5, 9)]
metrics = [msgspec.to_builtins(trainer.train_step(samples)) for _ in range(3)]
if dist.get_rank() == 0:
    print("METRICS " + json.dumps(metrics))
dist.barrier()  # gloo: a rank that tears down while its peer still talks aborts ("terminate called")
dist.destroy_process_group()
"""


def test_two_ranks_under_torchrun(tmp_path: Path) -> None:
    folder = init_model("qwen3", "tiny", tmp_path / "tiny")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(folder)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("METRICS "))
    metrics = json.loads(line.removeprefix("METRICS "))
    losses = [m["loss"] for m in metrics]
    assert losses[0] > losses[1] > losses[2], losses
    assert [m["weight_version"] for m in metrics] == [1, 2, 3]
