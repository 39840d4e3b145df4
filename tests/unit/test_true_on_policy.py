"""True on-policy mode: the engine's sampled log-probs equal the trainer's bit for bit.

The real engine generates several requests at once (sampled at temperature 1, one greedy;
prompts of different lengths, so decode batches and prefill chunks differ from step to step; two
share a prefix another request left in the prefix cache); the trainer side scores the same tokens with one packed forward (all samples
in one row, positions restarting at 0), as the trainer does. In batch-invariant mode the
log-probs are equal (mismatch exactly 0.0); in the default mode they differ a little.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from miles_async.kernels import batch_invariant
from miles_async.models import init_model, load_pretrained
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import Trainer
from miles_async.trajectory import TokenData, Trajectory

TIMEOUT_S = 60
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny dense model with its matrices drawn at std 0.3, so that its distributions are far
    from uniform and sampled tokens vary."""
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0, init_std=0.3)


def sample(tokens: list[int], mask: list[int], logprobs: list[float]) -> Trajectory:
    """A trajectory with its arrays inline, its metadata from the mask."""
    num_generated = sum(mask)
    return Trajectory(num_tokens=len(tokens), num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated,
                      data=TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs))


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab_size, (40,), generator=gen).tolist()
    own = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (3, 70, 21, 9, 130)]
    # Two continue the shared prefix (cache hits once the first has run), three stand alone.
    return [shared + own[0], own[1], shared + own[2], own[3], own[4]]


async def generate_all(engine: Engine, all_prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    def request(i: int, prompt: list[int]) -> GenerateRequest:
        # One greedy request: its log-prob is under the model's own distribution, as at temperature 1.
        params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, temperature=0.0 if i == 3 else 1.0,
                                ignore_eos=True, sampling_seed=i)
        return GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True)

    async with engine:
        first = await engine.generate(request(0, all_prompts[0]))  # leaves the shared prefix cached
        rest = await asyncio.gather(*(engine.generate(request(i, p)) for i, p in enumerate(all_prompts) if i))
        assert sum(out.cached_tokens for out in rest) >= 32, "the shared prefix should hit the cache"
    return [(out.output_ids, out.output_token_logprobs) for out in (first, *rest)]


