"""Trainer ranks in real spawned processes over gloo: training, world-size agreement, checkpoints.

Each rank is a `TrainerRank` actor in its own process (our runtime's spawn), joined by
torch.distributed (gloo) and sharded with FSDP2. The batch's arrays are put into this (the test's)
process's data plane and the samples travel as `BlobRef`s: `TrainerGroup.train` plans the step and
sends each rank only its share, which the rank reads from the data plane. Every scenario has a
deadline.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, ClassVar

import msgspec
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
from miles_async.runtime import ActorSystem, BlobRef, DataPlane, Message, RemoteError, SpawnError, handler
from miles_async.trainer import checkpoint
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import StepMetrics
from miles_async.trajectory import TokenData, Trajectory, encode_data

TIMEOUT_S = 120.0
ASK_S = 60.0
LENGTHS = (14, 9, 20, 6, 11, 17)  # uneven, so 1 and 2 ranks pack different micro-batches


class ArmCrash(Message[None]):
    """Make the next checkpoint save crash midway."""


class ShareReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank was sent, step by step, and what it read from the data plane."""

    request_ids: list[list[int]]  # per step: the samples of this rank's TrainStep
    losses: list[float]  # per step: the loss it replied (the whole batch's, all-reduced)
    by_reference: bool  # every sample arrived as a BlobRef (its arrays not in the message)
    num_reads: int  # blobs this rank's process read from the data plane


class Shares(Message[ShareReport]):
    """What this rank received so far."""


class RecordingTrainerRank(TrainerRank):
    """A `TrainerRank` that records the share each `TrainStep` brings it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.request_ids: list[list[int]] = []
        self.losses: list[float] = []
        self.by_reference = True

    @handler
    async def train_step(self, msg: TrainStep) -> StepMetrics:
        self.request_ids.append([s.request_id for s in msg.samples])
        self.by_reference = self.by_reference and all(isinstance(s.data, BlobRef) for s in msg.samples)
        metrics = await super().train_step(msg)
        self.losses.append(metrics.loss)
        return metrics

    @handler
    def shares(self, msg: Shares) -> ShareReport:
        stats = self.system.dataplane.stats
        return ShareReport(request_ids=self.request_ids, losses=self.losses, by_reference=self.by_reference,
                           num_reads=stats.num_mapped_reads + stats.num_fetched_reads)


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


def sample(tokens: list[int], mask: list[int], logprobs: list[float], *, reward: float, prompt_id: int,
           request_id: int) -> Trajectory:
    """A trajectory with its arrays inline, its metadata (what the planner reads) from the mask."""
    num_generated = sum(mask)
    return Trajectory(prompt_id=prompt_id, request_id=request_id, reward=reward, num_tokens=len(tokens),
                      num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated,
                      data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs))


def batch() -> list[Trajectory]:
    """Three prompts, two samples each, one right (reward 1) and one wrong: GRPO advantages of +-0.71."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i, length in enumerate(LENGTHS):
        tokens = torch.randint(1, 250, (length,), generator=gen).tolist()
        samples.append(sample(tokens, [0] * 4 + [1] * (length - 4), [-5.5] * length, reward=float(i % 2 == 0),
                              prompt_id=i // 2, request_id=i))
    return samples


def by_reference(samples: list[Trajectory], dataplane: DataPlane) -> list[Trajectory]:
    """`samples` with their arrays put into `dataplane` (this process's), carrying BlobRefs instead."""
    out = []
    for s in samples:
        assert isinstance(s.data, TokenData)
        out.append(msgspec.structs.replace(s, data=dataplane.put(encode_data(s.data))))
    return out


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


async def train(group: TrainerGroup, samples: list[Trajectory], num_steps: int, cursor_from: int = 0
                ) -> list[StepMetrics]:
    return [await group.train(samples, data_cursor=cursor_from + i + 1, timeout_s=ASK_S) for i in range(num_steps)]


def test_one_and_two_ranks_train_and_agree(model_dir: Path, tmp_path: Path) -> None:
    num_steps = 4
    samples = batch()

    async def run_world(system: ActorSystem, refs: list[Trajectory],
                        world_size: int) -> tuple[list[StepMetrics], dict[str, torch.Tensor], float]:
        out = tmp_path / f"ws{world_size}"
        cfg = trainer_config(model_dir, out)
        group = await TrainerGroup.spawn(system, cfg, world_size, name=f"ws{world_size}", rank_cls=RecordingTrainerRank)
        metrics = await train(group, refs, num_steps)
        manifest = await group.ask(ExportWeights(), ASK_S)
        assert manifest.weight_version == num_steps
        assert len(manifest.buckets) > 1  # 64 KiB buckets split the tiny model
        reports: list[ShareReport] = await group.ask_all(Shares(), ASK_S)
        heldout = await group.eval_loss(refs, timeout_s=ASK_S)  # the SFT loss at the trained weights, reduced
        await group.stop()
        # Each rank was sent only its planned share, as references, and read exactly those blobs.
        plan = plan_step(samples, world_size, cfg.micro_batch_tokens, cfg.policy_loss.aggregation, cfg.advantage)
        assert sorted(i for share in plan.per_rank for i in share) == list(range(len(samples)))
        for share, report in zip(plan.per_rank, reports, strict=True):
            assert report.request_ids == [[samples[i].request_id for i in share]] * num_steps
            assert report.by_reference and report.num_reads == len(share) * num_steps
            assert report.losses == [m.loss for m in metrics], "ranks must report the reduced metrics"
            if world_size > 1:
                assert 0 < len(share) < len(samples)
        for m in metrics:  # counts are all-reduced: the whole batch, not a share
            assert (m.num_samples, m.num_tokens, m.num_trained_tokens) == (6, sum(LENGTHS), sum(LENGTHS) - 4 * 6)
            assert m.mean_reward == pytest.approx(0.5) and m.num_micro_batches == plan.num_micro_batches
        return metrics, read_weights(manifest), heldout

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            refs = by_reference(samples, system.dataplane)  # this process's data plane: the ranks read from it
            (m1, w1, h1), (m2, w2, h2) = await asyncio.gather(run_world(system, refs, 1), run_world(system, refs, 2))
            assert h1 > 0 and h2 == pytest.approx(h1, rel=1e-4)  # one rank's loss or two ranks' shares reduced
            system.dataplane.free([s.data for s in refs if isinstance(s.data, BlobRef)])
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


@pytest.mark.slow  # ~8 s: three spawned runs of two ranks
def test_crash_mid_save_keeps_previous_and_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    total_steps, first_steps = 4, 2

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            resumed_cfg = trainer_config(model_dir, tmp_path / "resumed")
            straight_cfg = trainer_config(model_dir, tmp_path / "straight")

            samples = by_reference(batch(), system.dataplane)

            async def straight() -> dict[str, torch.Tensor]:
                group = await TrainerGroup.spawn(system, straight_cfg, 2, name="straight")
                await train(group, samples, total_steps)
                weights = read_weights(await group.ask(ExportWeights(), ASK_S))
                await group.stop()
                return weights

            async def first_leg() -> None:
                group = await TrainerGroup.spawn(system, resumed_cfg, 2, name="first", rank_cls=CrashingTrainerRank)
                await train(group, samples, first_steps)
                saved = await group.ask(SaveCheckpoint(), ASK_S)
                assert (saved.step, saved.data_cursor) == (first_steps, first_steps)
                await train(group, samples, 1, cursor_from=first_steps)
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
            await train(group, samples, total_steps - first_steps, cursor_from=first_steps)
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
