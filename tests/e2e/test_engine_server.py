"""The embedded engine through its HTTP API (SGLang's), with the real `EngineClient`.

Each test serves a real tiny model (miles_async.models, written by init_model) from an aiohttp
server on 127.0.0.1, port 0, in the test's own event loop; the last test runs the real CLI,
`miles-async serve engine`, as a subprocess. References come from the same model's plain full
forward (no cache of any kind).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys

import aiohttp
import pytest
import torch

from miles_async.engine.client import EngineClient, EngineHTTPError, decode_routed_experts, parse_output
from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.server import EngineServer
from miles_async.models import init_model, load_pretrained, load_tokenizer
from miles_async.trajectory import VersionSpan

TIMEOUT_S = 60
# Weights drawn wider than init's 0.02, so that greedy output does not repeat one token.
LIVELY_STD = 0.3
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_pretrained(model_dir)


@contextlib.asynccontextmanager
async def served(model_dir, **config):
    engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(**{"kv_cache_mib": 8, **config}))
    async with EngineServer(engine) as server, EngineClient(server.url, timeout_s=TIMEOUT_S) as client:
        yield client


def greedy_loop(model, prompt: list[int], num_tokens: int) -> list[int]:
    """The plain greedy loop: a full forward over the whole sequence for every new token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def greedy_under_full_forward(model, prompt: list[int], output: list[int]) -> list[int]:
    """What a greedy loop would have picked at each step, given the previous output tokens.

    One forward over prompt + output, teacher-forced: it equals the greedy loop's output exactly
    when `output` is greedy, at the cost of one forward instead of one per token.
    """
    with torch.inference_mode():
        logits_TV = model(torch.tensor([prompt + output[:-1]]))[0]
    return logits_TV[len(prompt) - 1:].argmax(dim=-1).tolist()


def log_probs_of(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.inference_mode():
        logp_TV = torch.log_softmax(model(torch.tensor([prompt + output]))[0], dim=-1)
    return [float(logp_TV[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def prompts(count: int, start_len: int = 6, step: int = 5, vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (start_len + step * i,), generator=gen).tolist() for i in range(count)]


async def generated_tokens(client: EngineClient) -> int:
    return (await client.server_info())["internal_states"][0]["num_generated_tokens"]


def test_greedy_equals_a_full_forward_greedy_loop(model_dir, model):
    batch = prompts(6)

    async def scenario():
        async with served(model_dir) as client:
            singles = await asyncio.gather(*(client.generate(
                input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 16}) for p in batch))
            together = await client.generate(input_ids=batch[:3], sampling_params={**GREEDY, "max_new_tokens": 16})
            return singles, together

    singles, together = run(scenario())
    for prompt, out in zip(batch, singles):
        assert out["output_ids"] == greedy_loop(model, prompt, 16)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 16}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(prompt), 16, "0")
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in singles[:3]]


def test_text_in_text_out_and_model_info(model_dir):
    tokenizer = load_tokenizer(model_dir)

    async def scenario():
        async with served(model_dir) as client:
            info = await client.model_info()
            out = await client.generate(text="def add(a, b):", sampling_params={**GREEDY, "max_new_tokens": 12})
            return info, out

    info, out = run(scenario())
    assert info["is_generation"] and info["weight_version"] == "0" and info["model_path"] == str(model_dir)
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer.encode("def add(a, b):"))
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(model_dir, model):
    prompt = prompts(1, start_len=10)[0]
    seeded = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 20, "ignore_eos": True}

    async def scenario():
        async with served(model_dir) as client:
            # Other traffic shares the batch with the seeded requests: the seed must not care.
            noise = [client.generate(input_ids=p, sampling_params={"max_new_tokens": 20}) for p in prompts(4)]
            runs = await asyncio.gather(
                client.generate(input_ids=prompt, sampling_params={**seeded, "sampling_seed": 7}),
                client.generate(input_ids=prompt, sampling_params={**seeded, "sampling_seed": 7}),
                client.generate(input_ids=prompt, sampling_params={**seeded, "sampling_seed": 8}),
                client.generate(input_ids=prompt, sampling_params={"top_k": 1, "max_new_tokens": 20, "ignore_eos": True}),
                *noise)
            later = await client.generate(input_ids=prompt, sampling_params={**seeded, "sampling_seed": 7})
            return runs, later

    (first, second, other_seed, top1, *_), later = run(scenario())
    assert first["output_ids"] == second["output_ids"] == later["output_ids"]
    assert other_seed["output_ids"] != first["output_ids"]
    assert top1["output_ids"] == greedy_under_full_forward(model, prompt, top1["output_ids"])


