"""On-policy distillation's teacher stage: the scorer against the teacher model itself (over the
engine's mailbox and over SGLang's HTTP API), then the loop with a teacher, single- and
multi-turn, its metrics, trace and the simulator's cost model of it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from _support_run import SHORT, kill_mid_run, run_cli, wait_for

from miles_async.actors.controller import Controller
from miles_async.actors.engine import EngineActor, EngineStatus, ScoreTokens
from miles_async.actors.recipe import load_recipe
from miles_async.actors.teacher import GetTeacherStats, Score, TeacherScorer
from miles_async.engine.backend import SGLangBackend
from miles_async.engine.core import EngineConfig
from miles_async.models import init_model, load_pretrained
from miles_async.observe import RunTrace, SampleTrace, decode_trace
from miles_async.runtime import ActorSystem, BlobGoneError, RemoteError
from miles_async.runtime import run as run_async
from miles_async.sim import fit_costs, load_trace
from miles_async.trajectory import TokenData, Trajectory, decode_data, encode_data

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"
ASK_S = 60.0


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("teacher"), seed=1, init_std=0.3)


def model_logprobs(folder: Path, tokens: list[int]) -> np.ndarray:
    """log p(token t | tokens < t) for t >= 1, straight from the model (fp32)."""
    model = load_pretrained(folder)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(ids[None], torch.arange(len(tokens))[None])[0].float(), dim=-1)
    return logp_TV[:-1].gather(1, ids[1:, None]).squeeze(1).numpy()


@pytest.mark.timeout(120)
def test_the_teacher_scores_the_trajectory_tokens_as_its_model_does(teacher_dir: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 250, (20,), generator=gen).tolist()
    single = [0] * 7 + [1] * 13  # a prompt, then the answer
    episode = [0] * 5 + [1] * 4 + [0] * 6 + [1] * 5  # a turn, a tool's output, the next turn
    direct = model_logprobs(teacher_dir, tokens)  # direct[t - 1] scores token t

    async def main() -> None:
        async with ActorSystem("distill-test") as system:
            await system.spawn(EngineActor, "teacher", args=(str(teacher_dir), EngineConfig(kv_cache_mib=4)),
                               kwargs={"http_port": 0})
            url = (await (await system.lookup("teacher")).ask(EngineStatus(), timeout_s=ASK_S)).url
            by_mailbox = await system.spawn(TeacherScorer, "scorer", kwargs={"engine": "teacher", "max_in_flight": 2})
            by_http = await system.spawn(TeacherScorer, "scorer-http", kwargs={"url": url, "backend": "embedded"})
            for mask in (single, episode):
                data = TokenData.build(tokens=tokens, loss_mask=mask, logprobs=[0.0] * len(tokens))
                sample = Trajectory(prompt_id=3, num_tokens=20, data=data)
                for scorer in (by_mailbox, by_http):
                    scored = await scorer.ask(Score(sample=sample), timeout_s=ASK_S)
                    teacher = scored.data.teacher_logprob_array()
                    first = mask.index(1)
                    want = np.where(np.array(mask) == 1, np.concatenate([[0.0], direct]), 0.0)
                    np.testing.assert_allclose(teacher, want, atol=1e-4)  # the tokens themselves, off-mask zeros
                    assert scored.teacher_s > 0 and teacher[:first].tolist() == [0.0] * first
                # the data-plane path: the old blob is freed, the new one holds the same arrays plus the teacher's
                ref = system.dataplane.put(encode_data(data))
                scored = await by_mailbox.ask(Score(sample=Trajectory(prompt_id=3, num_tokens=20, data=ref)),
                                              timeout_s=ASK_S)
                stored = decode_data(await system.dataplane.read(scored.data))
                assert stored.tokens == data.tokens and stored.teacher_logprobs
                with pytest.raises(BlobGoneError):
                    await system.dataplane.read(ref)
                system.dataplane.free([scored.data])
            # many at once through a bound of 2: all scored, none lost
            many = [Trajectory(prompt_id=i, num_tokens=20, data=TokenData.build(
                tokens=tokens, loss_mask=single, logprobs=[0.0] * 20)) for i in range(12)]
            out = await asyncio.gather(*(by_mailbox.ask(Score(sample=s), timeout_s=ASK_S) for s in many))
            assert [s.prompt_id for s in out] == list(range(12))
            stats = await by_mailbox.ask(GetTeacherStats(), timeout_s=ASK_S)
            assert stats.num_scored == 12 + 4 and stats.in_flight == 0 and stats.queued == 0 and stats.busy_s > 0
            # an aborted sample passes through unscored; one with nothing before its first token is refused
            aborted = Trajectory(prompt_id=1, finish_reason="abort", data=None)
            assert await by_mailbox.ask(Score(sample=aborted), timeout_s=ASK_S) == aborted
            bad = Trajectory(prompt_id=1, data=TokenData.build(tokens=[1, 2], loss_mask=[1, 1], logprobs=[0.0, 0.0]))
            with pytest.raises(RemoteError, match="nothing comes before it"):
                await by_mailbox.ask(Score(sample=bad), timeout_s=ASK_S)
            engine = await system.lookup("teacher")
            with pytest.raises(RemoteError, match=r"start must be in \[1, 3\)"):
                await engine.ask(ScoreTokens(input_ids=[1, 2, 3], start=0), timeout_s=ASK_S)
            # SGLang's own scoring request shape over HTTP: max_new_tokens 0, prompt log-probs from a start
            async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json={
                    "input_ids": tokens, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": True, "logprob_start_len": 0}) as response:
                body = await response.json()
            entries = body["meta_info"]["input_token_logprobs"]
            assert body["output_ids"] == [] and entries[0][0] is None and len(entries) == 20
            np.testing.assert_allclose([e[0] for e in entries[1:]], direct, atol=1e-4)
            backend = SGLangBackend(url)
            try:
                np.testing.assert_allclose(await backend.score(tokens, 5), direct[4:], atol=1e-4)
            finally:
                await backend.close()

    run_async(main())


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_with_a_teacher_records_the_stage_and_the_simulator_models_it(tmp_path: Path, teacher_dir: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=6", "eval.mode=none",
                    f'teacher.path="{teacher_dir}"', "teacher.max_in_flight=4", "trainer.policy_loss.distill_coef=1.0",
                    "trainer.advantage.reward_coef=0.0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = rows(out)
    assert len(metrics) == 6
    for row in metrics:
        assert row["perf/teacher_s"] > 0 and 0 <= row["perf/teacher_busy_fraction"] <= 1 and row["perf/teacher_wait_s"] >= 0
        assert row["train/teacher_kl"] != 0 and row["rollout/response_len_mean"] > 0
    # (a short step may train groups scored before it began: the teacher then had nothing to do in it)
    assert sum(row["perf/teacher_busy_fraction"] for row in metrics) > 0
    records = list(decode_trace(out / "trace.jsonl"))
    header = next(r for r in records if isinstance(r, RunTrace))
    assert header.teacher_in_flight == 4
    samples = [r for r in records if isinstance(r, SampleTrace) and r.finish_reason in ("stop", "length")]
    assert samples and all(s.teacher_s > 0 for s in samples)
    costs = fit_costs(load_trace(out / "trace.jsonl"))
    assert costs.teacher.request_s > 0 or costs.teacher.token_s > 0
    # bad input: a teacher path with no model, a coefficient without a teacher
    bad = run_cli(["run", str(RECIPE), "--out", str(tmp_path / "bad"), "--quiet", *SHORT,
                   f'teacher.path="{tmp_path / "nowhere"}"', "trainer.policy_loss.distill_coef=1.0"])
    assert bad.returncode != 0 and "teacher.path" in bad.stderr and "no config.json" in bad.stderr, bad.stderr[-2000:]
    bad = run_cli(["run", str(RECIPE), "--out", str(tmp_path / "bad2"), "--quiet", "trainer.policy_loss.distill_coef=1"])
    assert bad.returncode != 0 and "no teacher scores the samples" in bad.stderr


async def two_turns(ctx) -> str | None:
    """An agent whose every episode has two turns, whatever the model says (the calculator's agent
    stops at the first answer without a tool call, which an untrained model gives at once)."""
    messages = [{"role": "user", "content": ctx.task.text}]
    reply = await ctx.chat.complete(messages, tools=ctx.tools)
    messages += [{"role": "assistant", "content": reply.get("content") or ""},
                 {"role": "user", "content": "Check it and answer again."}]
    return (await ctx.chat.complete(messages, tools=ctx.tools)).get("content")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multi_turn_episodes_are_scored_on_their_own_tokens(tmp_path: Path, teacher_dir: Path) -> None:
    config = load_recipe(RECIPE.parent / "calculator.toml", [
        "sft.max_steps=0", "loop.num_steps=2", "loop.batch_groups=2", "agent.agent=\"test_distill_loop:two_turns\"",
        "scheduler.group_size=2", "scheduler.target_in_flight=8", "buffer.filter=none", "eval.mode=none",
        "rollout.sampling.max_new_tokens=12", "task.num_prompts=200", f'teacher.path="{teacher_dir}"',
        "trainer.policy_loss.distill_coef=0.5"])
    controller = Controller(config, tmp_path, progress=False)
    trace = controller._trace_sample
    reads: list[asyncio.Task] = []
    seen: list[TokenData] = []

    async def read(ref) -> None:  # while the group waits in the buffer (freed once trained)
        seen.append(decode_data(await controller.system.dataplane.read(ref)))

    def record(sample, counted):
        if counted and sample.data is not None and not sample.aborted:
            reads.append(asyncio.ensure_future(read(sample.data)))
        trace(sample, counted)

    controller._trace_sample = record
    result = run_async(controller.run())
    assert result.num_steps == 2 and seen
    episodes = [d for d in seen if np.count_nonzero(np.diff(d.mask().astype(int)) == 1) > 1]  # more than one turn
    assert episodes, "no episode had two turns"
    data = episodes[0]
    mask, teacher = data.mask(), data.teacher_logprob_array()
    assert teacher is not None and (teacher[mask == 0] == 0).all() and (teacher[mask == 1] < 0).all()
    direct = np.concatenate([[0.0], model_logprobs(teacher_dir, data.token_ids().tolist())])
    np.testing.assert_allclose(teacher[mask == 1], direct[mask == 1], atol=2e-4)
    assert all(r["perf/teacher_s"] > 0 for r in rows(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_teachers_death_stops_the_run_in_one_line_naming_it(tmp_path: Path, teacher_dir: Path) -> None:
    out = tmp_path / "run"
    args = ["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=100000", "eval.mode=none",
            "loop.checkpoint_every=2", f'teacher.path="{teacher_dir}"', "trainer.policy_loss.distill_coef=1.0"]
    status, stderr, children = kill_mid_run(
        args, "teacher", lambda: (out / "metrics.jsonl").is_file() and len(rows(out)) >= 3, "three RL steps")
    assert status == 1, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "the distillation teacher's engine (teacher" in line]
    assert len(said) == 1 and "died" in said[0] and "--resume continues from" in said[0], stderr[-3000:]
    assert "Traceback" not in stderr
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "the run's processes exit")
