"""vLLM's real CPU server (0.32, from `.venv-vllm`: `python3 dev.py vllm`) as a rollout engine.

The backend against the server (log-probs against our own model, streaming, prefix abort, pause,
bad input), the weight path (a pusher's `disk` transport into `ExternalEngineActor`, verified by
checksums and the probe, and the probe catching vLLM's stale output projection on a tied model),
a shortened main job with `rollout.backend=vllm` whose reward rises, LoRA runs whose adapters
reach vLLM through its LoRA endpoint or merged into whole models, and vLLM as a distillation
teacher scoring a trajectory. CI prepares the
environment (`.ci/run`); elsewhere these skip, naming the command.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from _support_run import run_cli

from miles_async.actors.engine import EngineStatus
from miles_async.actors.external import ExternalEngineActor, ServerConfig
from miles_async.actors.weights import PushWeights, WeightPusher, WeightSyncConfig
from miles_async.engine.backend import GenerateParams
from miles_async.engine.client import EngineHTTPError
from miles_async.engine.vllm import VllmBackend, VllmServer, VllmUnavailable, find_python
from miles_async.models import init_model, load_pretrained
from miles_async.models.loading import read_state_dict
from miles_async.runtime import ActorSystem, RemoteError, RuntimeConfig
from miles_async.trainer.fsdp import free_port

try:
    find_python()
    MISSING = ""
except VllmUnavailable as e:
    MISSING = str(e)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=MISSING)]
PROMPT = [5, 9, 13, 17, 21, 25]
START_S = 240.0


def logprobs_of(model_dir: Path | str, ids: list[int], start: int) -> list[float]:
    """Our model's log-prob of each of ids[start:] given what precedes it (float32)."""
    model = load_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    logp = torch.log_softmax(logits.float(), dim=-1)[0]
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def run(coro, timeout_s: float):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny"), seed=0, init_std=0.3)


@pytest.fixture(scope="module")
def server(tied_model, tmp_path_factory):
    """One vLLM server on the tied model as it is (no untied view), shared by the backend tests."""
    process = VllmServer(tied_model, port=free_port("127.0.0.1"), threads=1, kv_cache_bytes=32 * 2**20,
                         max_model_len=256, log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    loop = asyncio.new_event_loop()  # the server's process belongs to the loop that started it
    try:
        loop.run_until_complete(asyncio.wait_for(process.start(START_S), START_S + 10))
        yield process
    finally:
        loop.run_until_complete(asyncio.wait_for(process.stop(), 60))
        loop.close()


@pytest.mark.timeout(120)
def test_sampled_tokens_come_with_their_log_probs_under_our_model(server, tied_model):
    async def main():
        backend = VllmBackend(server.url)
        try:
            params = GenerateParams(max_new_tokens=12, temperature=1.0, seed=7)
            out = await backend.generate(PROMPT, params, version=3, rid="sample-1")
            streamed = [o async for o in backend.generate_stream(PROMPT, params, version=3)]
            return out, streamed
        finally:
            await backend.close()

    out, streamed = run(main(), 100)
    assert out.finish_reason in ("length", "stop") and 0 < len(out.output_ids) <= 12
    assert out.prompt_tokens == len(PROMPT)
    assert [(s.version, s.start, s.end) for s in out.weight_versions] == [(3, 0, len(out.output_ids))]
    expected = logprobs_of(tied_model, PROMPT + out.output_ids, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(out.output_logprobs, expected)) < 1e-4
    # the same seed streams the same tokens; each chunk is cumulative, as SGLang streams
    assert streamed[-1].output_ids == out.output_ids and streamed[-1].finish_reason == out.finish_reason
    assert [len(s.output_ids) for s in streamed] == sorted(len(s.output_ids) for s in streamed)


@pytest.mark.timeout(120)
def test_a_vllm_teacher_scores_a_trajectory_as_our_model_does(server, tied_model):
    """On-policy distillation's scoring stage (miles_async/actors/teacher.py) with vLLM as the teacher: its
    prompt log-probs of the sample's tokens from the first generated one, off-mask zeros."""
    from miles_async.actors.teacher import Score, TeacherScorer
    from miles_async.trajectory import TokenData, Trajectory

    tokens = PROMPT + [40, 41, 42, 7, 8, 9, 50, 51]
    mask = [0] * len(PROMPT) + [1, 1, 1, 0, 0, 0, 1, 1]  # an answer, a tool's output, an answer

    async def main():
        async with ActorSystem("vllm-teacher") as system:
            scorer = await system.spawn(TeacherScorer, "scorer", kwargs={"url": server.url, "backend": "vllm"})
            sample = Trajectory(prompt_id=0, num_tokens=len(tokens), data=TokenData.build(
                tokens=tokens, loss_mask=mask, logprobs=[0.0] * len(tokens)))
            return await scorer.ask(Score(sample=sample), timeout_s=60)

    scored = run(main(), 100)
    expected = logprobs_of(tied_model, tokens, len(PROMPT))
    teacher = scored.data.teacher_logprob_array()
    assert teacher[:len(PROMPT)].tolist() == [0.0] * len(PROMPT)
    for position, (got, want, on) in enumerate(zip(teacher[len(PROMPT):], expected, mask[len(PROMPT):])):
        assert abs(got - (want if on else 0.0)) < 1e-4, position


@pytest.mark.timeout(120)
def test_abort_by_prefix_pause_and_resume(server):
    async def main():
        backend = VllmBackend(server.url)
        try:
            await backend.pause("in_place")  # vLLM's "keep": requests wait in its queue
            long = GenerateParams(max_new_tokens=200, temperature=1.0)
            group = [asyncio.ensure_future(backend.generate(PROMPT, long, version=0, rid=f"group-7-{i}"))
                     for i in range(2)]
            other = asyncio.ensure_future(backend.generate(PROMPT, GenerateParams(max_new_tokens=4), version=0,
                                                           rid="group-8-0"))
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in (*group, other))  # paused
            held = await backend.load()
            await backend.abort("group-7")
            aborted = await asyncio.wait_for(asyncio.gather(*group), 30)
            await backend.resume()
            done = await asyncio.wait_for(other, 60)
            for _ in range(100):  # vLLM counts a request out after its reply is sent
                if await backend.load() == 0:
                    break
                await asyncio.sleep(0.05)
            return held, aborted, done, await backend.load(), await backend.info()
        finally:
            await backend.close()

    held, aborted, other, idle, info = run(main(), 110)
    assert (held, idle) == (3, 0)
    assert info["vllm_config"]["model_config"]["dtype"] == "torch.float32"
    assert [a.finish_reason for a in aborted] == ["abort", "abort"]
    assert other.finish_reason == "length" and len(other.output_ids) == 4


