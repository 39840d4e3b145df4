"""R3 (rollout routing replay): the trainer routes every token through the experts the engine used.

The engine side is the real `Engine` running the tiny Qwen3-MoE in bfloat16; it samples
completions and returns, per token, the experts its router chose, which travel as SGLang's wire
form (base64 int32, `encode_routed_experts` / `decode_routed_experts`) into the trajectory's `TokenData` (compacted to uint8 ids).
The trainer side runs the same weights in float32, both as the plain model and as the real
`Trainer` (FSDP2 on one gloo rank, packed micro-batches, chunked log-probs). bfloat16 against
float32 moves the router's logits a little, which is enough to flip the top-k choice of a few
tokens whose second and third experts are close; a flip at layer 0 also changes what later
tokens attend to. Without replay the trainer's experts differ from the engine's for those
tokens; with replay they match 100% and the log-prob gap to the engine shrinks.

Run `pytest -s tests/unit/test_fidelity_r3.py` to see the measured numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams, decode_routed_experts
from miles_async.engine.server import encode_routed_experts
from miles_async.models import init_model, load_pretrained
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.packing import plan_step
from miles_async.trainer.step import StepMetrics, Trainer
from miles_async.trajectory import TokenData, Trajectory

TIMEOUT_S = 120
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 12, 48


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("r3") / "moe")


def sample(tokens: list[int], mask: list[int], logprobs: list[float],
           routed_experts: torch.Tensor | None = None) -> Trajectory:
    """A trajectory with its arrays inline; `routed_experts` [rows, MoE layers, top_k]."""
    data = TokenData.build(tokens=tokens, loss_mask=mask, logprobs=logprobs,
                           routed_experts=None if routed_experts is None else routed_experts.numpy())
    num_generated = sum(mask)
    return Trajectory(num_tokens=len(tokens), num_prompt_tokens=mask.index(1) if num_generated else len(tokens),
                      num_generated_tokens=num_generated, data=data)


def arrays(s: Trajectory) -> TokenData:
    assert isinstance(s.data, TokenData)
    return s.data


def train_step(trainer: Trainer, samples: list[Trajectory]) -> StepMetrics:
    """One step of this one rank, every sample at advantage 1."""
    config = trainer.config
    plan = plan_step(samples, 1, config.micro_batch_tokens, config.policy_loss.aggregation, None)
    return trainer.train_step(samples, [1.0] * len(samples), num_micro_batches=plan.num_micro_batches,
                              denominator=plan.denominator)


@pytest.fixture(scope="module")
def rollouts(moe_dir: Path) -> list[Trajectory]:
    """Completions sampled by the bfloat16 engine, with its log-probs and routed experts."""
    engine = Engine.from_pretrained(str(moe_dir), config=EngineConfig(kv_cache_mib=8), dtype=torch.bfloat16)
    config = engine.model.config
    num_layers, top_k = len(config.moe_layer_indices), config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (PROMPT_LEN,), generator=gen).tolist() for _ in range(NUM_PROMPTS)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=i)
              for i in range(NUM_PROMPTS)]

    async def generate() -> list:
        async with engine:
            return list(await asyncio.gather(*(
                engine.generate(GenerateRequest(input_ids=prompt, sampling_params=p, return_logprob=True,
                                                return_routed_experts=True))
                for prompt, p in zip(prompts, params))))

    outputs = asyncio.run(asyncio.wait_for(generate(), TIMEOUT_S))
    samples = []
    for prompt, out in zip(prompts, outputs):
        wire = encode_routed_experts(out.routed_experts_TLk)  # what SGLang's meta_info carries
        experts_TLk = decode_routed_experts(wire, num_layers, top_k)
        assert experts_TLk.shape == (len(prompt) + len(out.output_ids) - 1, num_layers, top_k)
        samples.append(sample(prompt + out.output_ids, [0] * len(prompt) + [1] * len(out.output_ids),
                              [0.0] * len(prompt) + list(out.output_token_logprobs), routed_experts=experts_TLk))
        stored = arrays(samples[-1]).experts()
        assert stored is not None and stored.dtype.itemsize == 1  # 8 experts: one byte per id, not SGLang's 4
        assert torch.equal(torch.from_numpy(stored.astype("int32")), experts_TLk)
    return samples


def engine_experts(sample: Trajectory) -> torch.Tensor:
    """The engine's experts as the model takes them: [MoE layers, 1, tokens - 1, top_k]."""
    experts_RLk = arrays(sample).experts()
    assert experts_RLk is not None
    return torch.from_numpy(experts_RLk.astype("int64")).permute(1, 0, 2).unsqueeze(1)


