"""The embedded engine's OpenAI face, driven by the real `openai` client; its /metrics read by
prometheus_client's own parser.

One server for the module: a real tiny model (init_model, weights drawn wide so that greedy
output varies and holds multi-byte characters split across tokens) behind `EngineServer` on
127.0.0.1, in an event loop of its own thread, so that the synchronous `openai.OpenAI` client and
plain HTTP talk to it as any user's program would. References: the same server's non-streamed
greedy answers (temperature 0), the tokenizer's own decoding, and the server's counters before and
after a request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.http_base import default_served_model_name
from miles_async.engine.openai import StreamedText
from miles_async.engine.server import EngineServer
from miles_async.models import load_tokenizer

TIMEOUT_S = 30
pytestmark = pytest.mark.timeout(TIMEOUT_S + 30)
# Its greedy continuation (24 tokens, this module's model) holds a character whose bytes come in two tokens.
PROMPT = "🎉 party"
MESSAGES = [{"role": "user", "content": "🎉 party"}]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


class ThreadServer:
    """An `EngineServer` in an event loop on its own thread (started by `start`, stopped by `stop`)."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.url = ""

    async def _serve(self) -> None:
        self.stopping = asyncio.Event()
        engine = Engine.from_pretrained(str(self.model_dir), config=EngineConfig(kv_cache_mib=16, block_size=8))
        async with EngineServer(engine) as server:
            self.url = server.url
            self.ready.set()
            await self.stopping.wait()

    def start(self) -> ThreadServer:
        self.thread.start()
        assert self.ready.wait(TIMEOUT_S), "the server did not start"
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(TIMEOUT_S)
        self.loop.close()


@pytest.fixture(scope="module")
def server(model_dir):
    served = ThreadServer(model_dir).start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def name(model_dir):
    return model_dir.name  # the served name by default: the folder's


