"""Weight updates end to end over the real runtime: `WeightPusher` -> `EngineActor`s in their own
processes, for every transport that runs here, with the random-fill verification check, an
update interrupted by killing the pusher, and the trainer's exported files as the source.

Every scenario has a deadline; waits poll with one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import config, scenario

from miles_async.actors.engine import (
    BeginUpdate,
    EngineActor,
    EngineStatus,
    Generate,
    GetChecksums,
    ReleaseMemory,
    ResumeMemory,
)
from miles_async.actors.trainer import ExportWeights, TrainerGroup
from miles_async.actors.weights import PushWeights, WeightPusher, WeightSyncConfig
from miles_async.engine.core import EngineConfig
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.models import init_model, load_pretrained
from miles_async.runtime import ActorSystem, Message, RemoteError, handler
from miles_async.trainer.config import TrainerConfig
from miles_async.trajectory import TokenData, Trajectory
from miles_async.transport.shm import SharedWeights
from miles_async.transport.verify import checksums

TIMEOUT_S = 150.0
ASK_S = 60.0
PROMPT = [5, 9, 13, 17, 21]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [init_model("qwen3", "tiny", tmp_path_factory.mktemp(f"m{seed}"), seed=seed, init_std=0.3)
            for seed in range(4)]


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in load_pretrained(path).named_parameters()}


class Source:
    """The pusher's in-process source: the weights of the checkpoint named by `Pick` (picklable)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.index = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        return weights_of(Path(self.paths[self.index]))


class Pick(Message[None]):
    index: int


class Pid(Message[int]):
    """The process id of the actor's process."""


class TestPusher(WeightPusher):
    """Chooses its source checkpoint by message; `drop` makes its transport skip one tensor."""

    __test__ = False
    drop = ""
    hang_after_half = False

    @handler
    async def pick(self, msg: Pick) -> None:
        self.source.index = msg.index

    @handler(concurrent=True)
    async def pid(self, msg: Pid) -> int:
        return os.getpid()

    async def _move(self, version, converted, cast, expected, probe=None) -> None:
        if self.drop:
            converted = {n: t for n, t in converted.items() if n != self.drop}
            cast = {n: t for n, t in cast.items() if n != self.drop}
        if self.hang_after_half:  # begin, write half into the segment, then stall until killed
            states = await self._ask_all(BeginUpdate(version=version, lease_s=self.config.lease_s))
            handle = SharedWeights.attach(states[0].target_segment)
            handle._set_seq(handle.seq + 1)
            for name, tensor in list(cast.items())[: len(cast) // 2]:
                handle.tensors[name].copy_(tensor)
            await asyncio.Event().wait()
        await super()._move(version, converted, cast, expected, probe)


class DroppingPusher(TestPusher):
    drop = "model.layers.1.mlp.down_proj.weight"


class HangingPusher(TestPusher):
    hang_after_half = True


async def greedy(ref) -> tuple[list[int], int]:
    """The greedy output and the one weight version all its tokens were sampled under."""
    reply = await ref.ask(Generate(request=GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY)), timeout_s=ASK_S)
    assert len(reply.weight_versions) == 1 and reply.weight_versions[0].end == len(reply.output_ids)
    return reply.output_ids, reply.weight_versions[0].version


async def reference_outputs(system: ActorSystem, dirs: list[Path]) -> list[list[int]]:
    refs = [await system.spawn(EngineActor, f"ref{i}", args=(str(d), EngineConfig(kv_cache_mib=2, max_seq_len=64)))
            for i, d in enumerate(dirs)]
    outputs = [(await greedy(ref))[0] for ref in refs]
    for ref in refs:
        await system.stop(ref)
    return outputs


def engine_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(kv_cache_mib=2, max_seq_len=64, **overrides)