def test_logprobs_are_the_models_log_softmax(model_dir, model):
    prompt = prompts(1, start_len=12)[0]

    async def scenario():
        async with served(model_dir) as client:
            return await asyncio.gather(
                client.generate(input_ids=prompt, return_logprob=True,
                                sampling_params={"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 12,
                                                 "ignore_eos": True}),
                client.generate(input_ids=prompt, return_logprob=True, sampling_params={**GREEDY, "max_new_tokens": 12}))

    for out in run(scenario()):
        triples = out["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
        expected = log_probs_of(model, prompt, out["output_ids"])
        assert [t[0] for t in triples] == pytest.approx(expected, abs=1e-4)


def test_stop_strings_and_stop_tokens(model_dir):
    tokenizer = load_tokenizer(model_dir)
    prompt = prompts(1, start_len=8)[0]

    async def scenario():
        async with served(model_dir) as client:
            free = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 24})
            ids, text = free["output_ids"], free["text"]
            stop_token = ids[5]
            stop_text = text[len(text) // 2:len(text) // 2 + 3]
            by_token = await client.generate(input_ids=prompt, sampling_params={
                **GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop_token]})
            by_text = await client.generate(input_ids=prompt, sampling_params={
                **GREEDY, "max_new_tokens": 24, "stop": [stop_text, "\x00never"]})
            return ids, text, stop_token, stop_text, by_token, by_text

    ids, text, stop_token, stop_text, by_token, by_text = run(scenario())
    assert by_token["output_ids"] == ids[:ids.index(stop_token) + 1]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert by_text["text"] == text[:text.index(stop_text)]
    assert stop_text in tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    assert len(by_text["output_ids"]) < len(ids)


def test_streaming_sends_cumulative_outputs_then_done(model_dir):
    prompt = prompts(1)[0]

    async def scenario():
        async with served(model_dir) as client:
            chunks = [c async for c in client.generate_stream(
                input_ids=prompt, return_logprob=True, sampling_params={**GREEDY, "max_new_tokens": 8})]
            whole = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8})
            return chunks, whole

    chunks, whole = run(scenario())
    assert len(chunks) >= 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 8


def test_abort_a_request_and_keep_serving(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            stream = client.generate_stream(input_ids=prompts(1)[0], rid="long",
                                            sampling_params={**GREEDY, "max_new_tokens": 3000})
            chunks = [await anext(stream)]
            await client.abort("long")
            chunks += [c async for c in stream]
            after = await client.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2})
            return chunks[-1], after

    last, after = run(scenario())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] < 3000
    assert after["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_continue_finishes_them_unchanged(model_dir, model, mode):
    prompt = prompts(1, start_len=20)[0]

    async def scenario():
        async with served(model_dir) as client:
            stream = client.generate_stream(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 160})
            await anext(stream)
            await client.pause(mode)
            state = (await client.server_info())["internal_states"][0]
            before = await generated_tokens(client)
            await asyncio.sleep(0.2)  # a window in which nothing may be generated
            idle = await generated_tokens(client) == before
            await client.resume()
            last = [c async for c in stream][-1]
            return state, idle, last

    state, idle, last = run(scenario())
    assert idle and state["paused"] == mode
    # in_place keeps the request running on its KV; retract sends it back to the queue.
    assert (state["num_running"], state["num_waiting"]) == ((1, 0) if mode == "in_place" else (0, 1))
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 160}
    assert last["output_ids"] == greedy_under_full_forward(model, prompt, last["output_ids"])


