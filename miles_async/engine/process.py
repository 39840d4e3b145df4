"""An inference server run as a subprocess: started, waited for until healthy, stopped, its log kept.

`ServerProcess` is what `SGLangServer` (engine/sglang.py) and `VllmServer` (engine/vllm.py) share:
the server runs in a process group of its own (both start children: SGLang a scheduler and a
detokenizer, vLLM an engine core and workers), is stopped with SIGTERM to the group, then SIGKILL
after `stop_timeout_s`, and gets SIGTERM from Linux if the process that started it dies first
(PR_SET_PDEATHSIG: a SIGKILLed engine actor leaves no server behind); its output goes to a log
file whose tail is quoted when it fails to start.
A subclass gives the command line (`argv`).

    async with VllmServer("models/tiny", port=8000) as server:
        print(server.url, server.log_path)
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from typing_extensions import Self

LOG_TAIL_BYTES = 4000


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy while starting; the message quotes its log."""


class ServerProcess(abc.ABC):
    """One server process serving on host:port (module docstring). `env` is added to this
    process's environment; `health_path` answers 200 once the server is ready."""

    kind = "server"  # for messages: "SGLang", "vLLM"
    health_path = "/health"

    def __init__(self, *, host: str = "127.0.0.1", port: int, command: Sequence[str],
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, stop_timeout_s: float = 30.0) -> None:
        self.host = host
        self.port = port
        self.command = list(command)
        self.extra_args = list(extra_args)
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else Path(
            tempfile.mkdtemp(prefix=f"{self.kind.lower()}-")) / "server.log"
        self.stop_timeout_s = stop_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # of the last process started (kept after it stops)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line that starts the server (`command`, its own arguments, `extra_args`)."""

    @property
    def returncode(self) -> int | None:
        """The exit status once the process is gone (None while it runs or before it starts)."""
        return self._process.returncode if self._process is not None else None

    async def start(self, timeout_s: float = 900.0) -> str:
        """Spawn the server and wait for its health check; raise ServerStartError if it dies or times out."""
        if self._process is not None:
            raise RuntimeError(f"the {self.kind} server on {self.url} is already started")
        with self._open_log() as log:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv(), stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(self.env or {})}, preexec_fn=_die_with_parent)
        self.pid = self._process.pid
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            while not await self._healthy(http):
                if self._process.returncode is not None:
                    raise ServerStartError(f"{self.kind} exited with status {self._process.returncode} while "
                                           f"starting ({' '.join(self.argv())}); log tail:\n{self.log_tail()}")
                if time.monotonic() >= deadline:
                    await self.stop()
                    raise ServerStartError(f"{self.kind} was not healthy on {self.url} within {timeout_s} s; "
                                           f"log tail:\n{self.log_tail()}")
                await asyncio.sleep(1.0)
        return self.url

    async def _healthy(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(self.url + self.health_path) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def _open_log(self) -> IO[bytes]:
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