def test_every_transport_delivers_verified_versions_to_engines_in_other_processes(dirs, tmp_path):
    paths = [str(d) for d in dirs]

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            expected = await reference_outputs(system, dirs)
            engines = await asyncio.gather(*(system.spawn(
                EngineActor, f"engine{i}", process=True,
                args=(paths[0], engine_config(shared_weights=True, double_buffer=True))) for i in range(2)))
            assert [(await greedy(e))[0] for e in engines] == [expected[0]] * 2
            names = [e.name for e in engines]
            version = 0
            for transport, index in (("shm", 1), ("broadcast", 2), ("broadcast", 3), ("stream", 1), ("stream", 2),
                                     ("disk", 3), ("disk_delta", 1), ("disk_delta", 2)):
                cfg = WeightSyncConfig(family="qwen3", transport=transport, verify="always", bucket_mib=0.05,
                                       delta_dir=str(tmp_path / "deltas"), timeout_s=ASK_S)
                pusher = await system.spawn(TestPusher, f"pusher-{transport}-{version}",
                                            args=(names, cfg, Source(paths)))
                await pusher.ask(Pick(index=index), timeout_s=ASK_S)
                version += 1
                report = await pusher.ask(PushWeights(version=version), timeout_s=ASK_S)
                assert report.verified and report.num_bytes > 0 and report.bytes_per_s > 0
                assert [s.version for s in report.engines] == [version, version]
                for engine in engines:
                    assert await greedy(engine) == (expected[index], version), (transport, index)
                if transport != "disk_delta":  # the delta pusher keeps its base for the next push
                    await system.stop(pusher)
            with pytest.raises(RemoteError, match="not newer than the engine's"):
                await pusher.ask(PushWeights(version=version - 1), timeout_s=ASK_S)

    scenario(main, TIMEOUT_S)


def test_a_quantized_engine_gets_its_format_from_the_pusher_over_every_transport(dirs, tmp_path):
    """An engine serving int4 holds the format's tensors alone; the pusher quantizes each version
    once (from the trainer's fp32) and every transport moves those tensors: a push is the format's
    bytes, the random-fill check and the checksums pass, and the engine answers as an engine that
    loaded the version itself and quantized it."""
    paths = [str(d) for d in dirs]

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            refs = [await system.spawn(EngineActor, f"ref{i}", args=(d, engine_config(weight_format="int4")))
                    for i, d in enumerate(paths)]
            expected = [(await greedy(ref))[0] for ref in refs]
            quantized_bytes = (await refs[0].ask(EngineStatus(), timeout_s=ASK_S)).num_bytes
            for ref in refs:
                await system.stop(ref)
            engine = await system.spawn(EngineActor, "engine", process=True, args=(paths[0], engine_config(
                weight_format="int4", dequantize="blocks", shared_weights=True, double_buffer=True)))
            state = await engine.ask(EngineStatus(), timeout_s=ASK_S)
            assert state.weight_format == "int4" and state.num_bytes == quantized_bytes
            assert await greedy(engine) == (expected[0], 0)
            full_bytes = sum(t.numel() * t.element_size() for t in weights_of(dirs[0]).values())
            assert quantized_bytes < full_bytes / 2
            # the second and third disk_delta pushes are deltas between quantized versions (the first
            # is the whole version as a file: the pusher has no base yet)
            pushes = (("shm", 1), ("broadcast", 2), ("stream", 3), ("disk_delta", 1), ("disk_delta", 2),
                      ("disk_delta", 3))
            pushers: dict[str, Any] = {}
            for version, (transport, index) in enumerate(pushes, start=1):
                cfg = WeightSyncConfig(family="qwen3", transport=transport, verify="always", bucket_mib=0.05,
                                       delta_dir=str(tmp_path / "deltas"), timeout_s=ASK_S)
                if transport not in pushers:
                    pushers[transport] = await system.spawn(TestPusher, f"pusher-{transport}",
                                                            args=([engine.name], cfg, Source(paths)))
                await pushers[transport].ask(Pick(index=index), timeout_s=ASK_S)
                report = await pushers[transport].ask(PushWeights(version=version), timeout_s=ASK_S)
                assert report.verified and report.num_bytes == quantized_bytes, transport
                assert await greedy(engine) == (expected[index], version), (transport, index)
            assert len(list((tmp_path / "deltas").glob("delta_v*"))) == 2  # both kept (keep_deltas = 2)

    scenario(main, TIMEOUT_S)