def test_a_client_that_goes_away_aborts_its_request(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            impatient = aiohttp.ClientTimeout(total=0.3)
            async with aiohttp.ClientSession(timeout=impatient) as http:
                with pytest.raises(asyncio.TimeoutError):
                    await http.post(client.base_url + "/generate", json={
                        "input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "max_new_tokens": 3500}})
            while (state := (await client.server_info())["internal_states"][0])["num_running"]:
                await asyncio.sleep(0.01)
            return state

    state = run(scenario())
    assert state["num_generated_tokens"] < 3500


def test_pause_abort_aborts_in_flight_and_holds_new_requests_until_continue(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            stream = client.generate_stream(input_ids=prompts(1)[0], sampling_params={**GREEDY, "max_new_tokens": 3000})
            await anext(stream)
            await client.pause("abort")
            aborted = [c async for c in stream][-1]
            held = asyncio.create_task(client.generate(input_ids=[9, 9, 9],
                                                       sampling_params={**GREEDY, "max_new_tokens": 4}))
            while (await client.server_info())["internal_states"][0]["num_waiting"] == 0:
                await asyncio.sleep(0.01)
            assert not held.done()
            await client.resume()
            return aborted, await held

    aborted, held = run(scenario())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert held["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_pause_wait_lets_in_flight_requests_finish_first(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            in_flight = asyncio.create_task(client.generate(
                input_ids=prompts(1)[0], sampling_params={**GREEDY, "max_new_tokens": 200}))
            while (await client.server_info())["internal_states"][0]["num_running"] == 0:
                await asyncio.sleep(0.01)
            await client.pause("wait")  # returns once the request in flight is done
            assert (await client.server_info())["internal_states"][0]["num_running"] == 0
            late = asyncio.create_task(client.generate(input_ids=[4, 4], sampling_params={**GREEDY, "max_new_tokens": 3}))
            while (await client.server_info())["internal_states"][0]["num_waiting"] == 0:
                await asyncio.sleep(0.01)
            await client.resume()
            return await in_flight, await late

    done, late = run(scenario())
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert late["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_weight_update_from_disk_changes_outputs_and_bumps_the_version(model_dir, tmp_path):
    new_dir = init_model("qwen3", "tiny", tmp_path / "new", seed=1, init_std=LIVELY_STD)
    new_model = load_pretrained(new_dir)
    prompt = prompts(1, start_len=20)[0]
    params = {**GREEDY, "max_new_tokens": 10}

    async def scenario():
        async with served(model_dir) as client:
            before = await client.generate(input_ids=prompt, sampling_params=params)
            with pytest.raises(EngineHTTPError) as missing:
                await client.update_weights_from_disk(str(tmp_path / "nowhere"))
            reply = await client.update_weights_from_disk(str(new_dir))
            after = await client.generate(input_ids=prompt, sampling_params=params)
            info = await client.model_info()
            named = await client.update_weights_from_disk(str(new_dir), weight_version="step-7")
            return before, missing.value, reply, after, info, named

    before, missing, reply, after, info, named = run(scenario())
    assert missing.status == 400 and "nowhere" in missing.message
    assert reply["success"] and info["weight_version"] == "1" and named["weight_version"] == "step-7"
    assert before["meta_info"]["weight_version"] == "0" and after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["cached_tokens"] == 0  # the old weights' prefix cache is gone
    assert after["output_ids"] == greedy_loop(new_model, prompt, 10) != before["output_ids"]


def covering_spans(out: dict) -> list[tuple[str, int, int]]:
    """meta_info.weight_versions as (version label, start, end), checked to cover every output
    position once, in order: contiguous spans from 0 to the number of output tokens, none empty."""
    spans = [(s["version"], s["start"], s["end"]) for s in out["meta_info"]["weight_versions"]]
    assert all(isinstance(label, str) for label, _, _ in spans), spans  # SGLang's labels are text
    bounds = [0] + [end for _, _, end in spans]
    assert [start for _, start, _ in spans] == bounds[:-1], spans  # contiguous, from position 0
    assert bounds[-1] == len(out["output_ids"]) and all(start < end for _, start, end in spans), spans
    return spans


def test_generate_reports_the_weight_version_of_every_output_token_as_spans(model_dir, tmp_path):
    """A request that runs across a weight update (paused in place, as a run updates its engines)
    gets one span per version, meeting exactly at the token where the update landed."""
    new_dir = init_model("qwen3", "tiny", tmp_path / "new", seed=1, init_std=LIVELY_STD)
    prompt = prompts(1, start_len=10)[0]
    num_tokens = 200  # long enough that the pause lands well before the end, even on a loaded machine

    async def scenario():
        async with served(model_dir) as client:
            before = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6})
            start = await generated_tokens(client)
            stream = client.generate_stream(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": num_tokens})
            chunks = [await anext(stream)]
            while len(chunks[-1]["output_ids"]) < 3:
                chunks.append(await anext(stream))
            await client.pause("in_place")  # returns between steps; the request keeps its KV
            boundary = await generated_tokens(client) - start
            await client.update_weights_from_disk(str(new_dir))
            await client.resume()
            chunks += [c async for c in stream]
            after = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6})
            return before, chunks, boundary, after

    before, chunks, k, after = run(scenario())
    assert covering_spans(before) == [("0", 0, 6)] and covering_spans(after) == [("1", 0, 6)]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": num_tokens} and 3 <= k < num_tokens
    assert covering_spans(final) == [("0", 0, k), ("1", k, num_tokens)] and final["meta_info"]["weight_version"] == "1"
    for chunk in chunks:  # every partial output too; the tokens before the update stay version 0's
        spans = covering_spans(chunk)
        assert spans[0][0] == "0" and (len(chunk["output_ids"]) <= k) == (spans == [("0", 0, len(chunk["output_ids"]))])
    # The rollout side's reader takes them as they are (the label "1" agrees).
    assert parse_output(final, version=0).weight_versions == [VersionSpan(0, 0, k), VersionSpan(1, k, num_tokens)]


def test_torn_weights_fail_health_and_requests_and_older_versions_are_refused(model_dir):
    prompt = prompts(1)[0]

    async def scenario():
        engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8))
        async with EngineServer(engine) as server, EngineClient(server.url, timeout_s=TIMEOUT_S) as client:
            await client.update_weights_from_disk(str(model_dir), weight_version="5")
            with pytest.raises(EngineHTTPError) as older:
                await client.update_weights_from_disk(str(model_dir), weight_version="4")
            healthy = await client.health()
            await engine.weights.begin_update(6)
            await engine.weights.abort_update("the pusher died")  # single buffer: torn
            torn_health = await client.health()
            async with aiohttp.ClientSession() as http, http.get(f"{server.url}/health") as r:
                health_status, health_body = r.status, await r.json()
            with pytest.raises(EngineHTTPError) as refused:
                await client.generate(input_ids=prompt, sampling_params=GREEDY)
            await client.update_weights_from_disk(str(model_dir), weight_version="7")
            return (older.value, healthy, torn_health, health_status, health_body, refused.value,
                    await client.health(), await client.generate(input_ids=prompt, sampling_params=GREEDY))

    older, healthy, torn_health, status, body, refused, recovered, out = run(scenario())
    assert older.status == 400 and "weight version 4 is not newer than the engine's 5" in older.message
    assert healthy and not torn_health and status == 503 and "version 6 did not complete" in body["error"]["message"]
    assert refused.status == 503 and "torn" in refused.message
    assert recovered and out["meta_info"]["weight_version"] == "7"


