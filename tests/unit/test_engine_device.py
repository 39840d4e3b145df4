"""The embedded engine's device (`EngineConfig.device`), on the CPU: the setting's validation and its
errors without CUDA, outputs unchanged by an explicit "cpu", every tensor a step makes placed on the
engine's device, and a one-node run handing GPUs out only for engines on CUDA. The engine on a GPU
itself: tests/gpu/test_engine_cuda.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from _support_engine import FactoryDevices, engine_tensors, mixed_workload, run_workload

from miles_async.actors.fleet import Fleet, Node, RunFolder, one_node_gpus, resolve_transport
from miles_async.actors.recipe import load_recipe
from miles_async.engine.core import Engine, EngineConfig, resolve_device
from miles_async.models import init_model, load_pretrained

TIMEOUT_S = 60


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {family: init_model(family, "tiny", tmp_path_factory.mktemp(family), seed=0, init_std=0.3)
            for family in ("qwen3", "qwen3_moe")}


def small(**fields) -> EngineConfig:
    return EngineConfig(kv_cache_mib=2, block_size=4, max_seq_len=128, max_prefill_tokens=32, **fields)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """What resolve_device asks of torch.cuda, as on a machine with two GPUs whose current one is 1
    (nothing here touches a GPU: the tests stop before any tensor would go there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:0:1", "mps", ""])
def test_a_device_that_is_not_cpu_cuda_or_auto_is_refused(device):
    with pytest.raises(ValueError, match="EngineConfig.device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        EngineConfig(device=device)
    with pytest.raises(ValueError, match="EngineConfig.device must be"):
        load_recipe(None, [f'rollout.engine.device="{device}"'])
    with pytest.raises(ValueError, match="EngineConfig.device must be"):
        resolve_device(device)


def test_shared_memory_weights_are_refused_with_a_gpu(two_gpus, model_dirs):
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="shared_weights keeps the weights in CPU shared memory"):
            EngineConfig(device=device, shared_weights=True)
        with pytest.raises(ValueError, match="shared_weights"):  # as the run sets it for weights.transport = "shm"
            msgspec.structs.replace(EngineConfig(device=device), shared_weights=True)
    # "auto" is known only where the engine runs: refused there, once it resolves to a GPU
    with pytest.raises(ValueError, match=r"device is 'auto \(here cuda:1\)'"):
        Engine(load_pretrained(model_dirs["qwen3"]), config=small(device="auto", shared_weights=True))
    with pytest.raises(ValueError, match='weights.transport = "shm" keeps the engines\' weights in CPU shared'):
        load_recipe(None, ["rollout.engine.device=cuda", "weights.transport=shm"])


def test_cuda_without_cuda_says_why_before_loading_anything(no_cuda, model_dirs):
    assert resolve_device("auto") == torch.device("cpu")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"EngineConfig.device = '{device}', but this process cannot use CUDA"):
            resolve_device(device)
        with pytest.raises(ValueError, match="cannot use CUDA.*Use device 'cpu', or 'auto'"):
            Engine.from_pretrained(model_dirs["qwen3"], config=small(device=device))
        with pytest.raises(ValueError, match="cannot use CUDA"):
            Engine(load_pretrained(model_dirs["qwen3"]), config=small(device=device))


def test_cuda_and_auto_resolve_to_the_current_gpu_and_a_missing_index_is_named(two_gpus):
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"'cuda:2', but this process sees 2 GPU\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


def test_nccl_weights_to_an_engine_on_the_cpu_are_refused_by_the_recipe():
    with pytest.raises(ValueError, match='weights.backend = "nccl" moves GPU memory only, but rollout.engine.device'):
        load_recipe(None, ["weights.transport=broadcast", "weights.backend=nccl"])
    assert load_recipe(None, ["weights.transport=broadcast", "weights.backend=nccl",
                              "rollout.engine.device=cuda"]).rollout.engine.device == "cuda"
    assert load_recipe(None).rollout.engine.device == "cpu"


