"""The engine's side of weight updates (engine/weights.py), in process on a real tiny model:
version order on every path, double buffer vs torn state, verification at commit, the colocated
no-copy handoff, shared-memory weights written by another process, and disk deltas."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from miles_async.engine.core import Engine, EngineConfig, WeightsUnavailableError
from miles_async.engine.request import GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.weights import StaleVersionError, WeightStore, parse_version
from miles_async.models import init_model, load_pretrained
from miles_async.trajectory import VersionSpan
from miles_async.transport import colocated
from miles_async.transport.disk_delta import write_delta
from miles_async.transport.errors import TransportError
from miles_async.transport.shm import SharedWeights
from miles_async.transport.verify import checksums

TIMEOUT_S = 60
PROMPT = [5, 9, 13, 17, 21]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return [init_model("qwen3", "tiny", tmp_path_factory.mktemp(f"m{seed}"), seed=seed, init_std=0.3)
            for seed in (0, 1)]


def engine_for(path, **config) -> Engine:
    return Engine(load_pretrained(path), config=EngineConfig(kv_cache_mib=2, max_seq_len=64, **config))


async def greedy(engine: Engine) -> list[int]:
    return (await engine.generate(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY))).output_ids


def new_weights(path) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in load_pretrained(path).state_dict().items()}


def test_parse_version_orders_integers_and_counts_names():
    assert parse_version("7", 3) == (7, "7") and parse_version(9, 3) == (9, "9")
    assert parse_version(None, 3) == (4, "4") and parse_version("step-7", 3) == (4, "step-7")


@pytest.mark.parametrize("double_buffer", [False, True])
def test_older_versions_are_rejected_on_every_path(dirs, double_buffer, tmp_path):
    engine = engine_for(dirs[0], double_buffer=double_buffer)
    other = new_weights(dirs[1])

    async def scenario():
        async with engine:
            assert await engine.weights.update_from_tensors(other, "5") == "5"
            for call in (lambda: engine.weights.update_from_tensors(other, 4),
                         lambda: engine.weights.update_from_tensors(other, "5"),
                         lambda: engine.weights.update_from_disk(str(dirs[0]), "3"),
                         lambda: engine.weights.begin_update(2),
                         lambda: engine.weights.adopt_weights(other, 5)):
                with pytest.raises(StaleVersionError, match="not newer than the engine's 5"):
                    await call()
            assert engine.weights.updating is None and engine.weights.serving_error() is None
            return await greedy(engine)

    assert run(scenario())  # still serving version 5


def test_double_buffer_keeps_serving_the_previous_version_when_an_update_is_abandoned(dirs):
    engine = engine_for(dirs[0], double_buffer=True)
    other = new_weights(dirs[1])

    async def scenario():
        async with engine:
            before = await greedy(engine)
            target = await engine.weights.begin_update(1)
            assert all(target[n].data_ptr() != p.data_ptr() for n, p in engine.model.named_parameters())
            half = dict(list(other.items())[: len(other) // 2])
            engine.weights.write(half)
            during = await greedy(engine)  # generation goes on from the live buffer meanwhile
            with pytest.raises(TransportError, match="missing"):
                await engine.weights.commit_update()
            after_abort = await greedy(engine)
            assert engine.weight_version == "0" and engine.weights.serving_error() is None
            await engine.weights.begin_update(1)
            engine.weights.write(other)
            assert await engine.weights.commit_update(checksums(other)) == "1"
            return before, during, after_abort, await greedy(engine)

    before, during, after_abort, updated = run(scenario())
    assert before == during == after_abort != updated


def test_single_buffer_refuses_to_serve_torn_weights_until_a_complete_version_commits(dirs):
    engine = engine_for(dirs[0])
    other = new_weights(dirs[1])

    async def scenario():
        async with engine:
            await engine.weights.begin_update(3)
            engine.weights.write(dict(list(other.items())[:3]))
            await engine.weights.abort_update("the pusher died")
            problem = engine.stats().weights_error
            assert problem is not None and "version 3 did not complete (the pusher died)" in problem
            with pytest.raises(WeightsUnavailableError, match="torn"):
                engine.submit(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY))
            await engine.weights.begin_update(4)
            engine.weights.write(other)
            await engine.weights.commit_update()
            assert engine.stats().weights_error is None and engine.weight_version == "4"
            return await greedy(engine)

    reference = engine_for(dirs[1])

    async def expected():
        async with reference:
            return await greedy(reference)

    assert run(scenario()) == run(expected())


def test_commit_verifies_checksums_and_names_the_tensor_that_differs(dirs):
    engine = engine_for(dirs[0], double_buffer=True)
    other = new_weights(dirs[1])
    expected = checksums(other)
    wrong = dict(other)
    wrong["model.norm.weight"] = wrong["model.norm.weight"] + 1

    async def scenario():
        async with engine:
            await engine.weights.begin_update(1)
            engine.weights.write(wrong)
            with pytest.raises(TransportError, match=r"verification failed: 1 tensor\(s\).*model.norm.weight"):
                await engine.weights.commit_update(expected)
            assert engine.weight_version == "0" and engine.weights.serving_error() is None

    run(scenario())


def test_colocated_handoff_takes_matching_tensors_without_a_copy(dirs):
    engine = engine_for(dirs[0], double_buffer=True)
    other = new_weights(dirs[1])
    colocated.register("engine-0", engine.weights)

    async def scenario():
        async with engine:
            taken = await colocated.handoff("engine-0", other, 1, checksums(other))
            params = dict(engine.model.named_parameters())
            shared = all(params[n].data_ptr() == other[n].data_ptr() for n in params)
            with pytest.raises(ValueError, match="no engine named 'nope'"):
                await colocated.handoff("nope", other, 2)
            return taken, shared

    try:
        taken, shared = run(scenario())
    finally:
        colocated.unregister("engine-0")
    assert taken == len(dict(engine.model.named_parameters())) and shared


def test_colocated_handoff_casts_when_the_engine_dtype_differs(dirs):
    model = load_pretrained(dirs[0], dtype=torch.bfloat16)
    engine = Engine(model, config=EngineConfig(kv_cache_mib=2, max_seq_len=64, double_buffer=True))
    other = new_weights(dirs[1])

    async def scenario():
        async with engine:
            taken = await engine.weights.adopt_weights(other, 1)
            return taken, await engine.weights.checksums()

    taken, sums = run(scenario())
    assert taken == 0 and sums == checksums({n: t.to(torch.bfloat16) for n, t in other.items()
                                             if n in engine.weights.live})


def _write_shared(segment: str, path: str, die_midway: bool) -> None:
    handle = SharedWeights.attach(segment)
    named = {n: t for n, t in load_pretrained(path).state_dict().items() if n in handle.tensors}
    if die_midway:
        items = iter(named.items())
        handle._set_seq(handle.seq + 1)  # a write under way...
        handle.tensors[next(items)[0]].zero_()
        import os

        os._exit(3)  # ...and the writer dies before finishing it
    handle.write(named)
    handle.close()


@pytest.mark.slow  # ~10 s: a writer process per buffering mode
@pytest.mark.parametrize("double_buffer", [False, True])
def test_shared_weights_written_by_another_process(dirs, double_buffer):
    engine = engine_for(dirs[0], shared_weights=True, double_buffer=double_buffer)
    ctx = mp.get_context("spawn")

    def writer(die_midway: bool) -> int:
        proc = ctx.Process(target=_write_shared, args=(engine.weights.target_segment, str(dirs[1]), die_midway))
        proc.start()
        proc.join(TIMEOUT_S)
        return proc.exitcode

    async def scenario():
        async with engine:
            before = await greedy(engine)
            await engine.weights.begin_update(1)
            assert await asyncio.to_thread(writer, True) == 3
            with pytest.raises(TransportError, match="did not finish"):
                await engine.weights.commit_update()
            if double_buffer:
                assert await greedy(engine) == before and engine.weights.serving_error() is None
            else:
                assert "did not complete" in engine.weights.serving_error()
            await engine.weights.begin_update(2)
            assert await asyncio.to_thread(writer, False) == 0
            await engine.weights.commit_update()
            return before, await greedy(engine)

    reference = engine_for(dirs[1])

    async def expected():
        async with reference:
            return await greedy(reference)

    try:
        before, after = run(scenario())
    finally:
        engine.weights.close()
    assert after == run(expected()) != before


def test_a_shared_segment_written_outside_an_update_makes_the_engine_torn(dirs):
    engine = engine_for(dirs[0], shared_weights=True)
    try:
        handle = SharedWeights.attach(engine.weights.live_segment)
        handle.write({"model.norm.weight": torch.zeros_like(handle.tensors["model.norm.weight"])})
        handle.close()
        assert "written outside an update" in engine.weights.serving_error()
    finally:
        engine.weights.close()


def test_disk_delta_applies_against_the_engines_version(dirs, tmp_path):
    engine = engine_for(dirs[0], double_buffer=True)
    base = {n: t.clone() for n, t in engine.weights.live.items()}
    new = {n: t + 1e-3 * torch.randn_like(t) for n, t in base.items()}

    async def scenario():
        async with engine:
            stats = write_delta(tmp_path, base, new, 0, 1)
            assert await engine.weights.apply_delta(str(stats.folder)) == "1"
            with pytest.raises(TransportError):
                await engine.weights.apply_delta(str(stats.folder))  # now at 1: a 0 -> 1 delta does not fit
            return await engine.weights.checksums()

    assert run(scenario()) == checksums(new)


def test_store_without_an_update_in_progress_explains_itself(dirs):
    store = WeightStore(load_pretrained(dirs[0]))
    with pytest.raises(RuntimeError, match="call begin"):
        store.commit()
    with pytest.raises(ValueError, match="shared-memory store cannot adopt"):
        shared = WeightStore(load_pretrained(dirs[0]), shared=True)
        try:
            shared.begin(1)
            shared.adopt({})
        finally:
            shared.close()


def test_a_copy_never_writes_into_tensors_an_earlier_handoff_took(dirs):
    store = WeightStore(load_pretrained(dirs[0]), double_buffer=True)
    first, second = new_weights(dirs[1]), new_weights(dirs[0])
    kept = checksums(first)
    for version, named in ((1, first), (2, second)):
        store.begin(version, adopting=True)
        store.adopt(named)
        store.commit()
    store.begin(3)  # a copying update: its target is the buffer that held `first`
    store.write(new_weights(dirs[1]))
    store.commit()
    assert checksums(first) == kept


def test_a_request_spanning_an_update_reports_every_version_it_was_sampled_under(dirs):
    engine = engine_for(dirs[0])
    other = new_weights(dirs[1])
    long = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)

    async def scenario():
        async with engine:
            state = engine.submit(GenerateRequest(input_ids=PROMPT, sampling_params=long))
            while len(state.output_ids) < 3:
                await asyncio.sleep(0.001)
            await engine.weights.update_from_tensors(other, 1)
            boundary = len(state.output_ids)  # the update landed between steps: the next token is version 1's
            await state.done.wait()
            return engine.snapshot(state), boundary

    out, k = run(scenario())
    assert 3 <= k < 40 and len(out.output_ids) == 40
    # One span per version, over output positions, meeting exactly where the update landed.
    assert out.weight_versions == [VersionSpan(0, 0, k), VersionSpan(1, k, 40)]