def test_prefix_cache_hits_and_flush(model_dir):
    system = prompts(1, start_len=40)[0]

    async def scenario():
        async with served(model_dir, block_size=8) as client:
            params = {**GREEDY, "max_new_tokens": 4}
            first = await client.generate(input_ids=system + [7], sampling_params={**GREEDY, "max_new_tokens": 12})
            second = await client.generate(input_ids=system + [8, 9], sampling_params=params)
            turn = await client.generate(input_ids=system + [7] + first["output_ids"] + [11], sampling_params=params)
            await client.flush_cache()
            flushed = await client.generate(input_ids=system + [8, 9], sampling_params=params)
            stats = (await client.server_info())["internal_states"][0]
            return first, second, turn, flushed, stats

    first, second, turn, flushed, stats = run(scenario())
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 40  # the 5 full blocks of the shared system prompt
    # The previous turn had KV for 41 prompt + 11 output tokens (not the last one): 6 full blocks.
    assert turn["meta_info"]["cached_tokens"] == 48
    assert flushed["meta_info"]["cached_tokens"] == 0
    assert flushed["output_ids"] == second["output_ids"]
    assert 0 < stats["prefix_cache_hit_rate"] < 1


def test_requests_beyond_kv_capacity_queue_and_all_complete(model_dir, model):
    batch = prompts(16, start_len=10, step=3)

    async def scenario():
        # 48 blocks of 4 tokens (4 KiB each): two or three requests at a time; the rest must wait.
        async with served(model_dir, kv_cache_mib=0.188, block_size=4, max_seq_len=128) as client:
            outs = await asyncio.gather(*(client.generate(
                input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 30}) for p in batch))
            return outs, (await client.server_info())["internal_states"][0]

    outs, stats = run(scenario())
    for prompt, out in zip(batch, outs):
        assert out["output_ids"] == greedy_under_full_forward(model, prompt, out["output_ids"])
    assert stats["num_blocks"] == 48 and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_retractions"] > 0


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"sampling_params": {}}).encode(), "exactly one of text and input_ids"),
    (json.dumps({"input_ids": "1 2 3"}).encode(), "input_ids"),
    (json.dumps({"input_ids": [1, 2.5]}).encode(), "input_ids"),
    (json.dumps({"input_ids": [1, 99999]}).encode(), "vocabulary"),
    (json.dumps({"input_ids": []}).encode(), "empty"),
    (json.dumps({"input_ids": [1] * 5000}).encode(), "context length"),
    (json.dumps({"input_ids": [1], "sampling_params": {"temperature": "hot"}}).encode(), "temperature"),
    (json.dumps({"input_ids": [1], "sampling_params": {"top_p": 1.5}}).encode(), "top_p"),
    (json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens"),
    (json.dumps({"input_ids": [1], "sampling_params": {"presence_penalty": 1.0}}).encode(), "presence_penalty"),
    (json.dumps({"input_ids": [1], "sampling_params": [{}]}).encode(), "sampling_params"),
    (json.dumps({"input_ids": [1], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"input_ids": [1], "return_routed_experts": True}).encode(), "mixture-of-experts"),
    (json.dumps({"input_ids": [1], "image_data": "cat.png"}).encode(), "image_data"),
    (json.dumps({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}).encode(), "logprob_start_len"),
    (json.dumps({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": "2"}).encode(), "top_logprobs_num"),
    (json.dumps({"input_ids": [[1], [2]], "logprob_start_len": [0]}).encode(), "logprob_start_len"),
]


def test_bad_requests_get_400_naming_the_problem_and_the_server_keeps_serving(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            answers = []
            async with aiohttp.ClientSession() as http:
                for body, _ in BAD_REQUESTS:
                    async with http.post(client.base_url + "/generate", data=body) as response:
                        answers.append((response.status, (await response.json())["error"]["message"]))
                for path, body in (("/pause_generation", {"mode": "sleep"}), ("/abort_request", {}),
                                   ("/update_weights_from_disk", {"model_path": 3})):
                    async with http.post(client.base_url + path, json=body) as response:
                        answers.append((response.status, await response.text()))
            ok = await client.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 2})
            return answers, ok

    answers, ok = run(scenario())
    for (status, message), (_, expected) in zip(answers, BAD_REQUESTS):
        assert status == 400 and expected in message, (expected, status, message)
    assert [status for status, _ in answers[len(BAD_REQUESTS):]] == [400, 400, 400]
    assert "mode 'sleep'" in answers[len(BAD_REQUESTS)][1]
    assert ok["meta_info"]["completion_tokens"] == 2


def test_routed_experts_over_http_match_the_models_routing(tmp_path):
    moe_dir = init_model("qwen3_moe", "tiny", tmp_path / "moe", seed=0, init_std=LIVELY_STD)
    moe = load_pretrained(moe_dir)
    prompt = prompts(1, start_len=9)[0]

    async def scenario():
        async with served(moe_dir) as client:
            return await client.generate(input_ids=prompt, return_routed_experts=True,
                                         sampling_params={**GREEDY, "max_new_tokens": 5})

    out = run(scenario())
    num_layers, top_k = len(moe.config.moe_layer_indices), moe.config.num_experts_per_tok
    experts_TLk = decode_routed_experts(out["meta_info"]["routed_experts"], num_layers, top_k)
    ids = prompt + out["output_ids"]
    with torch.inference_mode():
        _, expected_L1Tk = moe(torch.tensor([ids[:-1]]), return_routed_experts=True)
    assert experts_TLk.shape == (len(ids) - 1, num_layers, top_k)
    assert torch.equal(experts_TLk.sort(-1).values, expected_L1Tk[:, 0].transpose(0, 1).sort(-1).values.int())


def test_cli_serve_engine_serves_until_sigterm(model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "miles_async.launch.cli", "serve", "engine", "--model", str(model_dir), "--port", "0",
         "--kv-cache-mib", "4", "--served-model-name", "tiny-cli"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        line = process.stdout.readline()  # printed once listening
        assert "serving" in line, process.stderr.read() if process.poll() is not None else line
        url = line.rsplit(" on ", 1)[1].strip()

        async def scenario():
            async with EngineClient(url, timeout_s=30) as client, aiohttp.ClientSession() as http:
                await client.wait_healthy(timeout_s=30)
                async with http.get(f"{url}/v1/models") as response:
                    listed = await response.json()
                return listed, await client.generate(text="hello", sampling_params={**GREEDY, "max_new_tokens": 3})

        listed, out = run(scenario())
        assert out["meta_info"]["completion_tokens"] == 3 and [m["id"] for m in listed["data"]] == ["tiny-cli"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_cli_serve_session_takes_the_engines_tokenizer_and_served_name(model_dir):
    """`miles-async serve session --engine URL` asks the engine for its tokenizer and its served name."""
    async def scenario():
        engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=4))
        async with EngineServer(engine, served_model_name="tiny-cli") as server:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "miles_async.launch.cli", "serve", "session", "--engine", server.url,
                "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                line = (await process.stdout.readline()).decode()  # printed once listening
                assert " on http" in line, (await process.stderr.read()).decode() if not line else line
                url = line.split(" on ", 1)[1].split()[0]
                async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as response:
                    names = [m["id"] for m in (await response.json())["data"]]
                process.send_signal(signal.SIGTERM)
                return names, await process.wait()
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()

    assert run(scenario()) == (["tiny-cli"], 0)


def test_an_api_key_is_required_when_set(model_dir):
    """A multi-node run's engines listen off loopback: without the key, every route answers 401."""
    async def main():
        engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8))
        async with EngineServer(engine, api_key="k3y") as server:
            async with EngineClient(server.url, timeout_s=TIMEOUT_S) as anonymous:
                for call in (anonymous.server_info(), anonymous.generate(input_ids=[5, 6], sampling_params={})):
                    with pytest.raises(EngineHTTPError) as refused:
                        await call
                    assert refused.value.status == 401 and "API key" in refused.value.message
            async with EngineClient(server.url, timeout_s=TIMEOUT_S, api_key="wrong") as wrong:
                with pytest.raises(EngineHTTPError):
                    await wrong.server_info()
            async with EngineClient(server.url, timeout_s=TIMEOUT_S, api_key="k3y") as keyed:
                out = await keyed.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "temperature": 0})
                assert len(out["output_ids"]) == 2

    run(main())


