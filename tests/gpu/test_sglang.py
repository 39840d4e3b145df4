"""The same `EngineClient` against a real SGLang server, started by `miles_async.engine.sglang`.

GPU only: skipped, with the reason, where no CUDA GPU or no SGLang is available. SGLang may live
in an environment of its own: set MILES_SGLANG_COMMAND to the command that starts it, e.g.
`MILES_SGLANG_COMMAND="/opt/sglang/bin/python -m sglang.launch_server"`.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket

import pytest

from miles_async.engine.client import EngineClient, EngineHTTPError
from miles_async.engine.sglang import SGLangServer, sglang_unavailable_reason
from miles_async.models import init_model

COMMAND = shlex.split(os.environ.get("MILES_SGLANG_COMMAND", "")) or None


def _skip_reason() -> str | None:
    if COMMAND is None:
        return sglang_unavailable_reason()
    import torch

    return None if torch.cuda.is_available() else "SGLang needs a CUDA GPU and none is visible"


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_client_speaks_to_a_real_sglang_server(tmp_path):
    # "small": head_dim 32, which SGLang's attention kernels take (tiny's 16 is below some minimums).
    model_dir = init_model("qwen3", "small", tmp_path / "model", seed=0)
    new_dir = init_model("qwen3", "small", tmp_path / "new", seed=1)

    async def scenario():
        server = SGLangServer(model_dir, port=_free_port(), command=COMMAND,
                              extra_args=["--mem-fraction-static", "0.2", "--attention-backend", "triton"])
        async with server, EngineClient(server.url, timeout_s=300) as client:
            info = await client.model_info()
            out = await client.generate(input_ids=[1, 2, 3, 4], return_logprob=True,
                                        sampling_params={"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
            chunks = [c async for c in client.generate_stream(
                input_ids=[1, 2, 3, 4], sampling_params={"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})]
            await client.flush_cache()
            await client.pause("abort")
            await client.resume()
            updated = await client.update_weights_from_disk(str(new_dir), weight_version="v2")
            after = await client.generate(input_ids=[1, 2, 3, 4],
                                          sampling_params={"temperature": 0.0, "max_new_tokens": 2})
            with pytest.raises(EngineHTTPError):
                await client.generate(input_ids=[1, 2, 3], sampling_params={"top_p": 5.0})
            return info, out, chunks, updated, after

    info, out, chunks, updated, after = asyncio.run(asyncio.wait_for(scenario(), 900))
    assert info["is_generation"]
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8 and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 8 and "cached_tokens" in meta
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert chunks[-1]["output_ids"] == out["output_ids"][:4]
    assert updated["success"] and after["meta_info"]["weight_version"] == "v2"
