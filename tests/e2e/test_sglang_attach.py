"""`rollout.backend = "sglang"` attached by URL to a running server that speaks SGLang 0.5.23's API.

SGLang itself needs a CUDA GPU; on this CPU the server is our embedded engine's (`miles-async serve
engine`), which serves SGLang's shapes (tests/e2e/test_sglang_conformance.py checks them against
SGLang's own source). The run reaches it only as it would reach SGLang: generation through
`SGLangBackend`, updates through `/update_weights_from_disk` with a version label, verified by the
probe over `/generate`'s input log-probs; or, with `weights.transport = "distributed"`, through
SGLang's weight-update group (miles_async/actors/distributed.py), every update verified by the same probe.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

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


@contextlib.contextmanager
def serve_engine(model_dir) -> Iterator[str]:
    """`miles-async serve engine` on a free port; yields its URL once healthy."""
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
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def attached_run(model_dir, url: str, out, *overrides: str) -> tuple[list[dict], str]:
    """A short run attached to `url` as the sglang backend (logging every update); returns its
    metrics rows and its log."""
    done = run_cli(["run", "recipes/reverse.toml", *SHORT, "eval.mode=none", f"model.path={model_dir}",
                    "rollout.backend=sglang", f'rollout.server.url="{url}"', *overrides, "--out", str(out),
                    "--verbose"], timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], done.stderr


@pytest.mark.timeout(400)
def test_a_run_trains_an_engine_it_reaches_only_through_sglangs_api(model_dir, tmp_path):
    with serve_engine(model_dir) as url:
        out = tmp_path / "run"
        rows, _ = attached_run(model_dir, url, out, "loop.num_steps=6")
        summary = json.loads((out / "summary.json").read_text())
        header = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
        assert header["transport"] == "disk" and summary["num_steps"] == 6
        last = max(r["train/weight_version"] for r in rows if "train/weight_version" in r)
        # every pushed version reached the server, under its label, through /update_weights_from_disk
        assert int(served_version(url)) >= last > 0
        newest = max((out / "deltas").iterdir())
        assert newest.name.startswith("full_v") and (newest / "config.json").exists()


@pytest.mark.timeout(300)
def test_a_run_updates_the_server_through_sglangs_weight_update_group(model_dir, tmp_path):
    """weights.transport = "distributed": the pusher is rank 0 of a gloo group the server joins by
    /init_weights_update_group; each update is broadcast while the server's actor posts
    /update_weights_from_distributed, and verified by the probe (verify = always: a failed probe
    fails the run). No weights file is written."""
    with serve_engine(model_dir) as url:
        out = tmp_path / "run"
        rows, log = attached_run(model_dir, url, out, "loop.num_steps=3", "weights.transport=distributed",
                            "weights.verify=always", "weights.backend=gloo")
        records = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
        updates = [r for r in records if r.get("kind") == "weight_update"]
        assert records[0]["transport"] == "distributed" and updates
        assert all(u["transport"] == "distributed" for u in updates)
        versions = [u["version"] for u in updates]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        last = max(r["train/weight_version"] for r in rows if "train/weight_version" in r)
        assert int(served_version(url)) == max(versions) >= last > 0  # the label rode on the last bucket
        assert not (out / "deltas").exists() or not any((out / "deltas").iterdir())
        verified = [int(v) for v in re.findall(r"version (\d+) verified by the probe", log)]
        assert verified == versions, (verified, versions)
        assert log.count("weight-update group miles-weights-") == 1  # formed once, kept


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
