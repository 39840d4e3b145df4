"""Engine memory release (SGLang's /release_memory_occupation, /resume_memory_occupation): the
weights' and KV cache's memory really goes back to the system (the process's RSS, measured) and
comes back on resume; released weights return empty, so the engine serves again only after a push."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from miles_async.engine.core import WeightsUnavailableError
from miles_async.models import init_model
from miles_async.models.lora import LoraConfig

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
KV_MIB = 128


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return init_model("qwen3", "small", tmp_path_factory.mktemp("small"), seed=0)


def test_released_memory_leaves_the_process_and_comes_back_on_resume(folder) -> None:
    async def main():
        engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=KV_MIB, double_buffer=True))
        async with engine:
            request = GenerateRequest(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)
            before = (await engine.generate(request)).output_ids
            weights_mib = engine.weights.nbytes / 2**20
            held = rss_mib()
            await engine.release_memory_occupation()
            released = rss_mib()
            with pytest.raises(WeightsUnavailableError, match="released"):
                engine.submit(request)
            start = time.perf_counter()
            await engine.resume_memory_occupation()
            resume_s = time.perf_counter() - start
            resumed = rss_mib()
            with pytest.raises(WeightsUnavailableError, match="push a complete version"):
                engine.submit(request)  # zeros are not served
            await engine.weights.update_from_disk(str(folder), weight_version=1)
            after = (await engine.generate(request)).output_ids
            return before, after, weights_mib, held, released, resumed, resume_s

    before, after, weights_mib, held, released, resumed, resume_s = asyncio.run(asyncio.wait_for(main(), 120))
    print(f"RSS {held:.0f} MiB -> released {released:.0f} -> resumed {resumed:.0f} (KV {KV_MIB} MiB, weights "
          f"{weights_mib:.1f} MiB twice); resume {resume_s * 1000:.1f} ms")
    given_back = KV_MIB + 2 * weights_mib  # the KV blocks, the weights and their spare buffer
    assert held - released > 0.8 * given_back
    assert resumed - released > 0.8 * KV_MIB  # the KV cache taken again (zeros: its pages are touched)
    assert after == before  # the pushed version serves as before


def test_release_refuses_what_it_cannot_give_back(folder, tmp_path) -> None:
    async def main():
        engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=8, max_seq_len=2048))
        async with engine:
            state = engine.submit(GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(
                max_new_tokens=1500, ignore_eos=True)))
            with pytest.raises(ValueError, match="requests are in flight: release needs an idle engine"):
                await engine.release_memory_occupation(["kv_cache"])
            await engine.pause("abort")
            await state.done.wait()
            with pytest.raises(ValueError, match="memory tags must be among"):
                await engine.release_memory_occupation(["cuda_graph"])
            await engine.release_memory_occupation(["kv_cache"])  # the weights stay: only the KV cache comes back
            await engine.resume_memory_occupation(["kv_cache"])
            await engine.resume()
            return (await engine.generate(GenerateRequest(input_ids=[1, 2, 3], sampling_params=GREEDY))).output_ids

        lora = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=8, max_seq_len=2048, lora=LoraConfig(rank=4)))
        async with lora:
            with pytest.raises(ValueError, match="LoRA engine's base weights"):
                await lora.release_memory_occupation(["weights"])
        shared = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=8, max_seq_len=2048, shared_weights=True))
        async with shared:
            with pytest.raises(ValueError, match="shared-memory segment"):
                await shared.release_memory_occupation(["weights"])
        shared.weights.close()

    assert len(asyncio.run(asyncio.wait_for(main(), 120))) == 6