@pytest.mark.parametrize(("device", "transport"), [("cpu", "shm"), ("cuda", "stream"), ("auto", "stream")])
def test_auto_transport_leaves_shared_memory_to_engines_on_the_cpu(device, transport):
    config = load_recipe(None, [f"rollout.engine.device={device}", "weights.transport=auto"])
    assert resolve_transport(config) == transport


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_explicit_cpu_device_gives_the_same_outputs_as_the_default(no_cuda, model_dirs, family):
    model_dir = model_dirs[family]

    async def outputs(config: EngineConfig):
        engine = Engine.from_pretrained(model_dir, config=config)
        assert engine.device == torch.device("cpu") and engine.config.device == "cpu"
        async with engine:
            return await run_workload(engine, mixed_workload(engine.vocab_size, moe=family == "qwen3_moe"))

    default = run(outputs(small()))
    assert run(outputs(small(device="cpu"))) == default
    assert run(outputs(small(device="auto"))) == default  # no GPU here: "auto" is the CPU


# with speculative decoding (slow: ~20 s): the drafts and their verdicts too
@pytest.mark.parametrize("speculative", [0, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fused", [False, True])  # the gathered attention path (a GPU's), and the CPU kernels'
def test_every_tensor_a_step_makes_is_made_on_the_engines_device(model_dirs, fused, speculative):
    """A tensor factory without a device makes a CPU tensor, which on a GPU engine is a host tensor
    in a device computation (an error, or a copy per step): every one the steps call says its device,
    and it is the engine's. Mixed steps: prefill chunks, decodes, a prefix-cache hit, greedy, seeded
    and shared sampling, top-k/top-p, prompt log-probs, top-k lists and routed experts."""
    for family in ("qwen3", "qwen3_moe"):
        engine = Engine.from_pretrained(model_dirs[family], config=small(device="cpu", fused_cpu_kernels=fused,
                                                                         speculative_tokens=speculative,
                                                                         speculative_adaptive=False))
        recorder = FactoryDevices()

        async def scenario(engine=engine, recorder=recorder, moe=family == "qwen3_moe"):
            async with engine:
                recorder.enter_on_compute_thread()
                try:
                    await run_workload(engine, mixed_workload(engine.vocab_size, moe=moe))
                finally:
                    recorder.exit_on_compute_thread()

        run(scenario())
        assert engine.stats().num_cached_prompt_tokens > 0, "the workload must hit the prefix cache"
        assert len(recorder.calls) > 100, "the recorder must see the steps"
        undeviced = sorted({name for name, device in recorder.calls if device is None})
        assert not undeviced, f"{family}: tensor factories called without a device in a step: {undeviced}"
        assert {torch.device(device) for _, device in recorder.calls} == {engine.device}
        placed = {name: t.device for name, t in engine_tensors(engine).items()}
        # the fused kernel reads the blocks in place: no gather buffer
        assert ("gather buffer 0" in placed) == (not engine.runner.fused)
        assert ("expert_slots_TLk" in placed) == (family == "qwen3_moe")
        assert set(placed.values()) == {engine.device}, placed
        assert engine.runner.shared_generator.device == engine.device
        assert (engine.stats().num_draft_tokens > 0) == bool(speculative)


def test_a_one_node_run_hands_out_gpus_only_to_engines_on_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cpu = load_recipe(None)
    assert one_node_gpus(cpu) == 0  # CPU runs unchanged: no CUDA_VISIBLE_DEVICES for anyone
    assert one_node_gpus(load_recipe(None, ["rollout.engine.device=cuda:1", "weights.transport=stream"])) == 0
    assert one_node_gpus(load_recipe(None, ["rollout.engine.device=auto"])) == 4
    config = load_recipe(None, ["rollout.engine.device=cuda", "rollout.num_engines=2", "trainer.world_size=2",
                                "weights.transport=broadcast"])
    assert one_node_gpus(config) == 4
    node = Node(rank=0, host="127.0.0.1", spawner=None, num_gpus=one_node_gpus(config))
    fleet = Fleet(config, RunFolder(run_dir=tmp_path, model_dir=tmp_path, shared_token="t"), None, {0: node})
    # trainer ranks 0 and 1 use GPUs 0 and 1 (LOCAL_RANK); each engine gets one of the others
    assert [fleet._gpu_env(node) for _ in range(2)] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert one_node_gpus(config) == 0  # no GPU on this machine: the engines fail with resolve_device's reason
