"""True on-policy mode across spawned trainer ranks: the step's mismatch metric reads exactly 0.0.

The batch-invariant engine samples in this process; two `TrainerRank` actors (separate processes,
gloo, FSDP2) score the same tokens, each its own share of the packed batch, and report the
all-reduced mean |trainer log-prob - rollout log-prob|.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from _support import config, scenario

from miles_async.actors.trainer import TrainerGroup, TrainStep
from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from miles_async.models import init_model, load_pretrained
from miles_async.runtime import ActorSystem
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.packing import TrainSample

TIMEOUT_S = 120.0
PROMPT_LENGTHS = (5, 31, 12, 47)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense model with its matrices drawn at std 0.3, so that its distributions are far
    from uniform and sampled tokens vary."""
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0, init_std=0.3)


async def invariant_rollouts(model_dir: Path) -> list[TrainSample]:
    engine = Engine(load_pretrained(model_dir), config=EngineConfig(batch_invariant=True, kv_cache_mib=4))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    async with engine:
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(
            input_ids=p, return_logprob=True,
            sampling_params=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                           sampling_seed=i))) for i, p in enumerate(prompts)))
    return [TrainSample(tokens=p + o.output_ids, loss_mask=[0] * len(p) + [1] * len(o.output_ids),
                        rollout_logprobs=[0.0] * len(p) + list(o.output_token_logprobs), advantage=1.0)
            for p, o in zip(prompts, outs)]


def test_two_spawned_ranks_read_a_mismatch_of_exactly_zero(model_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        samples = await invariant_rollouts(model_dir)
        async with ActorSystem(config=config("ipc")) as system:
            trainer_config = TrainerConfig(model_dir=str(model_dir), world_size=2, micro_batch_tokens=48,
                                           num_threads=1, batch_invariant=True,
                                           weights_dir=str(tmp_path / "weights"))
            group = await TrainerGroup.spawn(system, trainer_config, name="exact")  # 2 ranks, from the config
            per_rank = await group.ask_all(TrainStep(samples=samples, data_cursor=1), 60.0)
            await group.stop()
        metrics = per_rank[0]
        assert metrics.num_trained_tokens == len(PROMPT_LENGTHS) * NEW_TOKENS
        assert metrics.logprob_abs_diff == 0.0 and metrics.rollout_kl_k3 == 0.0, metrics

    scenario(main, TIMEOUT_S)
