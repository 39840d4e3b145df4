"""The one thread that runs the engine's torch work, and why there is exactly one.

The engine loop lives on the event loop; its heavy work (model loading, KV cache allocation,
forward, sampling, weight copies) runs in this process-wide single-thread executor, so an HTTP
server on the loop stays responsive.

Why one thread and not `asyncio.to_thread`: torch's CPU parallelism is OpenMP, and GNU OpenMP
keeps a team of worker threads per calling thread. Once two threads of a process have run
parallel regions, there are more OpenMP threads than cores and libgomp stops spinning between
regions, so every region pays a thread wake-up. Measured here (2 cores, torch 2.13): a [40, 256]
x [256, 768] linear takes ~85 us on the first thread to use OpenMP and ~160 us on any thread
once a second one has, for the rest of the process; a tiny model's decode step doubles.
`asyncio.to_thread` may pick a different pool thread each call, and the loop thread running a
large op (a big allocation, a large gather) starts a second team too. So everything large goes
through `run` / `run_sync` here, and the little the loop thread does with tensors stays below
torch's parallel grain (see `serial_index_select`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")
# at::internal::GRAIN_SIZE: ops over fewer elements run inline, without an OpenMP region.
PARALLEL_GRAIN_ELEMENTS = 32768

_executor: ThreadPoolExecutor | None = None
_executor_pid = 0  # a forked child inherits the executor object but not its thread: it makes its own
_executor_lock = threading.Lock()
_compute_thread: threading.Thread | None = None


def _mark_thread() -> None:
    global _compute_thread
    _compute_thread = threading.current_thread()


def executor() -> ThreadPoolExecutor:
    """The process-wide compute thread (created on first use)."""
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-engine-compute",
                                           initializer=_mark_thread)
            _executor_pid = os.getpid()
        return _executor


def on_compute_thread() -> bool:
    return threading.current_thread() is _compute_thread


def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run fn on the compute thread and wait (directly, when already on it)."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return executor().submit(fn, *args, **kwargs).result()


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Await fn on the compute thread; the event loop keeps running meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(executor(), functools.partial(fn, *args, **kwargs))


def serial_index_select(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`source.index_select(0, index)` on the host, in chunks small enough to run without an OpenMP region.

    For the few tensor reads the event-loop thread does itself (a finished request's routed
    experts), so that it never starts a second OpenMP team (module docstring). A source on a GPU
    is indexed there (no OpenMP involved) and the rows copied back to the host.
    """
    if source.device.type != "cpu":
        return source.index_select(0, index.to(source.device)).cpu()
    out = torch.empty((index.numel(), *source.shape[1:]), dtype=source.dtype)
    row = max(1, out[0].numel()) if out.shape[0] else 1
    step = max(1, PARALLEL_GRAIN_ELEMENTS // (2 * row))
    for start in range(0, index.numel(), step):
        torch.index_select(source, 0, index[start:start + step], out=out[start:start + step])
    return out