def test_prompt_log_probs_and_top_k_over_http_in_sglangs_shape(model_dir, model):
    tokenizer = load_tokenizer(model_dir)
    batch = prompts(2, start_len=12)

    async def scenario():
        async with served(model_dir) as client:
            return await client.generate(input_ids=batch, sampling_params={**GREEDY, "max_new_tokens": 3},
                                         return_logprob=True, logprob_start_len=[4, 0], top_logprobs_num=2,
                                         return_text_in_logprobs=True)

    outs = run(scenario())
    for prompt, start, out in zip(batch, (4, 0), outs):
        meta = out["meta_info"]
        with torch.inference_mode():
            logp_TV = torch.log_softmax(model(torch.tensor([prompt]))[0], dim=-1)
        inputs = meta["input_token_logprobs"]
        assert [t for _, t, _ in inputs] == prompt[start:] and inputs[0][0] is None
        assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(
            [float(logp_TV[p - 1, prompt[p]]) for p in range(start + 1, len(prompt))], abs=1e-4)
        assert all(text == tokenizer.decode([t]) for _, t, text in inputs)
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and all(len(top) == 2 and top[0][0] >= top[1][0] for top in tops[1:])
        assert [top[0][1] for top in meta["output_top_logprobs"]] == out["output_ids"]  # greedy: the most likely