@pytest.mark.timeout(60)
def test_bad_requests_are_named_and_the_server_keeps_serving(server):
    async def main():
        backend = VllmBackend(server.url)
        try:
            with pytest.raises(EngineHTTPError) as error:
                await backend.generate([5, 10_000_000], GenerateParams(max_new_tokens=2), version=0)
            with pytest.raises(ValueError, match="routed experts"):
                await backend.generate(PROMPT, GenerateParams(return_routed_experts=True), version=0)
            return error.value, await backend.generate(PROMPT, GenerateParams(max_new_tokens=2), version=0)
        finally:
            await backend.close()

    error, out = run(main(), 50)
    assert error.status == 400 and "10000000" in error.message.replace(",", "")
    assert len(out.output_ids) == 2


def runtime() -> RuntimeConfig:
    return RuntimeConfig(transport="ipc", ask_timeout_s=60.0, spawn_timeout_s=START_S, stop_grace_s=5.0)


def pusher_config(delta_dir: Path) -> WeightSyncConfig:
    return WeightSyncConfig(family="qwen3", transport="disk", verify="always", delta_dir=str(delta_dir),
                            pause_mode="in_place", timeout_s=120.0)


class Versions:
    """A pusher's in-process source: the weights of model folder `folders[i]` for version i."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self.pushed = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.pushed += 1
        return read_state_dict(self.folders[self.pushed])


@pytest.mark.timeout(400)
def test_the_disk_transport_reloads_vllm_in_place_verified_version_after_version(tied_model, tmp_path):
    folders = [tied_model] + [init_model("qwen3", "tiny", tmp_path / f"v{i}", seed=i, init_std=0.3) for i in (1, 2)]

    async def main():
        async with ActorSystem(config=runtime()) as system:
            engine = await system.spawn(ExternalEngineActor, "engine-0", process=True,
                                        args=("vllm", str(tied_model), ServerConfig(kv_cache_mib=32, max_model_len=256)),
                                        kwargs={"log_dir": str(tmp_path)})
            state = await engine.ask(EngineStatus(), timeout_s=30)
            pusher = await system.spawn(WeightPusher, "pusher", args=(["engine-0"], pusher_config(tmp_path / "deltas"),
                                                                       Versions(folders)))
            backend = VllmBackend(state.url)
            served = []
            try:
                for version in (1, 2):
                    report = await pusher.ask(PushWeights(version=version), timeout_s=200)
                    assert report.verified and report.transport == "disk"
                    assert [(s.version, s.label, s.weights_error) for s in report.engines] == [(version, str(version), None)]
                    out = await backend.generate(PROMPT, GenerateParams(max_new_tokens=8, temperature=0.0), version=version)
                    served.append(out)
            finally:
                await backend.close()
            return served

    served = run(main(), 390)
    for version, out in zip((1, 2), served):
        expected = logprobs_of(folders[version], PROMPT + out.output_ids, len(PROMPT))
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, expected)) < 1e-4, version
    assert sorted(p.name for p in (tmp_path / "deltas").iterdir()) == ["full_v00000001", "full_v00000002"]


@pytest.mark.timeout(200)
def test_the_probe_catches_vllm_serving_a_stale_output_projection(server, tied_model, tmp_path):
    # Attached to a server on the tied checkpoint itself, the actor cannot untie it, and vLLM's CPU
    # reload keeps the first version's output projection: the probe must refuse the version.
    # (Last in this file: it leaves the shared server paused.)
    other = init_model("qwen3", "tiny", tmp_path / "v1", seed=1, init_std=0.3)

    async def main():
        async with ActorSystem(config=runtime()) as system:
            engine = await system.spawn(ExternalEngineActor, "engine-0", process=True,
                                        args=("vllm", str(tied_model), ServerConfig(url=server.url)))
            pusher = await system.spawn(WeightPusher, "pusher", args=(["engine-0"], pusher_config(tmp_path / "d"),
                                                                       Versions([tied_model, other])))
            with pytest.raises(RemoteError, match="failed the probe") as error:
                await pusher.ask(PushWeights(version=1), timeout_s=120)
            return error.value, await engine.ask(EngineStatus(), timeout_s=30)

    error, state = run(main(), 190)
    assert "log-probs differ from the pushed weights'" in str(error)
    assert state.version == 0 and "failed the probe" in (state.weights_error or "") and state.paused == "abort"


@pytest.mark.timeout(600)
def test_the_main_job_trains_with_vllm_as_its_engine(tmp_path):
    """200 RL steps after the warm start: the sampled reward of the last 50 beats the first 50's by
    0.10 on vLLM as on the embedded engine (docs/benchmarks.md, "vLLM as the run's engine": 0.20
    over the first 100 steps, 0.27 over the next), twice the margin asserted."""
    out = tmp_path / "run"
    done = run_cli(["run", "recipes/reverse.toml", "rollout.backend=vllm", "loop.num_steps=200", "eval.every=100",
                    "--out", str(out)], timeout_s=550)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    first, last = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    print(f"vLLM main job: reward {first:.3f} (first 50 steps) -> {last:.3f} (last 50), "
          f"{summary['samples_per_s']:.0f} samples/s, eval {summary['eval_scores']}")
    assert len(rewards) == 200
    assert last > first + 0.05, rewards  # it learns
    assert all(0 <= r["train/logprob_abs_diff"] < 0.5 for r in rows if "train/logprob_abs_diff" in r)  # the mismatch, reported
    header = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
    assert header["transport"] == "disk"
    assert list(out.glob("engine-0-vllm.log")) and (out / "deltas").is_dir()


def test_lora_adapters_reach_vllm_through_its_lora_endpoint(tmp_path):
    """With LoRA, a vLLM engine serves the trainer's adapters through its own LoRA endpoint (started
    with --enable-lora; each push moves the adapters alone, reloaded in place under one name that
    every request names). A wrong adapter would show in the trainer's mismatch once the adapters
    move (sync mode: every batch comes from the weights it is trained at, so nothing else moves it);
    the probe verifies the first push. (`rollout.server.lora = "merged"`, whole models with the
    adapters merged, is the reload every other test here makes; which pushes a run makes is
    tests/unit/test_lora.py's.)"""
    from _support_run import SHORT

    from miles_async.observe import UpdateTrace, decode_trace

    out = tmp_path / "run"
    done = run_cli(["run", "recipes/reverse.toml", "rollout.backend=vllm", *SHORT, "loop.num_steps=6",
                    "eval.mode=none", "loop.mode=sync", "trainer.lora.rank=8", "trainer.lr=1e-2",
                    "--out", str(out)], timeout_s=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["train/logprob_abs_diff"] < 1e-4 for r in rows), [r["train/logprob_abs_diff"] for r in rows]
    base = load_pretrained(out / "model")
    full = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    updates = [r for r in decode_trace(out / "trace.jsonl") if isinstance(r, UpdateTrace)]
    assert updates and all(u.num_bytes < full // 5 for u in updates)  # the adapters alone
    final = load_pretrained(out / "final_model")
    assert any(not torch.equal(p, base.state_dict()[n]) for n, p in final.state_dict().items())