def test_an_engine_gives_back_its_memory_queues_requests_meanwhile_and_a_push_of_its_own_version_restores_it(
        dirs, tmp_path):
    """`ReleaseMemory` / `ResumeMemory` (a colocated run's offload): the engine process's RSS drops
    by its KV cache and weights, a request sent meanwhile waits instead of failing, and pushing the
    version it already had (the trainer made no new one) restores it bit for bit."""
    paths = [str(d) for d in dirs]
    kv_mib = 96

    def rss_mib(pid: int) -> float:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            expected = await reference_outputs(system, dirs[:2])
            engine = await system.spawn(EngineActor, "engine", process=True, args=(paths[0], EngineConfig(
                kv_cache_mib=kv_mib, max_seq_len=64, double_buffer=True)))
            cfg = WeightSyncConfig(family="qwen3", transport="stream", verify="always", timeout_s=ASK_S)
            pusher = await system.spawn(TestPusher, "pusher", args=([engine.name], cfg, Source(paths)))
            await pusher.ask(Pick(index=1), timeout_s=ASK_S)
            await pusher.ask(PushWeights(version=1), timeout_s=ASK_S)
            assert await greedy(engine) == (expected[1], 1)
            pid = (await engine.ask(EngineStatus(), timeout_s=ASK_S)).pid
            held = rss_mib(pid)
            state = await engine.ask(ReleaseMemory(), timeout_s=ASK_S)
            assert "released" in (state.weights_error or "") and state.paused == "abort"
            released = rss_mib(pid)
            assert held - released > 0.8 * kv_mib, (held, released)
            waiting = asyncio.ensure_future(greedy(engine))  # queues while the engine has no weights
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await engine.ask(ResumeMemory(), timeout_s=ASK_S)
            report = await pusher.ask(PushWeights(version=1), timeout_s=ASK_S)  # the same version, restored
            assert report.verified and report.engines[0].weights_error is None
            assert await asyncio.wait_for(waiting, ASK_S) == (expected[1], 1)
            with pytest.raises(RemoteError, match="not newer than the engine's"):  # once served, it is stale again
                await pusher.ask(PushWeights(version=1), timeout_s=ASK_S)

    scenario(main, TIMEOUT_S)


def test_random_fill_check_catches_a_transport_that_skips_a_tensor(dirs):
    paths = [str(d) for d in dirs]

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            engine = await system.spawn(EngineActor, "engine", process=True,
                                        args=(paths[0], engine_config(shared_weights=True, double_buffer=True)))
            cfg = WeightSyncConfig(family="qwen3", transport="shm", verify="first", timeout_s=ASK_S)
            pusher = await system.spawn(DroppingPusher, "dropping", args=([engine.name], cfg, Source(paths)))
            with pytest.raises(RemoteError, match=r"verification failed: 1 tensor\(s\).*mlp.down_proj"):
                await pusher.ask(PushWeights(version=1), timeout_s=ASK_S)
            state = await engine.ask(EngineStatus(), timeout_s=ASK_S)
            assert state.version == 0 and state.updating is None and state.paused is None
            # The same push without the drop passes the check.
            good = await system.spawn(TestPusher, "good", args=([engine.name], cfg, Source(paths)))
            report = await good.ask(PushWeights(version=1), timeout_s=ASK_S)
            assert report.verified and report.engines[0].version == 1
            sums = await engine.ask(GetChecksums(), timeout_s=ASK_S)
            assert sums == checksums(weights_of(dirs[0]))

    scenario(main, TIMEOUT_S)


