"""Start a real SGLang server as a subprocess and wait until it answers its health check.

SGLang is the `sglang` extra (`pip install miles-async[sglang]`, GPU only). It pins its own
transformers, so it often lives in an environment of its own: then pass the command that starts
it, e.g. `command=["/opt/sglang-env/bin/python", "-m", "sglang.launch_server"]`; this side needs
nothing of SGLang but that command. The same `EngineClient` then talks to it.

    async with SGLangServer("models/qwen3-0.6b", port=30000, extra_args=["--dtype", "bfloat16"]) as server:
        async with EngineClient(server.url) as client:
            out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8})

The process handling (a process group of its own, SIGTERM then SIGKILL, the log file and its
tail quoted when it fails to start) is `engine/process.py`'s, shared with `VllmServer`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from miles_async.engine.process import ServerProcess, ServerStartError


class SGLangStartError(ServerStartError):
    """The SGLang server exited or stayed unhealthy while starting; the message quotes its log."""


def default_command() -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server"]


def sglang_unavailable_reason() -> str | None:
    """Why SGLang cannot run in this environment (None: it can), for skips and error messages."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed here: pip install 'miles-async[sglang]' on a GPU machine"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "SGLang needs a CUDA GPU and none is visible"
    return None


class SGLangServer(ServerProcess):
    """One `sglang.launch_server` process serving `model_path` on host:port."""

    kind = "SGLang"

    def __init__(self, model_path: str | Path, *, host: str = "127.0.0.1", port: int = 30000,
                 command: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 stop_timeout_s: float = 30.0) -> None:
        super().__init__(host=host, port=port, command=command if command is not None else default_command(),
                         extra_args=extra_args, env=env, log_path=log_path, stop_timeout_s=stop_timeout_s)
        self.model_path = str(model_path)

    def argv(self) -> list[str]:
        return [*self.command, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                *self.extra_args]

    async def start(self, timeout_s: float = 900.0) -> str:
        """Spawn the server and wait for /health; raise SGLangStartError if it dies or times out."""
        try:
            return await super().start(timeout_s)
        except ServerStartError as e:
            raise SGLangStartError(str(e)) from None