def http(method: str, url: str, body: bytes | dict | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of a plain request."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics(server) -> dict[str, dict]:
    """family name -> {sample name: value}, parsed by prometheus_client (labels checked once here)."""
    status, headers, text = http("GET", f"{server.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {f.name: {(s.name, s.labels.get("le")): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def splits_a_character(tokenizer, token_ids: list[int]) -> bool:
    """Whether a character of the decoded text has its bytes in more than one token."""
    for k in range(1, len(token_ids)):
        before, after = tokenizer.decode(token_ids[:k]), tokenizer.decode(token_ids[:k + 1])
        if before.endswith("\ufffd") and after[len(before) - 1] not in "\ufffd":
            return True
    return False


def test_streamed_completions_equal_the_greedy_text_with_usage_and_logprobs(server, client, name, model_dir):
    tokenizer = load_tokenizer(model_dir)
    plain = client.completions.create(model=name, prompt=PROMPT, logprobs=1, **GREEDY)
    chunks = list(client.completions.create(model=name, prompt=PROMPT, logprobs=1, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = plain.choices[0].text
    _, _, native = http("POST", f"{server.url}/generate", {"text": PROMPT, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 24}})
    sampled = json.loads(native)
    assert sampled["text"] == text and splits_a_character(tokenizer, sampled["output_ids"])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert all(c.object == "text_completion" and c.model == name for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    reference = plain.choices[0].logprobs
    assert [t for lp in streamed for t in lp.tokens] == reference.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(reference.token_logprobs)
    assert [o for lp in streamed for o in lp.text_offset] == reference.text_offset


def test_streamed_completions_of_several_prompts_with_echo_and_a_stop_string(client, name):
    prompts = [PROMPT, "12 + 34 =", [5, 6, 7]]
    kwargs = {"model": name, "prompt": prompts, "echo": True, "logprobs": 0, "stop": ["ev"], **GREEDY}
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "stop" in [c.finish_reason for c in plain.choices]  # the stop string is met, and cut
    for i, reference in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == reference.text
        assert [t for c in mine for t in c.logprobs.tokens] == reference.logprobs.tokens
        assert [o for c in mine for o in c.logprobs.text_offset] == reference.logprobs.text_offset
        assert [c.finish_reason for c in mine if c.finish_reason] == [reference.finish_reason]
    assert chunks[-1].usage == plain.usage


def test_streamed_chat_equals_the_greedy_reply_with_role_finish_and_usage(client, name):
    plain = client.chat.completions.create(model=name, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    chunks = list(client.chat.completions.create(model=name, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == plain.choices[0].message.content
    finishes = [None] * (len(with_choices) - 1) + [plain.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in with_choices] == finishes
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    streamed = [t for c in with_choices if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in plain.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in plain.choices[0].logprobs.content])
    # Without stream_options: no usage chunk, every chunk has a choice (OpenAI's default).
    bare = list(client.chat.completions.create(model=name, messages=MESSAGES, stream=True, **GREEDY))
    assert all(c.choices and c.usage is None for c in bare)
    assert "".join(c.choices[0].delta.content or "" for c in bare) == plain.choices[0].message.content


def test_a_client_that_leaves_mid_stream_aborts_its_request(server, client, name):
    before = metrics(server)["sglang:num_aborted_requests"][("sglang:num_aborted_requests_total", None)]
    stream = client.completions.create(model=name, prompt=PROMPT, temperature=0.0, max_tokens=3000, stream=True,
                                       extra_body={"ignore_eos": True})
    received = [next(stream) for _ in range(3)]
    stream.close()
    deadline = time.monotonic() + TIMEOUT_S
    while True:  # the server notices the closed connection on its own loop: wait for its counters to say so
        page = metrics(server)
        running = page["sglang:num_running_reqs"][("sglang:num_running_reqs", None)]
        aborted = page["sglang:num_aborted_requests"][("sglang:num_aborted_requests_total", None)]
        if (running, aborted) == (0, before + 1) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(received) == 3 and running == 0 and aborted == before + 1


def test_models_list_and_lookup_and_a_wrong_model_is_404(server, client, name):
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and "`gpt-4` does not exist" in missing.value.message
    with pytest.raises(openai.NotFoundError) as wrong:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert wrong.value.body["param"] == "model"
    status, _, body = http("POST", f"{server.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and json.loads(body)["model"] == name  # a request may leave the model out


def test_unknown_routes_wrong_methods_and_bad_bodies_get_json_errors(server, client, name):
    v1 = f"{server.url}/v1"
    answers = {
        "route": http("GET", f"{server.url}/no/such/route"),
        "method": http("GET", f"{v1}/completions"),
        "json": http("POST", f"{v1}/completions", b"{not json"),
        "temperature": http("POST", f"{v1}/completions", {"prompt": [1, 2], "temperature": "hot"}),
        "max_tokens": http("POST", f"{v1}/completions", {"prompt": [1, 2], "max_tokens": "many"}),
        "stream": http("POST", f"{v1}/completions", {"prompt": [1, 2], "stream": "yes"}),
        "stream_options": http("POST", f"{v1}/completions", {"prompt": [1, 2], "stream_options": {}}),
        "model": http("POST", f"{v1}/chat/completions", {"model": 3, "messages": MESSAGES}),
        "messages[0].content": http("POST", f"{v1}/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        "n": http("POST", f"{v1}/completions", {"prompt": [1, 2], "n": 2}),
    }
    native_status, _, native = http("POST", f"{server.url}/generate", b"[1, 2")
    for field, (status, headers, body) in answers.items():
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (field, body)
        if field == "route":
            assert status == 404 and error["type"] == "invalid_request_error"
        elif field == "method":
            assert status == 405 and "POST" in headers["Allow"]
        elif field == "json":
            assert status == 400 and "not valid JSON" in error["message"]
        else:
            assert status == 400 and field in error["message"], (field, body)
    assert answers["temperature"][2] and json.loads(answers["model"][2])["error"]["param"] == "model"
    assert native_status == 400 and set(json.loads(native)) == {"error"} and "JSON" in json.loads(native)["error"]["message"]
    assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_metrics_parse_and_their_counters_move_with_a_request(server, client, name):
    before = metrics(server)
    reply = client.completions.create(model=name, prompt=[5, 6, 7, 8, 9], temperature=0.0, max_tokens=5,
                                      extra_body={"ignore_eos": True})
    after = metrics(server)

    def moved(family: str, sample: str | None = None, le: str | None = None) -> float:
        key = (sample or family, le)
        return after[family][key] - before[family][key]

    assert moved("sglang:generation_tokens", "sglang:generation_tokens_total") == reply.usage.completion_tokens == 5
    assert moved("sglang:prompt_tokens", "sglang:prompt_tokens_total") == 5
    assert moved("sglang:num_requests", "sglang:num_requests_total") == 1
    assert moved("sglang:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds_count") == 1
    assert moved("sglang:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds_bucket", "+Inf") == 1
    assert after["sglang:cached_tokens"][("sglang:cached_tokens_total", None)] >= 0
    usage = after["sglang:token_usage"][("sglang:token_usage", None)]
    assert 0.0 <= usage <= 1.0 and after["sglang:num_queue_reqs"][("sglang:num_queue_reqs", None)] == 0
    assert after["miles_async:weight_version"][("miles_async:weight_version", None)] == 0
    assert after["sglang:max_total_num_tokens"][("sglang:max_total_num_tokens", None)] > 0
    _, _, text = http("GET", f"{server.url}/metrics")
    labels = {s.labels.get("model_name") for f in text_string_to_metric_families(text) for s in f.samples}
    assert labels == {name}


def test_streamed_text_never_sends_a_partial_character_or_a_stop_strings_start(model_dir):
    """The incremental cut itself, on the tokenizer's own decodes of a text fed one byte-level token at a time."""
    tokenizer = load_tokenizer(model_dir)
    text = "héllo 世界 🎉 done. STOP here"
    ids = tokenizer.encode(text)
    assert splits_a_character(tokenizer, ids)
    streamed, chunks = StreamedText(["STOP"]), []
    for k in range(1, len(ids) + 1):
        partial = tokenizer.decode(ids[:k])
        if "STOP" in partial:  # the engine finishes at this token, its final text cut before the stop
            break
        chunks.append(streamed.advance(partial, final=False))
    final = text[:text.index("STOP")]
    chunks.append(streamed.advance(final, final=True))
    assert "".join(chunks) == final and not any("\ufffd" in c for c in chunks)
    assert all(not c.endswith(("S", "ST", "STO")) for c in chunks[:-1])


def test_the_default_served_name_is_the_folders_or_the_hub_ids():
    assert default_served_model_name("/data/models/SmolLM2-135M") == "SmolLM2-135M"
    assert default_served_model_name("/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/" + "a" * 40) == "Qwen/Qwen3-0.6B"
    assert default_served_model_name(None) == "miles-async-embedded"
