"""Trainer ranks in real spawned processes over gloo: training, world-size agreement, checkpoints.

Each rank is a `TrainerRank` actor in its own process (our runtime's spawn), joined by
torch.distributed (gloo) and sharded with FSDP2. Every scenario has a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from _support import config, scenario
from safetensors.torch import load_file

from miles_async.actors.trainer import (
    ExportWeights,
    LoadCheckpoint,
    RankPlacement,
    SaveCheckpoint,
    TrainerGroup,
    TrainerRank,
    TrainStep,
    WeightManifest,
)
from miles_async.models import init_model
from miles_async.runtime import ActorSystem, Message, RemoteError, SpawnError, handler
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.packing import TrainSample

TIMEOUT_S = 120.0
ASK_S = 60.0
LENGTHS = (14, 9, 20, 6, 11, 17)  # uneven, so 1 and 2 ranks pack different micro-batches


class ArmCrash(Message):
    Reply: ClassVar[Any] = None


class CrashingTrainerRank(TrainerRank):
    """Fails its next checkpoint save after the shards are on disk, before the rename."""

    armed = False

    @handler
    def arm(self, msg: ArmCrash) -> None:
        self.armed = True

    def _after_write(self, tmp_folder: Path) -> None:
        if self.armed:
            self.armed = False
            assert any(tmp_folder.iterdir()), "the save should have written something by now"
            raise OSError(f"simulated crash mid-save in {tmp_folder}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny")


def batch() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(1)
    samples = []
    for length in LENGTHS:
        tokens = torch.randint(1, 250, (length,), generator=gen).tolist()
        mask = [0] * 4 + [1] * (length - 4)
        samples.append(TrainSample(tokens=tokens, loss_mask=mask, rollout_logprobs=[-5.5] * length,
                                   advantage=1.0, reward=1.0))
    return samples


def trainer_config(model_dir: Path, out: Path, **overrides: Any) -> TrainerConfig:
    fields: dict[str, Any] = {"model_dir": str(model_dir), "lr": 1e-3, "micro_batch_tokens": 24, "num_threads": 1,
                              "checkpoint_dir": str(out / "ckpt"), "weights_dir": str(out / "weights"),
                              "weight_bucket_bytes": 64 << 10}
    fields.update(overrides)
    return TrainerConfig(**fields)


def read_weights(manifest: WeightManifest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for bucket in manifest.buckets:
        loaded = load_file(bucket.path)
        assert list(loaded) == bucket.names or set(loaded) == set(bucket.names)
        tensors.update(loaded)
    return tensors


async def train(group: TrainerGroup, num_steps: int, cursor_from: int = 0) -> list[Any]:
    metrics = []
    for i in range(num_steps):
        per_rank = await group.ask_all(TrainStep(samples=batch(), data_cursor=cursor_from + i + 1), ASK_S)
        assert all(m.loss == per_rank[0].loss for m in per_rank), "ranks must report the reduced metrics"
        metrics.append(per_rank[0])
    return metrics


def test_one_and_two_ranks_train_and_agree(model_dir: Path, tmp_path: Path) -> None:
    num_steps = 4

    async def run_world(system: ActorSystem, world_size: int) -> tuple[list[Any], dict[str, torch.Tensor]]:
        out = tmp_path / f"ws{world_size}"
        group = await TrainerGroup.spawn(system, trainer_config(model_dir, out), world_size, name=f"ws{world_size}")
        metrics = await train(group, num_steps)
        manifest = await group.ask(ExportWeights(), ASK_S)
        assert manifest.weight_version == num_steps
        assert len(manifest.buckets) > 1  # 64 KiB buckets split the tiny model
        await group.stop()
        return metrics, read_weights(manifest)

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            (m1, w1), (m2, w2) = await asyncio.gather(run_world(system, 1), run_world(system, 2))
        for metrics in (m1, m2):
            losses = [m.loss for m in metrics]
            assert all(b < a for a, b in itertools.pairwise(losses)), losses
            assert [m.weight_version for m in metrics] == list(range(1, num_steps + 1))
            assert all(m.grad_norm > 0 and m.tokens_per_s > 0 for m in metrics)
            assert metrics[0].logprob_abs_diff > 0
        assert m1[0].num_micro_batches > m2[0].num_micro_batches  # different packing, same update
        for a, b in zip(m1, m2):
            assert a.loss == pytest.approx(b.loss, rel=1e-5)
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
            # the metrics are summed per micro-batch and all-reduced once: the same whatever the split
            for name in ("pg_loss", "logprob_abs_diff", "rollout_kl_k3", "entropy"):
                assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-5), name
            assert a.tis_truncated_fraction == pytest.approx(b.tis_truncated_fraction, abs=1.5 / a.num_trained_tokens)
        assert w1.keys() == w2.keys()
        for name in w1:
            torch.testing.assert_close(w1[name], w2[name], rtol=0, atol=5e-5, msg=name)  # measured: 2e-6

    scenario(main, TIMEOUT_S)


def test_crash_mid_save_keeps_previous_and_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    total_steps, first_steps = 4, 2

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            resumed_cfg = trainer_config(model_dir, tmp_path / "resumed")
            straight_cfg = trainer_config(model_dir, tmp_path / "straight")

            async def straight() -> dict[str, torch.Tensor]:
                group = await TrainerGroup.spawn(system, straight_cfg, 2, name="straight")
                await train(group, total_steps)
                weights = read_weights(await group.ask(ExportWeights(), ASK_S))
                await group.stop()
                return weights

            async def first_leg() -> None:
                group = await TrainerGroup.spawn(system, resumed_cfg, 2, name="first", rank_cls=CrashingTrainerRank)
                await train(group, first_steps)
                saved = await group.ask(SaveCheckpoint(), ASK_S)
                assert (saved.step, saved.data_cursor) == (first_steps, first_steps)
                await train(group, 1, cursor_from=first_steps)
                await group.ask_all(ArmCrash(), ASK_S)
                with pytest.raises(RemoteError, match="simulated crash mid-save"):
                    await group.ask_all(SaveCheckpoint(), ASK_S)
                await group.stop()

            straight_task = asyncio.ensure_future(straight())
            await first_leg()
            root = Path(resumed_cfg.checkpoint_dir)
            assert checkpoint.latest(root) == checkpoint.step_folder(root, first_steps)
            assert (root / f".tmp-{checkpoint.step_folder(root, first_steps + 1).name}").is_dir()

            group = await TrainerGroup.spawn(system, resumed_cfg, 2, name="second")  # new processes
            info = await group.ask(LoadCheckpoint(), ASK_S)
            assert (info.step, info.weight_version, info.data_cursor) == (first_steps, first_steps, first_steps)
            await train(group, total_steps - first_steps, cursor_from=first_steps)
            resumed = read_weights(await group.ask(ExportWeights(), ASK_S))
            await group.stop()
            expected = await straight_task
        assert resumed.keys() == expected.keys()
        for name in expected:
            assert torch.equal(resumed[name], expected[name]), f"{name} differs after resume"

    scenario(main, TIMEOUT_S)


def test_ranks_that_do_not_see_the_run_folder_fail_together_naming_themselves(model_dir: Path,
                                                                                tmp_path: Path) -> None:
    token_file = tmp_path / ".run-token"
    token_file.write_text("another run's token")  # what a node without the shared folder might hold

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            cfg = trainer_config(model_dir, tmp_path, shared_file=str(token_file), shared_token="this run")
            placement = [RankPlacement(local_rank=0, host="127.0.0.1"), RankPlacement(local_rank=1, host="127.0.0.1")]
            with pytest.raises(SpawnError, match=r"trainer rank\(s\) 0 \(on 127.0.0.1\), 1 \(on 127.0.0.1\) do not "
                                                 r"see the run folder of node 0"):
                await TrainerGroup.spawn(system, cfg, 2, name="blind", placement=placement)
            # ranks that see it start: every run does (the controller always sets the token), e.g. tests/e2e

    scenario(main, TIMEOUT_S)