def test_abort_request_matches_a_rid_prefix_and_a_batch_rid_is_a_prefix(model_dir):
    async def scenario():
        async with served(model_dir) as client:
            await client.pause("in_place")  # everything stays in flight until aborted
            batch = asyncio.create_task(client.generate(input_ids=[[5, 6], [7, 8]], rid="grp",
                                                        sampling_params={**GREEDY, "max_new_tokens": 50}))
            other = asyncio.create_task(client.generate(input_ids=[5, 6], rid="solo",
                                                        sampling_params={**GREEDY, "max_new_tokens": 5}))
            while (await client.server_info())["internal_states"][0]["num_waiting"] < 3:
                await asyncio.sleep(0.01)
            await client.abort("grp")  # "grp_0" and "grp_1"
            aborted = await batch
            await client.resume()
            return aborted, await other

    aborted, other = run(scenario())
    assert [o["meta_info"]["id"] for o in aborted] == ["grp_0", "grp_1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in aborted)
    assert other["meta_info"]["finish_reason"]["type"] == "length"


def test_information_endpoints_have_sglangs_shapes(model_dir):
    async def scenario():
        async with served(model_dir) as client, aiohttp.ClientSession() as http:
            answers = {}
            for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info", "/get_load",
                         "/v1/loads", "/v1/models"):
                async with http.get(client.base_url + path) as response:
                    answers[path] = (response.status, await response.json())
            return answers

    answers = run(scenario())
    assert all(status == 200 for status, _ in answers.values())
    info = answers["/model_info"][1]
    assert info == answers["/get_model_info"][1] and "is_moe" not in info
    assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    server = answers["/server_info"][1]
    assert server.keys() == answers["/get_server_info"][1].keys()
    assert server["model_path"] == str(model_dir) and server["dp_size"] == 1 and server["page_size"] == 16
    assert server["internal_states"][0]["num_running"] == 0 and not isinstance(server.get("config"), dict)
    assert answers["/get_load"][1] == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert answers["/v1/loads"][1]["loads"][0]["num_running_reqs"] == 0
    assert answers["/v1/models"][1]["data"][0]["id"] == info["served_model_name"] == model_dir.name  # the folder's


