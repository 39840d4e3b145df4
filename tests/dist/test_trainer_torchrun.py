"""The trainer's pieces under torchrun itself: rendezvous from the env variables torchrun sets.

`TrainerRank` sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK from its constructor; here
torchrun sets them, and the same `init_distributed` + `Trainer` run 2 ranks over gloo. Each rank
plans the batch as `TrainerGroup.train` would (`plan_step`) and trains its own share.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from miles_async.models import init_model

TIMEOUT_S = 90.0

SCRIPT = """
import gc, json, sys
import msgspec, torch, torch.distributed as dist
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import init_distributed
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import Trainer
from miles_async.trajectory import TokenData, Trajectory

torch.set_num_threads(1)
device = init_distributed("gloo", timeout_s=60)
config = TrainerConfig(model_dir=sys.argv[1], lr=1e-3, micro_batch_tokens=16)
trainer = Trainer(config, device)
samples = [Trajectory(request_id=i, num_tokens=n, num_prompt_tokens=1, num_generated_tokens=n - 1,
                      data=TokenData.build(tokens=list(range(1, n + 1)), loss_mask=[0] + [1] * (n - 1),
                                           logprobs=[0.0] * n))
           for i, n in enumerate((12, 5, 9))]
plan = plan_step(samples, dist.get_world_size(), config.micro_batch_tokens, config.policy_loss.aggregation, None)
share = plan.per_rank[dist.get_rank()]
metrics = [msgspec.to_builtins(trainer.train_step([samples[i] for i in share], [1.0] * len(share),
                                                  num_micro_batches=plan.num_micro_batches,
                                                  denominator=plan.denominator))
           for _ in range(3)]
shares = [None] * dist.get_world_size()
dist.all_gather_object(shares, [samples[i].request_id for i in share])
if dist.get_rank() == 0:
    print("METRICS " + json.dumps(metrics))
    print("SHARES " + json.dumps(shares))
dist.barrier()  # gloo: a rank that tears down while its peer still talks aborts ("terminate called")
dist.destroy_process_group()
# Free the FSDP model before the interpreter's exit, whose teardown of it can abort the process
# ("terminate called without an active exception": about one run in six under load, seen here);
# TrainerRank does the same when it stops.
del trainer
gc.collect()
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
    # each rank trained its own share, and the metrics count the whole batch (all-reduced)
    line = next(line for line in done.stdout.splitlines() if line.startswith("SHARES "))
    shares = json.loads(line.removeprefix("SHARES "))
    assert sorted(i for share in shares for i in share) == [0, 1, 2] and all(shares), shares
    assert all((m["num_samples"], m["num_tokens"], m["num_trained_tokens"]) == (3, 26, 23) for m in metrics)