def fp32_side(moe_dir: Path, samples: list[Trajectory], replay: bool) -> tuple[float, float, float]:
    """(decisions with the engine's expert set, expert slots in common, mean |trainer - engine logp|)."""
    model = load_pretrained(moe_dir)
    top_k = model.config.num_experts_per_tok
    same_sets, common, decisions, gaps = 0, 0, 0, []
    with torch.no_grad():
        for s in samples:
            given_L1Tk = engine_experts(s)
            tokens_T = torch.from_numpy(arrays(s).token_ids().astype("int64"))
            ids_1T = tokens_T[None, :-1]
            logits_1TV, used_L1Tk = model(ids_1T, routed_experts=given_L1Tk if replay else None,
                                          return_routed_experts=True)
            engine_sorted, used_sorted = given_L1Tk.sort(-1).values, used_L1Tk.sort(-1).values
            same_sets += int((engine_sorted == used_sorted).all(-1).sum())
            common += int((used_L1Tk[..., :, None] == given_L1Tk[..., None, :]).any(-1).sum())
            decisions += given_L1Tk[..., 0].numel()
            logp_T = torch.log_softmax(logits_1TV[0].float(), -1).gather(-1, tokens_T[1:, None])[:, 0]
            mask_T = torch.from_numpy(arrays(s).mask()[1:] > 0)
            gaps.append((logp_T - torch.from_numpy(arrays(s).logprob_array()[1:].copy()))[mask_T])
    return same_sets / decisions, common / (decisions * top_k), float(torch.cat(gaps).abs().mean())


@pytest.fixture(scope="module")
def one_rank() -> Iterator[torch.device]:
    with single_process_group("gloo", timeout_s=30) as device:
        yield device


def test_replay_makes_the_float32_trainer_route_as_the_bfloat16_engine(
        moe_dir: Path, rollouts: list[Trajectory], one_rank: torch.device) -> None:
    free_sets, free_slots, free_gap = fp32_side(moe_dir, rollouts, replay=False)
    replay_sets, replay_slots, replay_gap = fp32_side(moe_dir, rollouts, replay=True)
    # The real trainer step: its first step's metrics are at the weights the engine sampled with.
    config = TrainerConfig(model_dir=str(moe_dir), micro_batch_tokens=128)
    bare = [msgspec.structs.replace(s, data=msgspec.structs.replace(arrays(s), routed_experts=b"", experts_dtype="",
                                                                    experts_shape=(0, 0))) for s in rollouts]
    step_free = train_step(Trainer(config, one_rank), bare)
    step_replay = train_step(Trainer(config, one_rank), rollouts)
    print(f"\nR3, bf16 engine vs fp32 trainer, {len(rollouts)} completions x {NEW_TOKENS} tokens "
          f"(+ {PROMPT_LEN}-token prompts), tiny qwen3_moe (8 experts, top 2, 2 MoE layers):\n"
          f"  routing decisions with the engine's expert set: without replay {free_sets:.2%}, "
          f"with replay {replay_sets:.2%} (expert slots in common: {free_slots:.2%} / {replay_slots:.2%})\n"
          f"  mean |trainer logp - engine logp| (plain fp32 model): without replay {free_gap:.3e}, "
          f"with replay {replay_gap:.3e}\n"
          f"  the same from Trainer.train_step's metric: without replay {step_free.logprob_abs_diff:.3e}, "
          f"with replay {step_replay.logprob_abs_diff:.3e} "
          f"(rollout k3 KL {step_free.rollout_kl_k3:.3e} -> {step_replay.rollout_kl_k3:.3e})")
    assert free_sets < 1.0, "bf16 flipped no routing choice; the test needs a stronger perturbation"
    assert replay_sets == replay_slots == 1.0
    assert replay_gap < free_gap
    assert step_replay.logprob_abs_diff < step_free.logprob_abs_diff
    # the trainer's step (packing, FSDP, chunked log-probs) scores the tokens as the plain model does
    assert step_free.logprob_abs_diff == pytest.approx(free_gap, rel=1e-3)
    assert step_replay.logprob_abs_diff == pytest.approx(replay_gap, rel=1e-3)
