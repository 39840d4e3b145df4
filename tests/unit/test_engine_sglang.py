"""`SGLangServer`, the launcher of a real SGLang server, on a CPU machine.

What is under test is the process handling: the command line it builds, waiting for /health,
reporting a server that dies or never gets healthy (with its log), and stopping the process group.
The server it starts here is our own embedded engine behind a stand-in `launch_server` command
that takes SGLang's arguments; tests/gpu/test_sglang.py starts the real one.
The last tests read SGLang-shaped /generate JSON with `parse_output`, the one reader of an
engine's answer on the rollout side: with the embedded engine's per-token version spans, and
without them (SGLang reports only its `weight_version` label).
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import sys

import numpy as np
import pytest

from miles_async.engine.client import EngineClient, EngineOutput, parse_output
from miles_async.engine.sglang import SGLangServer, SGLangStartError
from miles_async.models import init_model
from miles_async.trajectory import VersionSpan

TIMEOUT_S = 60
# `launch_server --model-path M --host H --port P`, served by the embedded engine.
STAND_IN = """
import argparse
from miles_async.engine.server import main
parser = argparse.ArgumentParser()
parser.add_argument("--model-path"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
args = parser.parse_args()
raise SystemExit(main(args.model_path, args.host, args.port, kv_cache_mib=4))
"""


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_starts_waits_for_health_serves_and_stops(tmp_path):
    model_dir = init_model("qwen3", "tiny", tmp_path / "model", seed=0)
    server = SGLangServer(model_dir, port=free_port(), command=[sys.executable, "-c", STAND_IN],
                          log_path=tmp_path / "server.log")
    assert server.argv()[-6:] == ["--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(server.port)]

    async def scenario():
        async with server, EngineClient(server.url) as client:
            out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        return out

    out = run(scenario())
    assert out["meta_info"]["completion_tokens"] == 2
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)  # stopped with its process group
    assert "serving" in server.log_tail()


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    server = SGLangServer("m", port=free_port(), log_path=tmp_path / "server.log",
                          command=[sys.executable, "-c", "import sys; print('no CUDA device'); sys.exit(3)"])
    with pytest.raises(SGLangStartError, match=r"(?s)status 3.*no CUDA device"):
        run(server.start(timeout_s=30))


def test_a_server_that_never_gets_healthy_is_stopped(tmp_path):
    server = SGLangServer("m", port=free_port(), log_path=tmp_path / "server.log", stop_timeout_s=5,
                          command=[sys.executable, "-c", "import time; print('loading'); time.sleep(60)"])

    with pytest.raises(SGLangStartError, match="not healthy"):
        run(server.start(timeout_s=1.5))
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)  # stopped and reaped, not left behind


def sglang_json(num_tokens: int, **meta) -> dict:
    """One /generate item as SGLang writes it (return_logprob: [logprob, token id, text] entries)."""
    output_ids = list(range(100, 100 + num_tokens))
    return {"text": "x" * num_tokens, "output_ids": output_ids, "meta_info": {
        "id": "r1", "finish_reason": {"type": "length", "length": num_tokens}, "prompt_tokens": 7,
        "completion_tokens": num_tokens, "cached_tokens": 3, "weight_version": "default", "e2e_latency": 0.5,
        "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(output_ids)], **meta}}


def test_parse_output_reads_per_token_version_spans():
    experts = np.arange((7 + 5 - 1) * 2 * 2, dtype="<i4") % 8  # [prompt + output - 1, 2 layers, top 2], kept as sent
    out = parse_output(sglang_json(5, weight_version="2", routed_experts=base64.b64encode(experts.tobytes()).decode(),
                                   weight_versions=[{"version": 1, "start": 0, "end": 2},
                                                    {"version": 2, "start": 2, "end": 5}]), version=0)
    assert out == EngineOutput(output_ids=[100, 101, 102, 103, 104], output_logprobs=[-0.25, -0.5, -0.75, -1.0, -1.25],
                               finish_reason="length", weight_versions=[VersionSpan(1, 0, 2), VersionSpan(2, 2, 5)],
                               text="xxxxx", routed_experts=experts.tobytes(), prompt_tokens=7, cached_tokens=3)


@pytest.mark.parametrize("label, version, expected", [
    ("default", 4, 4),  # SGLang's label when no version was ever set: the version the request was sent at
    ("3", 4, 3),        # an integer label is the engine's own word on its weights
    ("-1", 0, -1),
])
def test_parse_output_without_spans_gives_one_span_over_the_whole_output(label, version, expected):
    out = parse_output(sglang_json(4, weight_version=label), version=version)
    assert out.weight_versions == [VersionSpan(expected, 0, 4)]
    assert (out.output_ids, out.finish_reason, out.prompt_tokens, out.cached_tokens) == ([100, 101, 102, 103], "length",
                                                                                         7, 3)
    assert out.routed_experts == b""


def test_parse_output_of_an_aborted_or_empty_answer():
    aborted = sglang_json(0, finish_reason={"type": "abort", "message": "paused"})
    assert parse_output(aborted, version=2) == EngineOutput(
        output_ids=[], output_logprobs=[], finish_reason="abort", weight_versions=[], prompt_tokens=7, cached_tokens=3)
    unfinished = {"output_ids": [5], "meta_info": {"finish_reason": None}}  # no logprobs asked, no label
    assert parse_output(unfinished, version=2) == EngineOutput(
        output_ids=[5], output_logprobs=[], finish_reason="abort", weight_versions=[VersionSpan(2, 0, 1)])


def test_parse_output_reads_sglangs_text_labels_and_drops_empty_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "step-9", "start": 2, "end": 4}]
    assert parse_output(sglang_json(4, weight_version="step-9", weight_versions=spans), version=8).weight_versions == [
        VersionSpan(3, 0, 2), VersionSpan(8, 2, 4)]  # a name is not a version: the one the request was sent at
    before_any = sglang_json(0, weight_versions=[{"version": "3", "start": 0, "end": 0}])
    assert parse_output(before_any, version=3).weight_versions == []