@pytest.mark.slow  # ~13 s: a pusher killed mid-write, per buffering mode
@pytest.mark.parametrize("double_buffer", [True, False])
def test_killing_the_pusher_midway_never_serves_a_mix_of_versions(dirs, double_buffer):
    paths = [str(d) for d in dirs]

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            expected = await reference_outputs(system, [dirs[0], dirs[1]])
            engine = await system.spawn(EngineActor, "engine", process=True,
                                        args=(paths[0], engine_config(shared_weights=True,
                                                                      double_buffer=double_buffer)))
            cfg = WeightSyncConfig(family="qwen3", transport="shm", verify="never", lease_s=2.0, timeout_s=ASK_S)
            pusher = await system.spawn(HangingPusher, "hanging", process=True, args=([engine.name], cfg, Source(paths)))
            pid = await pusher.ask(Pid(), timeout_s=ASK_S)
            push = pusher.ask_future(PushWeights(version=1), timeout_s=ASK_S)
            state = None

            async def updating() -> bool:
                nonlocal state
                state = await engine.ask(EngineStatus(), timeout_s=ASK_S)
                return state.updating == 1

            while not await updating():
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(Exception):  # noqa: B017 - the pusher's death, whichever way it is reported
                await push
            # The lease runs out: the engine aborts the update and resumes.
            deadline = asyncio.get_running_loop().time() + 30
            while (state := await engine.ask(EngineStatus(), timeout_s=ASK_S)).updating is not None:
                assert asyncio.get_running_loop().time() < deadline, "the engine never gave up the update"
                await asyncio.sleep(0.1)
            assert state.version == 0 and state.paused is None
            if double_buffer:
                assert state.weights_error is None
                assert await greedy(engine) == (expected[0], 0)
            else:
                assert "did not complete" in state.weights_error
                with pytest.raises(RemoteError, match="torn"):
                    await greedy(engine)
            # A complete version from a new pusher makes it serve again.
            fresh = await system.spawn(TestPusher, "fresh", args=([engine.name], cfg, Source(paths)))
            await fresh.ask(Pick(index=1), timeout_s=ASK_S)
            await fresh.ask(PushWeights(version=2), timeout_s=ASK_S)
            assert await greedy(engine) == (expected[1], 2)

    scenario(main, TIMEOUT_S)


def test_trainer_export_feeds_the_pusher_through_the_family_converter(dirs, tmp_path):
    trainer_config = TrainerConfig(model_dir=str(dirs[0]), lr=1e-3, micro_batch_tokens=24, num_threads=1,
                                   weights_dir=str(tmp_path / "weights"), weight_bucket_bytes=64 << 10)
    # one prompt's two samples, one rewarded: GRPO advantages of +-0.71 (the arrays ride inline)
    samples = [Trajectory(prompt_id=0, reward=reward, num_tokens=n, num_prompt_tokens=2, num_generated_tokens=n - 2,
                          data=TokenData.build(tokens=list(range(3, 3 + n)), loss_mask=[0] * 2 + [1] * (n - 2),
                                               logprobs=[-5.0] * n))
               for n, reward in ((9, 1.0), (12, 0.0))]

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            trainer = await TrainerGroup.spawn(system, trainer_config, 1)
            engine = await system.spawn(EngineActor, "engine", process=True,
                                        args=(str(dirs[0]), engine_config(double_buffer=True, dtype="bfloat16")))
            metrics = await trainer.train(samples, timeout_s=ASK_S)
            manifest = await trainer.ask(ExportWeights(), ASK_S)
            cfg = WeightSyncConfig(family="qwen3", transport="broadcast", verify="first", timeout_s=ASK_S)
            pusher = await system.spawn(WeightPusher, "pusher", args=([engine.name], cfg))
            report = await pusher.ask(PushWeights(version=metrics.weight_version, manifest=manifest), timeout_s=ASK_S)
            assert report.verified and report.engines[0].version == metrics.weight_version == 1
            exported = {}
            from safetensors.torch import load_file

            for bucket in manifest.buckets:
                exported.update(load_file(bucket.path))
            sums = await engine.ask(GetChecksums(), timeout_s=ASK_S)
            assert sums == checksums({n: t.to(torch.bfloat16) for n, t in exported.items()})
            await trainer.stop()

    scenario(main, TIMEOUT_S)