def test_weight_version_relabels_and_the_client_reads_labels_back(model_dir):
    prompt = prompts(1, start_len=8)[0]

    async def scenario():
        async with served(model_dir) as client:
            named = await client.update_weight_version("step-7")
            under_name = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})
            numbered = await client.update_weight_version("5")
            with pytest.raises(EngineHTTPError) as older:
                await client.update_weight_version("4")
            under_number = await client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})
            return named, under_name, numbered, older.value, under_number

    named, under_name, numbered, older, under_number = run(scenario())
    assert named["success"] and named["new_version"] == "step-7" and numbered["new_version"] == "5"
    assert older.status == 400 and "older" in older.message
    assert covering_spans(under_name) == [("step-7", 0, 3)] and covering_spans(under_number) == [("5", 0, 3)]
    assert parse_output(under_name, version=9).weight_versions == [VersionSpan(9, 0, 3)]  # a name: the caller's
    assert parse_output(under_number, version=9).weight_versions == [VersionSpan(5, 0, 3)]


def _broadcast_all(group, tensors) -> None:
    for tensor in tensors:
        group.broadcast(tensor.contiguous(), src=0)


def test_weights_over_a_real_gloo_group_from_rank_0_in_buckets(model_dir, tmp_path):
    """The caller is rank 0 of a torch.distributed (gloo) group the engine joins; each bucket's
    tensors are broadcast while its /update_weights_from_distributed call waits. Without a session
    the update goes live when its last weight arrives; with /begin_weight_update, at the end."""
    from miles_async.transport.groups import WeightGroup

    new_dir = init_model("qwen3", "tiny", tmp_path / "new", seed=1, init_std=LIVELY_STD)
    newer_dir = init_model("qwen3", "tiny", tmp_path / "newer", seed=2, init_std=LIVELY_STD)
    prompt = prompts(1, start_len=8)[0]
    params = {**GREEDY, "max_new_tokens": 6}

    async def push(client, group, state, label):
        items = list(state.items())
        buckets = [items[: len(items) // 2], items[len(items) // 2:]]
        answers = []
        for bucket in buckets:
            names = [n for n, _ in bucket]
            call = client.update_weights_from_distributed(
                names, [str(t.dtype).removeprefix("torch.") for _, t in bucket], [list(t.shape) for _, t in bucket],
                group_name="g", weight_version=label)
            answer, _ = await asyncio.gather(call, asyncio.to_thread(_broadcast_all, group, [t for _, t in bucket]))
            answers.append(answer)
            if len(answers) == 1:  # half-way: still the previous weights, and no new label
                answers.append((await client.model_info())["weight_version"])
        return answers

    async def scenario():
        async with served(model_dir, double_buffer=True) as client:
            with pytest.raises(EngineHTTPError, match="init_weights_update_group"):
                await client.update_weights_from_distributed(["x"], ["float32"], [[1]], group_name="g")
            store = WeightGroup.open_store("127.0.0.1", 2, 30.0)
            joined, group = await asyncio.gather(
                client.init_weights_update_group("127.0.0.1", store.port, 1, 2, group_name="g", backend="gloo"),
                asyncio.to_thread(WeightGroup.join, "127.0.0.1", store.port, 0, 2, store=store, name="g",
                                  sglang=True))
            first = await push(client, group, load_pretrained(new_dir).state_dict(), "3")
            after_first = await client.generate(input_ids=prompt, sampling_params=params)
            opened = await client.begin_weight_update()
            second = await push(client, group, load_pretrained(newer_dir).state_dict(), None)
            before_end = await client.generate(input_ids=prompt, sampling_params=params)
            ended = await client.end_weight_update()
            after_second = await client.generate(input_ids=prompt, sampling_params=params)
            destroyed = await client.destroy_weights_update_group("g")
            group.close()
            return joined, first, after_first, opened, second, before_end, ended, after_second, destroyed

    joined, first, after_first, opened, second, before_end, ended, after_second, destroyed = run(scenario())
    assert joined["success"] and opened["success"] and destroyed["success"]
    assert first[0]["success"] and "weight_version" not in first[0] and first[1] == "0"
    assert first[2]["weight_version"] == "3"
    assert after_first["output_ids"] == greedy_loop(load_pretrained(new_dir), prompt, 6)
    assert covering_spans(after_first) == [("3", 0, 6)]
    assert "weight_version" not in second[2] and before_end["output_ids"] == after_first["output_ids"]
    assert ended["weight_version"] == "4"  # no label given: the next integer
    assert after_second["output_ids"] == greedy_loop(load_pretrained(newer_dir), prompt, 6)


def test_tensor_updates_are_refused_and_released_memory_comes_back_empty_until_a_push(model_dir):
    async def scenario():
        async with served(model_dir) as client, aiohttp.ClientSession() as http:
            async def call(method, path, body):
                async with http.request(method, client.base_url + path, json=body) as response:
                    return response.status, await response.json()

            tensor = await call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]})
            destroy = await call("POST", "/destroy_weights_update_group", {"group_name": "none"})
            bad_tags = await call("POST", "/release_memory_occupation", {"tags": ["cuda_graph"]})
            release = await call("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            refused = await call("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
            resume = await call("GET", "/resume_memory_occupation", None)
            still = await call("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
            pushed = await client.update_weights_from_disk(str(model_dir), weight_version="1")
            ok = await client.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 2})
            return tensor, destroy, bad_tags, release, refused, resume, still, pushed, ok

    (tensor_status, tensor), (destroy_status, destroy), bad_tags, release, refused, resume, still, pushed, ok = \
        run(scenario())
    assert tensor_status == 400 and not tensor["success"] and "pickled" in tensor["message"]
    assert destroy_status == 400 and "no weight update group 'none'" in destroy["message"]
    assert bad_tags[0] == 400 and "memory tags must be among weights, kv_cache" in bad_tags[1]["error"]["message"]
    assert release == (200, None) and resume == (200, None)
    assert refused[0] == 503 and "released" in refused[1]["error"]["message"]
    assert still[0] == 503 and "push a complete version" in still[1]["error"]["message"]  # zeros are not served
    assert pushed["success"] and ok["meta_info"]["completion_tokens"] == 2
    assert ok["output_ids"] == greedy_loop(load_pretrained(model_dir), [1, 2, 3], 2)


