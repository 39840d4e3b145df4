"""Bulk bytes off the control plane: an R3 batch too big for any message reaches two trainer ranks.

The batch: 200k tokens of a 48-layer, top-8 MoE (synthetic routing arrays), as trajectories whose
token arrays are in this process's data plane (this process plays the controller: in a run the
rollout workers, which put them there, live in the controller's process). `TrainerGroup.train`
plans the step and sends each rank only its share, as references; each rank reads its share from
the data plane (mapped on one node, fetched over its mailbox from another "node") and reports
checksums. The ranks are real `TrainerRank` processes joined by gloo; only the model is replaced
(`_ChecksumTrainer`), since a 48-layer MoE forward over 200k tokens is not a CPU test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch.distributed as dist
from _support import config, scenario

from miles_async.actors.trainer import TrainerGroup, TrainerRank, TrainStep
from miles_async.runtime import ActorSystem, BlobRef, RuntimeConfig
from miles_async.runtime.dataplane import default_dataplane_dir
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import init_distributed
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import StepMetrics
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, encode_data

NUM_SAMPLES, TOKENS_PER_SAMPLE = 50, 4000  # 200k tokens
NUM_MOE_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128
TIMEOUT_S = 240.0


class _ChecksumTrainer:
    """Stands in for the model: checksums each sample of the share it is given (in a file per rank)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.rank = dist.get_rank()

    def train_step(self, samples: list[Trajectory], advantages: list[float], *, num_micro_batches: int,
                   denominator: float, data_cursor: int | None = None, objective: str | None = None,
                   lr: float | None = None) -> StepMetrics:
        sums: dict[str, Any] = {}
        for sample in samples:
            data = sample.data
            assert isinstance(data, TokenData), type(data)
            sums[str(sample.prompt_id)] = [zlib.crc32(data.tokens), zlib.crc32(data.routed_experts),
                                           data.num_tokens, data.experts_shape]
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(sums))
        count = [len(samples)]
        totals: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(totals, count)  # a real collective over the ranks' process group
        num = sum(t[0] for t in totals)
        return StepMetrics(step=1, weight_version=1, loss=0.0, grad_norm=0.0, num_samples=num, num_tokens=0,
                           num_trained_tokens=0, num_micro_batches=num_micro_batches, tokens_per_s=0.0,
                           logprob_abs_diff=0.0, mean_reward=0.0, elapsed_s=0.0)


class ChecksumRank(TrainerRank):
    def _build(self) -> None:
        self.env.export()
        init_distributed("gloo", self.config.process_group_timeout_s)
        self.trainer = _ChecksumTrainer(self.config.checkpoint_dir)  # type: ignore[assignment]


class NodeSpawner:
    """Spawns a rank from a second actor system (another "node": its own shared-memory folder)."""

    def __init__(self, node: ActorSystem) -> None:
        self.node = node

    async def spawn(self, cls: type, name: str, *, args: tuple = (), kwargs: dict | None = None,
                    restart: Any = None, env: Any = None) -> Any:
        return await self.node.spawn(cls, name, args=args, kwargs=kwargs, process=True, restart=restart)


def make_batch(rng: np.random.Generator) -> tuple[list[TokenData], dict[str, list[Any]]]:
    batch, expected = [], {}
    for i in range(NUM_SAMPLES):
        tokens = rng.integers(0, 150_000, TOKENS_PER_SAMPLE)
        experts = rng.integers(0, NUM_EXPERTS, (TOKENS_PER_SAMPLE - 1, NUM_MOE_LAYERS, TOP_K))
        data = TokenData.build(tokens=tokens, loss_mask=np.r_[np.zeros(100), np.ones(TOKENS_PER_SAMPLE - 100)],
                               logprobs=-rng.random(TOKENS_PER_SAMPLE), routed_experts=experts)
        batch.append(data)
        expected[str(i)] = [zlib.crc32(data.tokens), zlib.crc32(data.routed_experts), TOKENS_PER_SAMPLE,
                            [NUM_MOE_LAYERS, TOP_K]]
    return batch, expected


@pytest.mark.parametrize("where", ["same_node", pytest.param("other_node", marks=pytest.mark.slow)])
def test_an_r3_batch_of_200k_tokens_reaches_two_ranks_intact_as_references(where: str, tmp_path: Path) -> None:
    async def main() -> None:
        shm = tempfile.mkdtemp(prefix="data-path-", dir=default_dataplane_dir())
        other = tempfile.mkdtemp(prefix="data-path-node1-", dir=default_dataplane_dir())
        try:
            async with ActorSystem("controller", config=config("ipc", dataplane_dir=shm)) as system:
                batch, expected = make_batch(np.random.default_rng(0))
                samples = []
                for i, data in enumerate(batch):
                    samples.append(Trajectory(prompt_id=i, reward=float(i % 2), num_tokens=TOKENS_PER_SAMPLE,
                                              num_prompt_tokens=100, num_generated_tokens=TOKENS_PER_SAMPLE - 100,
                                              versions=(VersionSpan(0, 100, TOKENS_PER_SAMPLE),),
                                              data=system.dataplane.put(encode_data(data))))
                batch_bytes = system.dataplane.stats.bytes_held
                assert batch_bytes > RuntimeConfig().max_message_bytes  # no message could carry it
                del batch  # from here the batch lives only in the data plane
                trainer_config = TrainerConfig(checkpoint_dir=str(tmp_path), micro_batch_tokens=8192)
                node = None
                if where == "other_node":
                    node = ActorSystem("node1", config=config("ipc", dataplane_dir=other), directory=system.address)
                    await node.start()
                try:
                    group = await TrainerGroup.spawn(system, trainer_config, 2, rank_cls=ChecksumRank,
                                                     spawner=NodeSpawner(node) if node else None)
                    plan = plan_step(samples, 2, trainer_config.micro_batch_tokens, "token", None)
                    for share in plan.per_rank:  # what each rank is sent: references, a few KB
                        step = TrainStep(samples=[samples[i] for i in share], advantages=[0.0] * len(share),
                                         num_micro_batches=plan.num_micro_batches, denominator=plan.denominator)
                        assert len(msgspec.msgpack.encode(step)) < 64 * 1024
                    tracemalloc.start()
                    metrics = await group.train(samples, objective="sft", timeout_s=TIMEOUT_S)
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
                    await group.stop()
                finally:
                    if node is not None:
                        await node.close()
                # The controller held the batch once (in its data plane) and copied none of it; serving
                # another node's reads costs it the pieces in flight (a few MiB), never a second copy.
                assert peak < (0.02 if where == "same_node" else 0.15) * batch_bytes, (peak, batch_bytes)
                assert system.dataplane.stats.bytes_held == batch_bytes
                assert metrics.num_samples == NUM_SAMPLES
                shares = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
                assert all(shares) and not set(shares[0]) & set(shares[1])  # each rank its own share
                assert {**shares[0], **shares[1]} == expected  # every sample intact, once
                assert [sorted(int(k) for k in s) for s in shares] == [sorted(p) for p in plan.per_rank]
                system.dataplane.free(s.data for s in samples if isinstance(s.data, BlobRef))
                assert system.dataplane.stats.bytes_held == 0
        finally:
            for folder in (shm, other):
                assert os.listdir(folder) == []  # no segment left behind
                shutil.rmtree(folder, ignore_errors=True)

    scenario(lambda: asyncio.wait_for(main(), TIMEOUT_S), TIMEOUT_S + 30)
