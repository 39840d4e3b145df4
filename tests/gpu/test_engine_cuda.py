"""The embedded engine on CUDA (`EngineConfig.device = "cuda"`), alone, in process: its greedy tokens
equal the CPU engine's and its log-probs are close, every tensor a step makes is on the GPU while
results come back on the host, seeded sampling repeats itself, host weights copy into its GPU
weights (both buffering modes, and from a gloo broadcast), and the KV cache's routed experts come
back as the CPU engine's.

GPU only: skipped, with the reason, where no CUDA GPU (or no NCCL) is available. The CPU side of
the same checks: tests/unit/test_engine_device.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from _support_gpu import cuda_nccl_skip_reason

from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.weights import GroupReceiver
from miles_async.models import init_model, load_pretrained
from miles_async.transport.groups import WeightGroup
from miles_async.transport.verify import checksums

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the workload, shared with the CPU tests
from _support_engine import FactoryDevices, engine_tensors, mixed_workload, run_workload

pytestmark = pytest.mark.skipif(cuda_nccl_skip_reason() is not None, reason=str(cuda_nccl_skip_reason()))

TIMEOUT_S = 120
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
# fp32 on both devices: only the kernels' rounding differs (TF32 is off for matmuls by default)
LOGPROB_ATOL = 1e-3


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: init_model(family, "tiny", tmp_path_factory.mktemp(name), seed=seed, init_std=0.3)
            for name, family, seed in (("dense", "qwen3", 0), ("dense-new", "qwen3", 1), ("moe", "qwen3_moe", 0))}


def small(device: str, **fields) -> EngineConfig:
    return EngineConfig(kv_cache_mib=8, block_size=4, max_seq_len=128, max_prefill_tokens=32, device=device, **fields)


def greedy_workload(vocab_size: int, moe: bool) -> list[GenerateRequest]:
    return [msgspec.structs.replace(r, sampling_params=GREEDY) for r in mixed_workload(vocab_size, moe=moe)]


async def outputs_on(device: str, model_dir: Path, requests_of, **fields):
    engine = Engine.from_pretrained(str(model_dir), config=small(device, **fields))
    async with engine:
        return engine, await run_workload(engine, requests_of(engine))


def assert_close_outputs(cuda_outs, cpu_outs) -> None:
    for cuda, cpu in zip(cuda_outs, cpu_outs, strict=True):
        assert cuda["output_ids"] == cpu["output_ids"]
        assert max(abs(a - b) for a, b in zip(cuda["output_logprobs"], cpu["output_logprobs"])) < LOGPROB_ATOL
        scored = [(a, b) for (a, _), (b, _) in zip(cuda["input_logprobs"] or [], cpu["input_logprobs"] or [])
                  if a is not None]
        assert all(abs(a - b) < LOGPROB_ATOL for a, b in scored)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_tokens_equal_the_cpu_engines_and_log_probs_are_close(model_dirs, name):
    moe = name == "moe"
    engine, cuda_outs = run(outputs_on("cuda", model_dirs[name], lambda e: greedy_workload(e.vocab_size, moe)))
    _, cpu_outs = run(outputs_on("cpu", model_dirs[name], lambda e: greedy_workload(e.vocab_size, moe)))
    assert engine.device.type == "cuda" and engine.config.device == str(engine.device)
    assert engine.stats().num_cached_prompt_tokens > 0  # the prefix cache served a request on the GPU too
    assert_close_outputs(cuda_outs, cpu_outs)
    if moe:  # the experts of every token, read from the GPU's slots: the CPU engine's (as sets per layer)
        for cuda, cpu in zip(cuda_outs, cpu_outs):
            a, b = torch.tensor(cuda["experts"]).sort(-1).values, torch.tensor(cpu["experts"]).sort(-1).values
            assert a.shape == b.shape and (a == b).float().mean() > 0.99


def test_every_tensor_of_a_step_is_on_the_gpu_and_seeded_sampling_repeats(model_dirs):
    async def scenario(recorded: bool):
        engine = Engine.from_pretrained(str(model_dirs["moe"]), config=small("cuda"))
        recorder = FactoryDevices()
        async with engine:
            if recorded:
                recorder.enter_on_compute_thread()
            try:
                outs = await run_workload(engine, mixed_workload(engine.vocab_size, moe=True))
            finally:
                if recorded:
                    recorder.exit_on_compute_thread()
        return engine, recorder, outs

    engine, recorder, first = run(scenario(recorded=True))
    _, _, second = run(scenario(recorded=False))
    assert recorder.calls and {torch.device(d) if d is not None else None for _, d in recorder.calls} == {engine.device}
    assert {t.device for t in engine_tensors(engine).values()} == {engine.device}
    assert engine.runner.shared_generator.device == engine.device
    seeded = [i for i, r in enumerate(mixed_workload(engine.vocab_size, moe=True))
              if r.sampling_params.sampling_seed is not None]
    assert seeded and all(first[i]["output_ids"] == second[i]["output_ids"] for i in seeded)
    assert all(isinstance(t, int) for out in first for t in out["output_ids"])


@pytest.mark.parametrize("double_buffer", [False, True])
def test_host_weights_copy_into_the_gpu_weights(model_dirs, double_buffer):
    new_state = {n: t.detach().clone() for n, t in load_pretrained(model_dirs["dense-new"]).state_dict().items()}
    prompt = [5, 9, 13, 17, 21, 25, 29]

    async def scenario():
        engine = Engine.from_pretrained(str(model_dirs["dense"]), config=small("cuda", double_buffer=double_buffer))
        async with engine:
            label = await engine.weights.update_from_tensors(new_state, weight_version="3")
            out = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=GREEDY, return_logprob=True))
            sums = await engine.weights.checksums()
        return engine, label, out, sums

    engine, label, out, sums = run(scenario())
    _, [reference] = run(outputs_on("cpu", model_dirs["dense-new"], lambda e: [
        GenerateRequest(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)]))
    assert label == "3" and {t.device for t in engine.weights.live.values()} == {engine.device}
    assert all(p.device == engine.device for p in engine.model.parameters())
    assert sums == {n: v for n, v in checksums(new_state).items() if n in sums}
    assert out.output_ids == reference["output_ids"]
    assert max(abs(a - b) for a, b in zip(out.output_token_logprobs, reference["output_logprobs"])) < LOGPROB_ATOL


def test_a_gloo_broadcast_lands_in_the_gpu_weights(model_dirs):
    """SGLang's distributed path (GroupReceiver): gloo moves host memory, the engine copies it in."""
    new_state = load_pretrained(model_dirs["dense-new"]).state_dict()
    items = list(new_state.items())
    prompt = [5, 9, 13, 17, 21, 25, 29]

    def broadcast_all(group: WeightGroup) -> None:
        for _, tensor in items:
            group.broadcast(tensor.contiguous(), src=0)

    async def scenario():
        engine = Engine.from_pretrained(str(model_dirs["dense"]), config=small("cuda", double_buffer=True))
        receiver = GroupReceiver(engine.weights, timeout_s=60)
        async with engine:
            store = WeightGroup.open_store("127.0.0.1", 2, 60.0)
            _, group = await asyncio.gather(
                receiver.init_group("127.0.0.1", store.port, 1, 2, "g", "gloo"),
                asyncio.to_thread(WeightGroup.join, "127.0.0.1", store.port, 0, 2, store=store, name="g", sglang=True))
            label, _ = await asyncio.gather(
                receiver.receive([n for n, _ in items], [str(t.dtype).removeprefix("torch.") for _, t in items],
                                 [list(t.shape) for _, t in items], "g", "4"),
                asyncio.to_thread(broadcast_all, group))
            out = await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=GREEDY))
            await receiver.close()
            group.close()
        return engine, label, out

    engine, label, out = run(scenario())
    cpu_model = load_pretrained(model_dirs["dense-new"])
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(cpu_model(torch.tensor([ids]))[0, -1].argmax()))
    assert label == "4" and {t.device for t in engine.weights.live.values()} == {engine.device}
    assert out.output_ids == ids[len(prompt):]
