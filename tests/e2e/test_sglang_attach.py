"""`rollout.backend = "sglang"` attached by URL to a running server that speaks SGLang 0.5.23's API.

SGLang itself needs a CUDA GPU; on this CPU the server is our embedded engine's (`miles-async serve
engine`), which serves SGLang's shapes (tests/e2e/test_sglang_conformance.py checks them against
SGLang's own source). The run reaches it only as it would reach SGLang: generation through
`SGLangBackend`, updates through `/update_weights_from_disk` with a version label, verified by the
probe over `/generate`'s input log-probs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from _support_run import SHORT, run_cli

from miles_async.trainer.fsdp import free_port

pytestmark = pytest.mark.slow


def served_version(url: str) -> str:
    request = urllib.request.Request(url + "/generate", data=json.dumps(
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return str(json.loads(reply.read())["meta_info"]["weight_version"])


@pytest.mark.timeout(400)
def test_a_run_trains_an_engine_it_reaches_only_through_sglangs_api(model_dir, tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "miles_async.launch.cli", "serve", "engine", "--model",
                               str(model_dir), "--port", str(port), "--kv-cache-mib", "16"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the engine server did not start"
                time.sleep(0.5)
        out = tmp_path / "run"
        done = run_cli(["run", "recipes/reverse.toml", *SHORT, "loop.num_steps=6", "eval.mode=none",
                        f"model.path={model_dir}", "rollout.backend=sglang", f'rollout.server.url="{url}"',
                        "--out", str(out)], timeout_s=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        header = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
        assert header["transport"] == "disk" and summary["num_steps"] == 6
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        last = max(r["weight_version"] for r in rows if "weight_version" in r)
        # every pushed version reached the server, under its label, through /update_weights_from_disk
        assert int(served_version(url)) >= last > 0
        newest = max((out / "deltas").iterdir())
        assert newest.name.startswith("full_v") and (newest / "config.json").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.timeout(60)
def test_the_sglang_backend_reports_load_and_info_from_sglangs_endpoints(model_dir):
    import asyncio

    from miles_async.engine import Engine, EngineConfig, EngineServer
    from miles_async.engine.backend import GenerateParams, SGLangBackend

    async def main():
        engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=4, max_seq_len=64))
        async with engine, EngineServer(engine) as server:
            backend = SGLangBackend(server.url)
            try:
                await backend.pause("in_place")
                pending = [asyncio.ensure_future(backend.generate([5, 6, 7], GenerateParams(max_new_tokens=4),
                                                                  version=0)) for _ in range(3)]
                await asyncio.sleep(0.3)
                held = await backend.load()
                await backend.resume()
                await asyncio.wait_for(asyncio.gather(*pending), 30)
                return held, await backend.load(), await backend.info()
            finally:
                await backend.close()

    held, idle, info = asyncio.run(asyncio.wait_for(main(), 50))
    assert (held, idle) == (3, 0)
    assert info["model_path"] == str(model_dir)