def test_openai_completions_with_token_prompts_echo_and_logprobs(model_dir, model):
    tokenizer = load_tokenizer(model_dir)
    prompt = prompts(1, start_len=6)[0]

    async def scenario():
        async with served(model_dir) as client, aiohttp.ClientSession() as http:
            async def post(path, body):
                async with http.post(client.base_url + path, json=body) as response:
                    return response.status, await response.json()

            echoed = await post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True, "echo": True, "logprobs": 2})
            texts = await post("/v1/completions", {"prompt": ["def add", "x ="], "max_tokens": 3, "temperature": 0})
            chat = await post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "12 + 34 ="}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 2})
            bad = [await post("/v1/completions", body) for body in (
                {"prompt": [1, 2], "n": 2}, {"prompt": [1, 2], "stream_options": {"include_usage": True}}, {"prompt": 3},
                {"prompt": [1, 2], "max_tokens": -1})]
            bad.append(await post("/v1/chat/completions", {"messages": "hi"}))
            return echoed, texts, chat, bad

    (status, echoed), (_, texts), (_, chat), bad = run(scenario())
    choice = echoed["choices"][0]
    output = greedy_loop(model, prompt, 4)
    assert status == 200 and echoed["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert choice["text"] == tokenizer.decode(prompt + output)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt + output]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(prompt) + 4
    assert logprobs["token_logprobs"][len(prompt):] == pytest.approx(log_probs_of(model, prompt, output), abs=1e-4)
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])] and logprobs["top_logprobs"][0] is None
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert echoed["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
    assert [c["index"] for c in texts["choices"]] == [0, 1] and texts["usage"]["completion_tokens"] <= 6
    message = chat["choices"][0]["message"]
    assert chat["object"] == "chat.completion" and message["role"] == "assistant" and isinstance(message["content"], str)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)
    expected = ["n", "stream_options", "prompt", "max_tokens", "messages"]
    for (status, body), field in zip(bad, expected):  # OpenAI's error shape
        error = body["error"]
        assert status == 400 and field in error["message"] and error["type"] == "invalid_request_error", (field, body)
