"""The TITO session server (miles_async.agents.session) driven by the real `openai` client.

Each test serves a real tiny model (init_model, weights drawn wide so that outputs vary) with the
embedded engine behind `EngineServer`, puts a `SessionServer` in front of it, all on 127.0.0.1 in
the test's own event loop, and talks to it as an agent harness would. A random model does not
write real tool calls, so the tool path is checked by rendering histories that hold assistant
tool calls and tool results (and by tests/unit/test_agents_toolcalls.py). References: the
tokenizer's own rendering, and the engine asked directly for the same input ids.
Later tests drive `TitoTokenizer` (the pure half of the server) with chosen sampled ids, to
check the mismatch accounting on cases a random model cannot be made to produce; the last one runs
the server as the `SessionHost` actor and takes a finished session's trajectory from it.
A sample is a `miles_async.trajectory.Trajectory` with its token arrays inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json

import aiohttp
import msgspec
import numpy as np
import openai
import pytest
import torch
from openai import AsyncOpenAI

from miles_async.actors.sessions import SessionHost, SessionsUrl, TakeSession
from miles_async.agents.session import Checkpoint, Session, SessionServer, TitoTokenizer, parse_chat_request
from miles_async.engine.client import EngineClient
from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.server import EngineServer
from miles_async.models import init_model, load_pretrained, load_tokenizer
from miles_async.runtime import ActorSystem, BlobRef
from miles_async.runtime import run as run_async
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, decode_data

TIMEOUT_S = 30
pytestmark = pytest.mark.timeout(TIMEOUT_S + 10)
LIVELY_STD = 0.3
GREEDY = {"temperature": 0.0, "max_tokens": 8}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
TOOL_HISTORY = [
    SYSTEM,
    {"role": "user", "content": "What is 3 * (4 + 5)?"},
    {"role": "assistant", "content": "I will call the calculator.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps({"expression": "3 * (4 + 5)"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "27"},
    {"role": "user", "content": "Check it again, please."},
]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@contextlib.asynccontextmanager
async def served(model_dir, num_engines: int = 1, api_key: str | None = None):
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for _ in range(num_engines):
            engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8, block_size=8))
            urls.append((await stack.enter_async_context(EngineServer(engine))).url)
        server = await stack.enter_async_context(SessionServer(urls, model_dir, api_key=api_key))
        yield server, urls


def client_for(server: SessionServer, session_id: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/sessions/{session_id}/v1", api_key="x", max_retries=0,
                       timeout=TIMEOUT_S)


def reply_message(completion) -> dict:
    message = completion.choices[0].message
    out = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return out


def extras(completion) -> tuple[list[int], list[int]]:
    """(the prompt ids the server sent, the ids the engine sampled), vLLM's extra fields."""
    return completion.model_extra["prompt_token_ids"], completion.choices[0].model_extra["token_ids"]


def joined(parts: tuple[list[int], list[int]]) -> list[int]:
    return parts[0] + parts[1]


def tokens_of(sample: Trajectory) -> list[int]:
    assert isinstance(sample.data, TokenData)  # the session server's samples carry their arrays inline
    return sample.data.token_ids().tolist()


