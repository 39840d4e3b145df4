"""What the engine-device tests share (tests/unit/test_engine_device.py, tests/gpu/test_engine_cuda.py):
a mixed workload, its outputs as plain values, and a recorder of the tensors a step makes."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from miles_async.engine import compute
from miles_async.engine.core import Engine
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams

# torch functions that make a tensor from nothing (or from Python data): each must say its device
FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
                       torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
                       torch.linspace})


def mixed_workload(vocab_size: int, *, moe: bool, count: int = 9, max_new_tokens: int = 12) -> list[GenerateRequest]:
    """Prompts of growing lengths, greedy, seeded and unseeded sampling with top-k/top-p, prompt
    log-probs and top-k lists, routed experts for MoE; the last request (greedy) repeats the prefix of
    an earlier one, so that the prefix cache serves it when it comes after them (`run_workload`)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab_size, (5 + 7 * i,), generator=gen).tolist() for i in range(count)]
    kinds = [SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=max_new_tokens, ignore_eos=True,
                            sampling_seed=100),
             SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)]
    requests = [GenerateRequest(input_ids=p, sampling_params=kinds[i % 3], return_logprob=True,
                                logprob_start_len=2 if i % 2 else -1, top_logprobs_num=3 if i % 4 == 1 else 0,
                                return_routed_experts=moe)
                for i, p in enumerate(prompts)]
    return [*requests, GenerateRequest(input_ids=prompts[-1][:-2] + [4, 5], sampling_params=kinds[0],
                                       return_logprob=True, return_routed_experts=moe)]


async def run_workload(engine: Engine, requests: list[GenerateRequest]) -> list[dict[str, Any]]:
    """Every request's outputs as Python values (routed experts as nested lists), in request order:
    all but the last at once, then the last (`mixed_workload`'s prefix-cache hit)."""
    outs = await asyncio.gather(*(engine.generate(r) for r in requests[:-1]))
    outs.append(await engine.generate(requests[-1]))
    results = []
    for out in outs:
        experts = out.routed_experts_TLk
        assert experts is None or experts.device.type == "cpu", "results come back on the host"
        results.append({"output_ids": out.output_ids, "output_logprobs": out.output_token_logprobs,
                        "input_logprobs": out.input_token_logprobs, "input_top": out.input_top_logprobs,
                        "output_top": out.output_top_logprobs,
                        "experts": None if experts is None else experts.tolist()})
    return results


class FactoryDevices(TorchFunctionMode):
    """Records the `device` argument of every tensor factory called while active (None: not given).

    Torch function modes are per thread: `on_compute_thread()` enters it on the engine's compute
    thread, where every step runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and "out" not in kwargs:
            self.calls.append((func.__name__, kwargs.get("device")))
        return func(*args, **kwargs)

    def enter_on_compute_thread(self) -> None:
        compute.run_sync(self.__enter__)

    def exit_on_compute_thread(self) -> None:
        compute.run_sync(self.__exit__, None, None, None)


def engine_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """The tensors an engine holds between steps: weights, KV blocks, routed-expert slots, gather buffers."""
    tensors: dict[str, torch.Tensor] = {f"weight {name}": t for name, t in engine.weights.live.items()}
    for i, (k, v) in enumerate(zip(engine.cache.k_blocks, engine.cache.v_blocks)):
        tensors[f"k_blocks[{i}]"], tensors[f"v_blocks[{i}]"] = k, v
    if engine.cache.expert_slots_TLk is not None:
        tensors["expert_slots_TLk"] = engine.cache.expert_slots_TLk
    for i, buffer in enumerate(engine.runner.workspace._buffers):
        if buffer is not None:
            tensors[f"gather buffer {i}"] = buffer
    return tensors
