"""`SGLangServer`, the launcher of a real SGLang server, on a CPU machine.

What is under test is the process handling: the command line it builds, waiting for /health,
reporting a server that dies or never gets healthy (with its log), and stopping the process group.
The server it starts here is our own embedded engine behind a stand-in `launch_server` command
that takes SGLang's arguments; tests/gpu/test_sglang.py starts the real one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from miles_async.engine.client import EngineClient
from miles_async.engine.sglang import SGLangServer, SGLangStartError
from miles_async.models import init_model

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
