"""Start a real SGLang server as a subprocess and wait until it answers its health check.

SGLang is the `sglang` extra (`pip install miles-async[sglang]`, GPU only). It pins its own
transformers, so it often lives in an environment of its own: then pass the command that starts
it, e.g. `command=["/opt/sglang-env/bin/python", "-m", "sglang.launch_server"]`; this side needs
nothing of SGLang but that command. The same `EngineClient` then talks to it.

    async with SGLangServer("models/qwen3-0.6b", port=30000, extra_args=["--dtype", "bfloat16"]) as server:
        async with EngineClient(server.url) as client:
            out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8})

The server runs in a process group of its own (SGLang starts scheduler and detokenizer children),
stopped with SIGTERM, then SIGKILL after `stop_timeout_s`. Its output goes to a log file whose
tail is quoted when it fails to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_async.engine.client import EngineClient

if TYPE_CHECKING:
    from typing_extensions import Self

LOG_TAIL_BYTES = 4000


class SGLangStartError(RuntimeError):
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


class SGLangServer:
    """One `sglang.launch_server` process serving `model_path` on host:port."""

    def __init__(self, model_path: str | Path, *, host: str = "127.0.0.1", port: int = 30000,
                 command: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 stop_timeout_s: float = 30.0) -> None:
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.command = list(command) if command is not None else default_command()
        self.extra_args = list(extra_args)
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else Path(
            tempfile.mkdtemp(prefix="sglang-")) / "server.log"
        self.stop_timeout_s = stop_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # of the last process started (kept after it stops)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [*self.command, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                *self.extra_args]

    async def start(self, timeout_s: float = 900.0) -> str:
        """Spawn the server and wait for /health; raise SGLangStartError if it dies or times out."""
        if self._process is not None:
            raise RuntimeError(f"the SGLang server on {self.url} is already started")
        with self._open_log() as log:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv(), stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(self.env or {})})
        self.pid = self._process.pid
        deadline = time.monotonic() + timeout_s
        async with EngineClient(self.url) as client:
            while not await client.health():
                if self._process.returncode is not None:
                    raise SGLangStartError(f"SGLang exited with status {self._process.returncode} while starting "
                                           f"({' '.join(self.argv())}); log tail:\n{self.log_tail()}")
                if time.monotonic() >= deadline:
                    await self.stop()
                    raise SGLangStartError(f"SGLang was not healthy on {self.url} within {timeout_s} s; "
                                           f"log tail:\n{self.log_tail()}")
                await asyncio.sleep(1.0)
        return self.url

    def _open_log(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.log_path, "ab")  # the caller's `with` closes it

    async def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_timeout_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError as e:
            return f"(no log: {e})"
        return data[-LOG_TAIL_BYTES:].decode(errors="replace")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