def trainer_logprobs(model, all_prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """One packed row of every prompt + output, scored in a single forward (grad on, as in training)."""
    seqs = [prompt + out for prompt, out in zip(all_prompts, outputs)]
    ids_1T = torch.tensor([[t for s in seqs for t in s[:-1]]])
    positions_1T = torch.tensor([[p for s in seqs for p in range(len(s) - 1)]])
    targets_T = torch.tensor([t for s in seqs for t in s[1:]])
    logp_T = batch_invariant.token_logprobs(model(ids_1T, positions_1T)[0], targets_T)
    result, offset = [], 0
    for prompt, seq in zip(all_prompts, seqs):
        result.append(logp_T[offset + len(prompt) - 1: offset + len(seq) - 1].detach())
        offset += len(seq) - 1
    return result


def rollouts(model_dir, mode: bool) -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    engine = Engine(load_pretrained(model_dir),
                    config=EngineConfig(batch_invariant=mode, kv_cache_mib=4, max_prefill_tokens=48))
    all_prompts = prompts(engine.vocab_size)
    return all_prompts, asyncio.run(asyncio.wait_for(generate_all(engine, all_prompts), TIMEOUT_S))


def mismatch(model_dir, mode: bool) -> float:
    all_prompts, results = rollouts(model_dir, mode)
    trainer = load_pretrained(model_dir)
    trainer.set_batch_invariant(mode)
    scored = trainer_logprobs(trainer, all_prompts, [ids for ids, _ in results])
    worst = 0.0
    for (ids, engine_logprobs), trainer_logp in zip(results, scored):
        assert len(ids) == NUM_NEW_TOKENS
        engine_logp = torch.tensor(engine_logprobs, dtype=torch.float32)
        if mode:
            assert torch.equal(engine_logp, trainer_logp)
        worst = max(worst, float((engine_logp - trainer_logp).abs().max()))
    return worst


def test_true_on_policy_mode_matches_the_engine_bit_for_bit(model_dir):
    assert mismatch(model_dir, True) == 0.0


def test_default_mode_mismatch_is_small_but_not_zero(model_dir):
    worst = mismatch(model_dir, False)
    assert 0.0 < worst < 1e-3, worst


def test_the_trainer_step_reads_a_mismatch_of_exactly_zero(model_dir):
    """The real Trainer (FSDP2 on one gloo rank, packed micro-batches) in true on-policy mode."""
    all_prompts, results = rollouts(model_dir, True)
    samples = [sample(prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + list(logps))
               for prompt, (ids, logps) in zip(all_prompts, results)]
    metrics = {}
    with single_process_group("gloo", timeout_s=30) as device:
        for mode in (True, False):
            config = TrainerConfig(model_dir=str(model_dir), micro_batch_tokens=256, batch_invariant=mode)
            plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
            assert plan.num_micro_batches > 1  # packed rows of several samples, cut by the token budget
            metrics[mode] = Trainer(config, device).train_step(
                samples, [1.0] * len(samples), num_micro_batches=plan.num_micro_batches, denominator=plan.denominator)
    assert metrics[True].logprob_abs_diff == 0.0 and metrics[True].rollout_kl_k3 == 0.0
    assert 0.0 < metrics[False].logprob_abs_diff < 1e-3


def test_with_lora_adapters_the_engine_and_trainer_still_agree_bit_for_bit(model_dir, tmp_path):
    """Adapters trained a step, exported alone, written into an engine that holds the base (the
    checksums of what it holds equal the trainer's), merged there; in batch-invariant mode the
    trainer's merged forward reads the engine's log-probs with a mismatch of exactly 0.0."""
    from safetensors.torch import load_file

    from miles_async.models.lora import LoraConfig
    from miles_async.transport.verify import checksums

    lora = LoraConfig(rank=4, alpha=8.0)
    with single_process_group("gloo", timeout_s=30) as device:
        config = TrainerConfig(model_dir=str(model_dir), micro_batch_tokens=256, batch_invariant=True, lora=lora,
                               lr=1e-2)
        trainer = Trainer(config, device)
        warm = [sample(list(range(5, 15)), [0] * 6 + [1] * 4, [0.0] * 6 + [-3.0] * 4)] * 2
        for _ in range(2):  # B moves off zero, then A: the adapters change the model
            trainer.train_step(warm, [1.0, -1.0], num_micro_batches=1, denominator=8.0)
        pushed = {n: t for b in trainer.export_weights(tmp_path / "v1", 1 << 20) for n, t in load_file(b.path).items()}
        assert pushed and all(n.endswith(("lora_A", "lora_B")) for n in pushed)
        engine = Engine(load_pretrained(model_dir),
                        config=EngineConfig(batch_invariant=True, kv_cache_mib=4, max_prefill_tokens=48, lora=lora))
        all_prompts = prompts(engine.vocab_size)

        async def push_and_generate():
            label = await engine.weights.update_from_tensors(pushed, weight_version=1)
            assert label == "1" and await engine.weights.checksums() == checksums(pushed)  # the adapters, exactly
            return await generate_all(engine, all_prompts)

        results = asyncio.run(asyncio.wait_for(push_and_generate(), TIMEOUT_S))
        base_engine = Engine(load_pretrained(model_dir), config=EngineConfig(batch_invariant=True, kv_cache_mib=4,
                                                                            max_prefill_tokens=48))
        base = asyncio.run(asyncio.wait_for(generate_all(base_engine, all_prompts), TIMEOUT_S))
        assert [lp for _, lp in results] != [lp for _, lp in base]  # the adapters are served
        samples = [sample(prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + list(logps))
                   for prompt, (ids, logps) in zip(all_prompts, results)]
        plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
        metrics = trainer.train_step(samples, [1.0] * len(samples), num_micro_batches=plan.num_micro_batches,
                                     denominator=plan.denominator)
    assert metrics.logprob_abs_diff == 0.0 and metrics.rollout_kl_k3 == 0.0