async def http_json(method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.request(method, url, **kwargs) as response:
        return response.status, await response.json()


def test_three_turns_with_tool_history_are_token_exact(model_dir, tokenizer):
    async def scenario():
        async with served(model_dir) as (server, urls):
            client = client_for(server, "s1")
            messages, completions = list(TOOL_HISTORY), []
            for follow_up in ({"role": "tool", "tool_call_id": "call_2", "content": "27, again"},
                              {"role": "user", "content": "Thanks."}, None):
                completion = await client.chat.completions.create(
                    model="tiny", messages=messages, tools=TOOLS, logprobs=True, **GREEDY)
                completions.append((list(messages), completion))
                messages += [reply_message(completion)] + ([follow_up] if follow_up else [])
            async with EngineClient(urls[0], timeout_s=TIMEOUT_S) as engine:
                direct = [await engine.generate(input_ids=extras(c)[0], sampling_params={
                    "temperature": 0.0, "max_new_tokens": 8}) for _, c in completions]
            status, body = await http_json("GET", f"{server.url}/sessions/s1/samples")
            return completions, direct, status, body, server.samples("s1"), server.stats()

    completions, direct, status, body, samples, stats = run(scenario())
    # Turn 1 is the template, rendered with the tools and the tool-call history, and tokenized.
    first_messages, first = completions[0]
    rendered = tokenizer.apply_chat_template(first_messages, tools=TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call>' in rendered
    assert "<tool_response>\n27\n</tool_response>" in rendered
    assert extras(first)[0] == tokenizer.encode(rendered)
    # Each turn extends the last one's ids as sampled; the engine asked directly samples the same ids.
    for (_, before), (_, after) in itertools.pairwise(completions):
        prompt, output = extras(before)
        assert extras(after)[0][:len(prompt) + len(output)] == prompt + output
    for (_, completion), out in zip(completions, direct):
        assert extras(completion)[1] == out["output_ids"]
        assert completion.usage.completion_tokens == len(out["output_ids"])
    # One linear history: one sample, its tokens the last prompt + output, mask 1 exactly on outputs.
    assert status == 200 and len(body["samples"]) == 1 and body["metadata"]["num_turns"] == 3
    (sample,) = samples
    # The JSON is the Trajectory itself (arrays as base64): it decodes back to the very same record.
    assert body["samples"][0] == json.loads(json.dumps(body["samples"][0]))
    assert msgspec.convert(body["samples"][0], Trajectory) == sample
    last_prompt, last_output = extras(completions[-1][1])
    assert tokens_of(sample) == last_prompt + last_output and sample.num_turns == 3
    assert sample.num_tokens == len(last_prompt + last_output) and sample.num_prompt_tokens == len(extras(first)[0])
    mask = sample.data.mask()
    generated = sample.data.token_ids()[mask == 1].tolist()
    assert generated == [t for _, c in completions for t in extras(c)[1]]
    assert sample.num_generated_tokens == len(generated)
    spans, position = [], 0
    for _, completion in completions:
        prompt, output = extras(completion)
        spans += [0] * (len(prompt) - position) + [1] * len(output)
        position = len(prompt) + len(output)
    assert mask.tolist() == spans
    logprobs = [e.logprob for _, c in completions for e in c.choices[0].logprobs.content]
    rollout_logprobs = sample.data.logprob_array()  # float32, as the trainer reads them
    np.testing.assert_array_equal(rollout_logprobs[mask == 1], np.asarray(logprobs, dtype=np.float32))
    assert (rollout_logprobs[mask == 0] == 0.0).all()
    # Every turn's output sampled under version 0: one span per turn, over the trajectory's positions.
    assert sample.versions == tuple(VersionSpan(0, len(extras(c)[0]), len(joined(extras(c)))) for _, c in completions)
    assert sample.weight_versions == (0,)
    assert [e.token for e in completions[0][1].choices[0].logprobs.content] == [
        tokenizer.decode([t]) for t in extras(completions[0][1])[1]]
    # The append-only check: counted exactly when re-tokenizing the whole rendering disagrees.
    final_messages = completions[-1][0]
    retokenized = tokenizer.encode(tokenizer.apply_chat_template(final_messages, tools=TOOLS,
                                                                 add_generation_prompt=True))
    assert (body["metadata"]["num_mismatches"] > 0) == (retokenized != last_prompt)
    assert sample.num_tito_mismatches == body["metadata"]["num_mismatches"]  # one branch: every turn is on it
    assert stats["num_turns"] == 3 and stats["num_sessions"] == 1
    assert stats["cached_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1


def test_a_rewritten_history_branches_and_each_leaf_is_a_sample(model_dir):
    async def turn(client, messages):
        completion = await client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
        return completion, messages + [reply_message(completion)]

    async def scenario():
        async with served(model_dir) as (server, _):
            client = client_for(server, "b")
            first, history = await turn(client, [{"role": "user", "content": "Name a prime number."}])
            second, _ = await turn(client, history + [{"role": "user", "content": "Another one."}])
            _, rewritten_history = await turn(client, [{"role": "user", "content": "Name an even number."}])
            await turn(client, rewritten_history + [{"role": "user", "content": "A larger one."}])
            before_branch = len(server.samples("b"))
            middle, _ = await turn(client, history + [{"role": "user", "content": "Why?"}])
            return first, second, middle, before_branch, server.samples("b")

    first, second, middle, before_branch, samples = run(scenario())
    assert before_branch == 2
    assert [s.num_turns for s in samples] == [2, 2, 2]
    linear, rewritten, branch = samples
    shared = extras(first)[0] + extras(first)[1]
    assert tokens_of(linear)[:len(shared)] == shared == tokens_of(branch)[:len(shared)]
    assert tokens_of(linear) == joined(extras(second)) and tokens_of(branch) == joined(extras(middle))
    assert tokens_of(rewritten)[:len(shared)] != shared
    for sample in samples:
        assert sample.num_tokens == len(tokens_of(sample)) == len(sample.data.mask()) == len(sample.data.logprob_array())


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(model_dir):
    async def scenario():
        async with served(model_dir) as (server, _):
            url = f"{server.url}/sessions/e/v1/chat/completions"
            user = [{"role": "user", "content": "hi"}]
            replies = [await http_json("POST", url, data=b"{not json")]
            for body in ({"messages": user, "n": 2}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                         {"messages": user, "top_logprobs": 3, "logprobs": True},
                         {"messages": user, "tool_choice": "required", "tools": TOOLS},
                         {"messages": user, "temperature": "hot"}, {"messages": user, "max_tokens": 0},
                         {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}):
                replies.append(await http_json("POST", url, json=body))
            replies.append(await http_json("GET", f"{server.url}/sessions/nobody/samples"))
            with pytest.raises(openai.BadRequestError) as refused:
                await client_for(server, "e").chat.completions.create(model="tiny", messages=user, n=2)
            ok = await client_for(server, "e").chat.completions.create(model="tiny", messages=user, **GREEDY)
            return replies, refused.value, ok

    replies, refused, ok = run(scenario())
    statuses = [status for status, _ in replies]
    assert statuses == [400] * 9 + [404]
    for _, body in replies:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    messages = [body["error"]["message"] for _, body in replies]
    assert "not valid JSON" in messages[0] and "n=2" in messages[1] and "non-empty" in messages[2]
    assert "robot" in messages[3] and "top_logprobs" in messages[4] and "tool_choice" in messages[5]
    assert "temperature" in messages[6] and "max_tokens" in messages[7] and "system" in messages[8]
    assert replies[1][1]["error"]["param"] == "n" and replies[9][1]["error"]["code"] == "session_not_found"
    assert refused.status_code == 400 and "n=2" in refused.message
    assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streaming_returns_the_same_turn_as_a_plain_request(model_dir):
    messages = [SYSTEM, {"role": "user", "content": "Count from one to ten."}]

    async def scenario():
        async with served(model_dir) as (server, _):
            plain = await client_for(server, "plain").chat.completions.create(
                model="tiny", messages=messages, temperature=0.0, max_tokens=24)
            stream = await client_for(server, "streamed").chat.completions.create(
                model="tiny", messages=messages, temperature=0.0, max_tokens=24, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            bare = await client_for(server, "bare").chat.completions.create(
                model="tiny", messages=messages, temperature=0.0, max_tokens=24, stream=True, logprobs=True)
            bare_chunks = [chunk async for chunk in bare]
            header = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                 default_headers={"X-Session-Id": "by-header"})
            await header.chat.completions.create(model="tiny", messages=messages, temperature=0.0, max_tokens=4)
            return plain, chunks, bare_chunks, server.samples("plain"), server.samples("streamed"), set(server.sessions)

    plain, chunks, bare, plain_samples, streamed_samples, sessions = run(scenario())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == plain.choices[0].message.content
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    # The engine server's shapes (tests/e2e/test_engine_openai.py): usage last, alone, when asked for.
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert all(c.choices and c.usage is None for c in bare)
    assert len(bare[-1].choices[0].logprobs.content) == plain.usage.completion_tokens
    assert tokens_of(streamed_samples[0]) == tokens_of(plain_samples[0])
    assert "by-header" in sessions


def test_at_one_base_url_the_body_names_the_session_before_the_header(model_dir):
    """Verifiers' interception reaches every rollout's model at one base URL and sends its own trace
    id as X-Session-ID; the session the turn belongs to rides in the body (`session_id`)."""
    messages = [SYSTEM, {"role": "user", "content": "Count to three."}]

    async def scenario():
        async with served(model_dir) as (server, _):
            shared = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                 default_headers={"X-Session-Id": "trace-1"})
            for session_id in ("episode-a", "episode-b"):
                await shared.chat.completions.create(model="tiny", messages=messages,
                                                     extra_body={"session_id": session_id}, **GREEDY)
            with pytest.raises(openai.BadRequestError) as refused:
                await shared.chat.completions.create(model="tiny", messages=messages, extra_body={"session_id": 7},
                                                     **GREEDY)
            return set(server.sessions), refused.value

    sessions, refused = run(scenario())
    assert sessions == {"episode-a", "episode-b"}
    assert refused.status_code == 400 and "session_id" in refused.message


def test_two_engines_keep_each_session_on_its_engine(model_dir):
    async def scenario():
        async with served(model_dir, num_engines=2) as (server, urls):
            histories = {"a": [SYSTEM, {"role": "user", "content": "Tell me a story."}],
                         "b": [SYSTEM, {"role": "user", "content": "Sort the list 3, 1, 2."}]}
            for turn in range(3):
                completions = await asyncio.gather(*(client_for(server, sid).chat.completions.create(
                    model="tiny", messages=histories[sid], **GREEDY) for sid in sorted(histories)))
                for sid, completion in zip(sorted(histories), completions):
                    histories[sid] += [reply_message(completion), {"role": "user", "content": f"And {turn}?"}]
            engine_prompts = []
            for url in urls:
                async with EngineClient(url, timeout_s=TIMEOUT_S) as engine:
                    engine_prompts.append((await engine.server_info())["internal_states"][0]["num_prompt_tokens"])
            return {sid: s.stats() for sid, s in server.sessions.items()}, server.stats(), engine_prompts

    sessions, stats, engine_prompts = run(scenario())
    assert sorted(s["engine_index"] for s in sessions.values()) == [0, 1]
    assert [e["num_requests"] for e in stats["engines"]] == [3, 3]
    assert [e["num_sessions"] for e in stats["engines"]] == [1, 1]
    by_engine = {s["engine_index"]: s["prompt_tokens"] for s in sessions.values()}
    assert engine_prompts == [by_engine[0], by_engine[1]]  # each engine saw exactly its session's turns
    assert all(s["cached_tokens"] > 0 for s in sessions.values())  # later turns hit the prefix cache


def test_a_lost_engine_gets_no_more_sessions_and_its_sessions_move_on(model_dir):
    """The controller removes an engine it lost and adds one that joined: the sessions follow."""
    async def scenario():
        async with served(model_dir, num_engines=2) as (server, urls):
            history = {sid: [SYSTEM, {"role": "user", "content": "Tell me a story."}] for sid in ("a", "b")}
            first = await asyncio.gather(*(client_for(server, sid).chat.completions.create(
                model="tiny", messages=history[sid], **GREEDY) for sid in ("a", "b")))
            on_lost = next(sid for sid in ("a", "b") if server.sessions[sid].engine_index == 0)
            await server.remove_engine(urls[0])
            history[on_lost] += [reply_message(first[0 if on_lost == "a" else 1]), {"role": "user", "content": "More."}]
            await client_for(server, on_lost).chat.completions.create(model="tiny", messages=history[on_lost], **GREEDY)
            moved = server.sessions[on_lost].engine_index
            await client_for(server, "c").chat.completions.create(model="tiny", messages=history["a"][:2], **GREEDY)
            new = server.sessions["c"].engine_index
            await server.remove_engine(urls[1])
            with pytest.raises(openai.InternalServerError, match="no engine is left"):
                await client_for(server, "d").chat.completions.create(model="tiny", messages=history["a"][:2],
                                                                      **GREEDY)
            server.add_engine(urls[1])  # the same engine back, as a new slot: it serves again
            await client_for(server, "e").chat.completions.create(model="tiny", messages=history["a"][:2], **GREEDY)
            return moved, new, server.sessions["e"].engine_index, server.stats()["engines"]

    moved, new, back, engines = run(scenario())
    assert moved == 1 and new == 1 and back == 2
    assert [e["alive"] for e in engines] == [False, False, True]
    assert engines[0]["num_sessions"] == 0  # the moved session left it


def test_a_session_server_with_an_api_key_refuses_requests_without_it(model_dir):
    """Off loopback (a multi-node run) the server wants the run's key, as the engines do."""
    async def scenario():
        async with served(model_dir, api_key="k" * 16) as (server, _):
            messages = [SYSTEM, {"role": "user", "content": "Hi."}]
            for key in ("x", "-"):
                client = AsyncOpenAI(base_url=f"{server.url}/sessions/s/v1", api_key=key, max_retries=0,
                                     timeout=TIMEOUT_S)
                with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
                    await client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
            client = AsyncOpenAI(base_url=f"{server.url}/sessions/s/v1", api_key="k" * 16, max_retries=0,
                                 timeout=TIMEOUT_S)
            await client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
            return list(server.sessions)

    assert run(scenario()) == ["s"]  # only the keyed request opened a session


# ----- TitoTokenizer with chosen sampled ids -----


def turn_one(tito: TitoTokenizer, output_ids: list[int]) -> tuple[list[dict], Checkpoint]:
    messages = [SYSTEM, {"role": "user", "content": "Say hello."}]
    request = parse_chat_request({"messages": messages}, "tiny")
    prompt = tito.prompt(request, None)
    reply = {"role": "assistant", "content": "Hello there."}
    key = parse_chat_request({"messages": [reply]}, "tiny").keys[0]
    checkpoint = tito.checkpoint(request, prompt, key, output_ids, [-0.5] * len(output_ids),
                                 [VersionSpan(0, 0, len(output_ids))], "stop")
    return messages + [reply, {"role": "user", "content": "Again."}], checkpoint


@pytest.mark.parametrize("sampled, mismatch, template_mismatch", [
    ("canonical", False, False),      # the ids the tokenizer itself gives, then <|im_end|>
    ("no_eos", False, False),         # cut by max_tokens: the template's close is added, unmasked
    ("split", True, False),           # same text, other ids: kept as sampled, and counted
    ("stop_string", True, True),      # text the template does not write for the reply: counted too
])
def test_tito_reuses_sampled_ids_and_counts_disagreements(tokenizer, sampled, mismatch, template_mismatch):
    tito = TitoTokenizer(tokenizer)
    im_end = tokenizer.eos_token_id
    output_ids = {
        "canonical": tokenizer.encode("Hello there.") + [im_end],
        "no_eos": tokenizer.encode("Hello there."),
        "split": [i for ch in "Hello there." for i in tokenizer.encode(ch)] + [im_end],
        "stop_string": tokenizer.encode("Hello there. STOP"),
    }[sampled]
    assert sampled != "split" or output_ids != tokenizer.encode("Hello there.") + [im_end]
    messages, checkpoint = turn_one(tito, output_ids)
    request = parse_chat_request({"messages": messages}, "tiny")
    assert tito.deepest_checkpoint(Session("s", 0, checkpoints=[checkpoint]), request) is checkpoint
    prompt = tito.prompt(request, checkpoint)
    full_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert prompt.input_ids[:len(checkpoint.tokens)] == checkpoint.tokens  # sampled ids reused as they are
    assert (prompt.mismatch, prompt.template_mismatch) == (mismatch, template_mismatch)
    assert (prompt.input_ids == full_ids) == (not mismatch)
    suffix_text = tokenizer.decode(prompt.input_ids[len(checkpoint.tokens):])
    assert suffix_text.endswith("<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    assert suffix_text.startswith("<|im_end|>\n" if im_end not in output_ids else "\n")
    after = tito.checkpoint(request, prompt, "k", [7, 8], [-1.0, -2.0], [VersionSpan(1, 0, 2)], "length")
    assert after.loss_mask == checkpoint.loss_mask + [0] * (len(prompt.input_ids) - len(checkpoint.tokens)) + [1, 1]
    # The spans over each turn's output move to the trajectory's positions: exactly the masked tokens.
    first_output = len(checkpoint.tokens) - len(output_ids)
    assert after.num_mismatches == int(mismatch) and after.weight_versions == [
        VersionSpan(0, first_output, len(checkpoint.tokens)),
        VersionSpan(1, len(prompt.input_ids), len(prompt.input_ids) + 2)]
    assert [i for i, m in enumerate(after.loss_mask) if m] == [
        i for span in after.weight_versions for i in range(span.start, span.end)]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model taught (overfit on) one calculator conversation, so it emits a real tool call."""
    from miles_async.models import save_pretrained
    from miles_async.tasks.calculator import Problem, sft_examples

    folder = init_model("qwen3", "tiny", tmp_path_factory.mktemp("tool"), seed=0)
    model = load_pretrained(folder)
    tokens, mask = sft_examples([Problem(problem_id=0, a=12, b=34)], load_tokenizer(folder))[0]
    ids = torch.tensor([tokens])
    targets = torch.tensor([t if m else -100 for t, m in zip(tokens[1:], mask[1:])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(ids)[0, :-1], targets, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.05, float(loss.detach())
    save_pretrained(model, folder)
    return folder


def test_a_model_that_calls_a_tool_gets_openai_tool_calls_and_a_masked_trajectory(tool_model_dir):
    from miles_async.tasks.calculator import TOOLS

    async def main():
        async with served(tool_model_dir) as (server, _):
            client = client_for(server, "calc")
            messages = [{"role": "user", "content": "m:12*34="}]
            first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                                         max_tokens=40)
            call = first.choices[0].message.tool_calls[0]
            messages += [reply_message(first), {"role": "tool", "tool_call_id": call.id, "content": "408"}]
            second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                                          max_tokens=40)
            status, body = await http_json("GET", f"{server.url}/sessions/calc/samples")
            return first, second, status, body

    first, second, status, body = run(main())
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "multiply",
                                                                                      {"a": 12, "b": 34})
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "408"
    assert status == 200 and len(body["samples"]) == 1
    sample = msgspec.convert(body["samples"][0], Trajectory)
    generated = sample.data.token_ids()[sample.data.mask() == 1].tolist()
    assert generated == extras(first)[1] + extras(second)[1]  # exactly the sampled ids, both turns
    assert sample.num_turns == 2 and sample.finish_reason == "stop"


def test_a_moe_engine_s_routed_experts_ride_in_the_session_sample():
    async def main(folder):
        async with served(folder) as (server, _):
            client = client_for(server, "moe")
            messages = [{"role": "user", "content": "hello"}]
            first = await client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
            messages += [reply_message(first), {"role": "user", "content": "again"}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
            return server.samples("moe")[-1], load_pretrained(folder).config

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sample, config = run(main(init_model("qwen3_moe", "tiny", tmp, seed=0, init_std=LIVELY_STD)))
    experts = sample.data.experts()
    num_layers, top_k = len(config.moe_layer_indices), config.num_experts_per_tok
    assert experts.shape == (sample.num_tokens - 1, num_layers, top_k)  # every token but the last
    assert experts.min() >= 0 and experts.max() < config.num_experts
    assert sample.data.experts_dtype == "uint8"  # fewer than 256 experts: one byte each


def test_take_session_returns_the_latest_branch_with_its_arrays_in_the_data_plane(model_dir):
    """`actors.sessions.TakeSession`, as a rollout worker sends it when an episode is over: the
    `SessionHost` actor in a real ActorSystem, its server in front of a real embedded engine."""
    async def turn(client, messages):
        completion = await client.chat.completions.create(model="tiny", messages=messages, logprobs=True, **GREEDY)
        return completion, messages + [reply_message(completion)]

    async def scenario():
        engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8, block_size=8))
        async with EngineServer(engine) as engine_server, ActorSystem() as system:
            host = await system.spawn(SessionHost, "sessions", args=([engine_server.url], str(model_dir)))
            url = await host.ask(SessionsUrl(), timeout_s=TIMEOUT_S)
            client = AsyncOpenAI(base_url=f"{url}/sessions/ep/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
            first, _ = await turn(client, [{"role": "user", "content": "Name a prime number."}])
            second, history = await turn(client, [{"role": "user", "content": "Name an even number."}])  # a new root
            third, _ = await turn(client, history + [{"role": "user", "content": "A larger one."}])
            taken = await host.ask(TakeSession(session_id="ep"), timeout_s=TIMEOUT_S)
            assert isinstance(taken.data, BlobRef)
            data = decode_data(await system.dataplane.read(taken.data))
            num_blobs = system.dataplane.stats.num_blobs
            again = await host.ask(TakeSession(session_id="ep"), timeout_s=TIMEOUT_S)
            unknown = await host.ask(TakeSession(session_id="nobody"), timeout_s=TIMEOUT_S)
            status, _ = await http_json("GET", f"{url}/sessions/ep/samples")
            system.dataplane.free([taken.data])  # the consumer's part
            return (first, second, third), taken, data, num_blobs, again, unknown, status, system.dataplane.stats

    completions, taken, data, num_blobs, again, unknown, status, stats = run_async(
        asyncio.wait_for(scenario(), TIMEOUT_S))
    first, second, third = completions
    # The latest branch (the rewritten history, two turns), not the first one the session left behind.
    assert data.token_ids().tolist() == joined(extras(third)) and taken.num_turns == 2
    assert data.token_ids()[:len(joined(extras(second)))].tolist() == joined(extras(second))
    assert data.token_ids()[:len(joined(extras(first)))].tolist() != joined(extras(first))
    mask = data.mask()
    assert data.token_ids()[mask == 1].tolist() == extras(second)[1] + extras(third)[1]
    logprobs = [e.logprob for c in (second, third) for e in c.choices[0].logprobs.content]
    np.testing.assert_array_equal(data.logprob_array()[mask == 1], np.asarray(logprobs, dtype=np.float32))
    assert taken.versions == tuple(VersionSpan(0, len(extras(c)[0]), len(joined(extras(c)))) for c in (second, third))
    assert (taken.num_tokens, taken.num_generated_tokens) == (data.num_tokens, int(mask.sum()))
    assert taken.prompt_tokens_sent == sum(c.usage.prompt_tokens for c in completions)  # the session's, all turns
    assert num_blobs == 1 and stats.num_blobs == 0
    # The session is closed: taking it again, or a session that never was, gives None; HTTP forgets it.
    assert again is None and unknown is None and status == 404


def test_models_metrics_and_unknown_routes_answer_as_the_engine_server_does(model_dir):
    """/v1/models/{id} and its 404, JSON 404/405 for what is not a route, and /metrics under the
    engine server's names, read by prometheus_client's parser, counting a turn."""
    from prometheus_client.parser import text_string_to_metric_families

    async def scenario():
        async with served(model_dir) as (server, _):
            base = server.url
            listed = await http_json("GET", f"{base}/sessions/m/v1/models")
            card = await http_json("GET", f"{base}/v1/models/{server.model}")
            missing = await http_json("GET", f"{base}/v1/models/gpt-4")
            no_route = await http_json("GET", f"{base}/v2/nothing")
            wrong_method = await http_json("GET", f"{base}/v1/chat/completions")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/metrics") as response:
                    before = await response.text()
                completion = await client_for(server, "m").chat.completions.create(
                    model="tiny", messages=[SYSTEM, {"role": "user", "content": "Hi"}], **GREEDY)
                async with http.get(f"{base}/metrics") as response:
                    after, content_type = await response.text(), response.headers["Content-Type"]
            return server.model, listed, card, missing, no_route, wrong_method, before, after, content_type, completion

    (name, listed, card, missing, no_route, wrong_method, before, after, content_type, completion) = run(scenario())
    assert name == model_dir.name and [m["id"] for m in listed[1]["data"]] == [name] and card == (200, listed[1]["data"][0])
    assert missing[0] == 404 and missing[1]["error"]["code"] == "model_not_found"
    assert no_route[0] == 404 and wrong_method[0] == 405
    for _, body in (missing, no_route, wrong_method):
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert content_type.startswith("text/plain; version=0.0.4")

    def samples(text: str) -> dict[str, float]:
        found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}
        assert {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples} == {name}
        return found

    first, then = samples(before), samples(after)
    assert then["sglang:num_requests_total"] - first["sglang:num_requests_total"] == 1
    assert then["sglang:generation_tokens_total"] - first["sglang:generation_tokens_total"] == \
        completion.usage.completion_tokens
    assert then["sglang:prompt_tokens_total"] - first["sglang:prompt_tokens_total"] == completion.usage.prompt_tokens
    assert then["sglang:e2e_request_latency_seconds_count"] == 1 and then["miles_async:sessions_open"] == 1
    assert then["sglang:num_running_reqs"] == 0 and then["miles_async:weight_version"] == 0
