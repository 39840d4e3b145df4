"""True on-policy mode across spawned trainer ranks: the step's mismatch metric reads exactly 0.0.

The batch-invariant engine samples in this process; two `TrainerRank` actors (separate processes,
gloo, FSDP2) score the same tokens, each its own share of the packed batch (`TrainerGroup.train`
sends each rank only its share; here the arrays ride inline in the messages), and report the
all-reduced mean |trainer log-prob - rollout log-prob|.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from _support import config, scenario

from miles_async.actors.trainer import TrainerGroup
from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from miles_async.models import init_model, load_pretrained
from miles_async.runtime import ActorSystem
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.packing import plan_step
from miles_async.trajectory import TokenData, Trajectory

TIMEOUT_S = 120.0
PROMPT_LENGTHS = (5, 31, 12, 47)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense model with its matrices drawn at std 0.3, so that its distributions are far
    from uniform and sampled tokens vary."""
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0, init_std=0.3)


def sample(tokens: list[int], mask: list[int], logprobs: list[float], *, reward: float) -> Trajectory:
    """A trajectory with its arrays inline, its metadata from the mask (all of one prompt)."""
    num_generated = sum(mask)
    return Trajectory(prompt_id=0, reward=reward, num_tokens=len(tokens),
                      num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated,
                      data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs))


async def invariant_rollouts(model_dir: Path) -> list[Trajectory]:
    engine = Engine(load_pretrained(model_dir), config=EngineConfig(batch_invariant=True, kv_cache_mib=4))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    async with engine:
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(
            input_ids=p, return_logprob=True,
            sampling_params=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                           sampling_seed=i))) for i, p in enumerate(prompts)))
    return [sample(p + o.output_ids, [0] * len(p) + [1] * len(o.output_ids),
                   [0.0] * len(p) + list(o.output_token_logprobs), reward=float(i % 2))
            for i, (p, o) in enumerate(zip(prompts, outs))]


def test_two_spawned_ranks_read_a_mismatch_of_exactly_zero(model_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        samples = await invariant_rollouts(model_dir)
        async with ActorSystem(config=config("ipc")) as system:
            trainer_config = TrainerConfig(model_dir=str(model_dir), world_size=2, micro_batch_tokens=48,
                                           num_threads=1, batch_invariant=True,
                                           weights_dir=str(tmp_path / "weights"))
            group = await TrainerGroup.spawn(system, trainer_config, name="exact")  # 2 ranks, from the config
            metrics = await group.train(samples, data_cursor=1, timeout_s=60.0)
            await group.stop()
        plan = plan_step(samples, 2, trainer_config.micro_batch_tokens, trainer_config.policy_loss.aggregation, None)
        assert all(plan.per_rank), "both ranks should score a share"
        assert metrics.num_samples == len(PROMPT_LENGTHS)  # all-reduced: the whole batch
        assert metrics.num_trained_tokens == len(PROMPT_LENGTHS) * NEW_TOKENS
        assert metrics.logprob_abs_diff == 0.0 and metrics.rollout_kl_k3 == 0.0, metrics

    scenario(main, TIMEOUT_S)
