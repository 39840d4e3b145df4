"""Peer measurements for `miles-async bench runtime`: what our actor runtime is compared against.

Two peers, each measured in the same run as our runtime so the benchmark can print a ratio:

* `raw_zmq`: the floor our transport is built on. Two processes, zmq.asyncio DEALER (client,
  this process) to ROUTER (echo server, a spawned process), every message a msgspec Struct that
  the server decodes and re-encodes. No actor machinery at all, so our runtime can approach this
  figure but not beat it.
* `ray_actor`: a sync Ray actor with `echo(x) -> x`, the runtime people would otherwise reach for.

Both report round trips per second with one request outstanding ("sequential") and with
`window` outstanding ("pipelined"), plus per-request latency p50/p99 in microseconds taken from
the sequential runs. Every figure is the median over `reps` repetitions; the per-repetition
values are kept under "reps".

Try it (small counts; prints JSON on stdout, Ray's noise goes to stderr):

    .venv/bin/python -m bench.runtime_peers --num-sequential 2000 --num-pipelined 8000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, Literal, TypeVar

import msgspec
import zmq
import zmq.asyncio

from miles_async.bench._stats import median, percentile

_T = TypeVar("_T")

NUM_WARMUP = 500
"""Round trips before any measured repetition: connection setup, allocator and cache warm-up."""

_STOP = b"STOP"
"""Tells the echo server to exit; never a valid msgpack-encoded `EchoMsg`."""

_TOKENS = list(range(16))
_TAG = "rollout"


class EchoMsg(msgspec.Struct, frozen=True, array_like=True):
    """The benchmark payload: about the size of a small rollout-control message."""

    id: int
    step: int
    tokens: list[int]
    tag: str


# ---------------------------------------------------------------------------------------------
# Shared result shape
# ---------------------------------------------------------------------------------------------


def summarise(
    sequential_per_s: list[float], pipelined_per_s: list[float], latencies_s: list[list[float]]
) -> dict:
    """Medians over repetitions; latency percentiles pool every sequential request of every rep."""
    pooled_us = [x * 1e6 for rep in latencies_s for x in rep]
    return {
        "sequential_per_s": round(median(sequential_per_s), 1),
        "pipelined_per_s": round(median(pipelined_per_s), 1),
        "p50_us": round(percentile(pooled_us, 50.0), 1),
        "p99_us": round(percentile(pooled_us, 99.0), 1),
        "reps": {
            "sequential_per_s": [round(x, 1) for x in sequential_per_s],
            "pipelined_per_s": [round(x, 1) for x in pipelined_per_s],
            "p50_us": [round(percentile(rep, 50.0) * 1e6, 1) for rep in latencies_s],
            "p99_us": [round(percentile(rep, 99.0) * 1e6, 1) for rep in latencies_s],
        },
    }


def check_counts(num_sequential: int, num_pipelined: int, window: int, reps: int) -> None:
    for name, value in (
        ("num_sequential", num_sequential),
        ("num_pipelined", num_pipelined),
        ("window", window),
        ("reps", reps),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


# ---------------------------------------------------------------------------------------------
# Peer (a): raw asyncio ZeroMQ + msgspec
# ---------------------------------------------------------------------------------------------


def _run_loop(main: Callable[[], Awaitable[_T]], use_uvloop: bool) -> _T:
    """Run `main()` on a fresh event loop: uvloop's when asked (ImportError if it is missing)."""
    if use_uvloop:
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def _serve_echo(address: str, ready: Connection, parent_pid: int, use_uvloop: bool) -> None:
    """Entry point of the spawned echo server process."""
    _run_loop(lambda: _echo_server(address, ready, parent_pid), use_uvloop)


async def _echo_server(address: str, ready: Connection, parent_pid: int) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
        # For tcp the address ends in ":*"; the endpoint says which port the OS gave us.
        ready.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        ready.close()
        serve = asyncio.ensure_future(_echo_until_stopped(sock))
        watchdog = asyncio.ensure_future(_until_orphaned(parent_pid))
        done, pending = await asyncio.wait({serve, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
        if serve in done:
            serve.result()  # re-raises a server fault, which then reaches stderr
    finally:
        sock.close()
        ctx.term()


async def _echo_until_stopped(sock: zmq.asyncio.Socket) -> None:
    decode = msgspec.msgpack.Decoder(EchoMsg).decode
    encode = msgspec.msgpack.Encoder().encode
    while True:
        identity, payload = await sock.recv_multipart()
        if payload == _STOP:
            return
        await sock.send_multipart([identity, encode(decode(payload))])


async def _until_orphaned(parent_pid: int, poll_s: float = 1.0) -> None:
    # The server blocks in recv with no timeout (a timeout per message would tax the figure
    # we are measuring), so this is its bound: it exits once the benchmark process is gone.
    while os.getppid() == parent_pid:
        await asyncio.sleep(poll_s)


async def _zmq_sequential(sock: zmq.asyncio.Socket, num_requests: int) -> tuple[float, list[float]]:
    """One request outstanding. Returns (round trips per second, per-request latencies in s)."""
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EchoMsg).decode
    perf_counter = time.perf_counter
    latencies_s = [0.0] * num_requests
    start_s = perf_counter()
    for i in range(num_requests):
        sent_s = perf_counter()
        await sock.send(encode(EchoMsg(i, 7, _TOKENS, _TAG)))
        reply = decode(await sock.recv())
        latencies_s[i] = perf_counter() - sent_s
        if reply.id != i:
            raise RuntimeError(f"echo server answered id {reply.id} to request {i}")
    return num_requests / (perf_counter() - start_s), latencies_s


async def _zmq_pipelined(sock: zmq.asyncio.Socket, num_requests: int, window: int) -> float:
    """Up to `window` requests outstanding. Returns round trips per second."""
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EchoMsg).decode
    num_sent = num_received = 0
    start_s = time.perf_counter()
    while num_received < num_requests:
        while num_sent < num_requests and num_sent - num_received < window:
            await sock.send(encode(EchoMsg(num_sent, 7, _TOKENS, _TAG)))
            num_sent += 1
        reply = decode(await sock.recv())
        # One DEALER-ROUTER connection delivers in order, so replies come back in id order.
        if reply.id != num_received:
            raise RuntimeError(f"echo server answered id {reply.id}, expected {num_received}")
        num_received += 1
    return num_requests / (time.perf_counter() - start_s)


async def _zmq_client(
    address: str, num_sequential: int, num_pipelined: int, window: int, reps: int
) -> tuple[list[float], list[float], list[list[float]]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await _zmq_sequential(sock, NUM_WARMUP)
        sequential_per_s, latencies_s = [], []
        for _ in range(reps):
            per_s, rep_latencies_s = await _zmq_sequential(sock, num_sequential)
            sequential_per_s.append(per_s)
            latencies_s.append(rep_latencies_s)
        pipelined_per_s = [await _zmq_pipelined(sock, num_pipelined, window) for _ in range(reps)]
        await sock.send(_STOP)
        return sequential_per_s, pipelined_per_s, latencies_s
    finally:
        sock.close()
        ctx.term()


def _stop_process(proc: multiprocessing.process.BaseProcess, grace_s: float) -> None:
    """Wait `grace_s` for a clean exit, then terminate, then kill."""
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def raw_zmq(
    transport: Literal["ipc", "tcp"],
    num_sequential: int,
    num_pipelined: int,
    window: int = 64,
    reps: int = 3,
    use_uvloop: bool = True,
    *,
    timeout_s: float = 120.0,
) -> dict:
    """Round trips of a msgspec Struct over raw zmq.asyncio DEALER/ROUTER between two processes.

    The echo server is a spawned process (asyncio, or uvloop when `use_uvloop`) that decodes each
    request and encodes it again as the reply; the client runs here on a fresh event loop, so
    this must not be called from inside a running loop. `transport` "ipc" uses a socket file in
    a temporary directory unique to this call; "tcp" binds 127.0.0.1 on a port the OS picks.

    `timeout_s` bounds the server's start-up and, separately, the whole client run; on timeout
    or any error the server is terminated and a RuntimeError (or the error itself) is raised.

    Returns {"sequential_per_s", "pipelined_per_s", "p50_us", "p99_us", "reps"}: medians over
    `reps`, latency percentiles over all sequential requests, and "reps" with every value.
    """
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"transport={transport!r} is not supported; use 'ipc' or 'tcp'")
    check_counts(num_sequential, num_pipelined, window, reps)
    spawn = multiprocessing.get_context("spawn")
    ipc_dir = tempfile.TemporaryDirectory(prefix="miles-peer-zmq-") if transport == "ipc" else None
    with ipc_dir or contextlib.nullcontext():
        bind_address = f"ipc://{ipc_dir.name}/echo.sock" if ipc_dir else "tcp://127.0.0.1:*"
        ready_recv, ready_send = spawn.Pipe(duplex=False)
        server = spawn.Process(
            target=_serve_echo,
            args=(bind_address, ready_send, os.getpid(), use_uvloop),
            name="miles-peer-zmq-echo",
            daemon=True,
        )
        server.start()
        ready_send.close()  # so that recv() sees EOF, not a hang, if the server dies early
        finished = False
        try:
            if not ready_recv.poll(timeout_s):
                raise RuntimeError(f"zmq echo server did not start within {timeout_s}s")
            try:
                address = ready_recv.recv()
            except EOFError:
                raise RuntimeError(
                    f"zmq echo server exited during start-up (exit code {server.exitcode}); "
                    "its traceback is on stderr"
                ) from None

            async def client() -> tuple[list[float], list[float], list[list[float]]]:
                run = _zmq_client(address, num_sequential, num_pipelined, window, reps)
                try:
                    return await asyncio.wait_for(run, timeout_s)
                except asyncio.TimeoutError:
                    raise RuntimeError(
                        f"zmq peer over {transport} did not finish within {timeout_s}s "
                        f"(server alive: {server.is_alive()}, exit code {server.exitcode})"
                    ) from None

            sequential_per_s, pipelined_per_s, latencies_s = _run_loop(client, use_uvloop)
            finished = True
        finally:
            ready_recv.close()
            _stop_process(server, grace_s=5.0 if finished else 0.0)
    return summarise(sequential_per_s, pipelined_per_s, latencies_s)


# ---------------------------------------------------------------------------------------------
# Peer (b): a Ray actor
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the duration.

    Our caller prints JSON on stdout. Ray's daemons (GCS, raylet, and the workers they start)
    inherit our descriptors when `ray.init` spawns them, so redirecting at the descriptor level,
    not just `sys.stdout`, keeps anything they write off the JSON stream.
    """
    sys.stdout.flush()
    saved_fd = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


def _ray_payload(i: int) -> dict[str, Any]:
    return {"id": i, "step": 7, "tokens": _TOKENS, "tag": _TAG}


def _ray_sequential(ray: Any, actor: Any, num_requests: int, timeout_s: float) -> tuple[float, list[float]]:
    perf_counter = time.perf_counter
    latencies_s = [0.0] * num_requests
    start_s = perf_counter()
    for i in range(num_requests):
        sent_s = perf_counter()
        reply = ray.get(actor.echo.remote(_ray_payload(i)), timeout=timeout_s)
        latencies_s[i] = perf_counter() - sent_s
        if reply["id"] != i:
            raise RuntimeError(f"ray actor answered id {reply['id']} to request {i}")
    return num_requests / (perf_counter() - start_s), latencies_s


def _check_ids(replies: list[Any], expected: range) -> None:
    if sorted(r["id"] for r in replies) != list(expected):
        raise RuntimeError(f"ray actor answered ids other than {expected.start}..{expected.stop - 1}")


def _ray_pipelined_get_oldest(ray: Any, actor: Any, num_requests: int, window: int, timeout_s: float) -> float:
    """`window` calls in flight; when full, a blocking `ray.get` on the oldest."""
    in_flight: collections.deque[Any] = collections.deque()
    num_received = 0
    start_s = time.perf_counter()
    for i in range(num_requests):
        if len(in_flight) == window:
            reply = ray.get(in_flight.popleft(), timeout=timeout_s)
            if reply["id"] != num_received:
                raise RuntimeError(f"ray actor answered id {reply['id']}, expected {num_received}")
            num_received += 1
        in_flight.append(actor.echo.remote(_ray_payload(i)))
    _check_ids(ray.get(list(in_flight), timeout=timeout_s), range(num_received, num_requests))
    return num_requests / (time.perf_counter() - start_s)


def _ray_pipelined_wait(ray: Any, actor: Any, num_requests: int, window: int, timeout_s: float) -> float:
    """`window` calls in flight; when full, `ray.wait` for whichever are done and one `ray.get` on them
    (Ray's documented pattern for bounding pending calls)."""
    in_flight: list[Any] = []
    replies: list[Any] = []
    start_s = time.perf_counter()
    for i in range(num_requests):
        if len(in_flight) == window:
            ready, in_flight = ray.wait(in_flight, num_returns=1, timeout=timeout_s)
            if not ready:
                raise TimeoutError(f"no ray actor reply in {timeout_s} s")
            replies.extend(ray.get(ready, timeout=timeout_s))
        in_flight.append(actor.echo.remote(_ray_payload(i)))
    replies.extend(ray.get(in_flight, timeout=timeout_s))
    _check_ids(replies, range(num_requests))
    return num_requests / (time.perf_counter() - start_s)


def _ray_pipelined_batched(ray: Any, actor: Any, num_requests: int, window: int, timeout_s: float) -> float:
    """`window` calls at a time, then one batched `ray.get` on all of them."""
    start_s = time.perf_counter()
    for first in range(0, num_requests, window):
        batch = range(first, min(first + window, num_requests))
        _check_ids(ray.get([actor.echo.remote(_ray_payload(i)) for i in batch], timeout=timeout_s), batch)
    return num_requests / (time.perf_counter() - start_s)


RAY_PIPELINED = {"get_oldest": _ray_pipelined_get_oldest, "wait": _ray_pipelined_wait,
                 "batched_get": _ray_pipelined_batched}
"""The ways of keeping Ray calls in flight that its users write; the peer's pipelined figure is the best."""


def ray_actor(
    num_sequential: int,
    num_pipelined: int,
    reps: int = 3,
    *,
    window: int = 64,
    timeout_s: float = 60.0,
) -> dict | None:
    """Round trips to a sync Ray actor `echo(x) -> x` with a small dict payload.

    Returns None when ray is not importable. Starts a local Ray (2 CPUs, no dashboard, worker
    logs not forwarded) and shuts it down at the end; if Ray is already initialised in this
    process it is used as it is and left running. Pipelined runs each of `RAY_PIPELINED` (`window`
    calls in flight, collected with a blocking get on the oldest, with `ray.wait`, or as one batched
    `ray.get` per window) `reps` times; the best strategy's median is the figure. `timeout_s`
    bounds every `ray.get` and `ray.wait`.

    Same return shape as `raw_zmq`, plus `pipelined_strategies` (each strategy's median),
    `pipelined_best` and `settings` (window, Ray version, the actor's options).
    """
    check_counts(num_sequential, num_pipelined, window, reps)
    try:
        import ray
    except ImportError:
        return None

    class Echo:
        def echo(self, x: Any) -> Any:
            return x

    with _stdout_to_stderr():
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            actor = ray.remote(num_cpus=0)(Echo).remote()
            try:
                _ray_sequential(ray, actor, NUM_WARMUP, timeout_s)
                sequential_per_s, latencies_s = [], []
                for _ in range(reps):
                    per_s, rep_latencies_s = _ray_sequential(ray, actor, num_sequential, timeout_s)
                    sequential_per_s.append(per_s)
                    latencies_s.append(rep_latencies_s)
                by_strategy = {name: [run(ray, actor, num_pipelined, window, timeout_s) for _ in range(reps)]
                               for name, run in RAY_PIPELINED.items()}
            finally:
                ray.kill(actor)
        finally:
            if owns_ray:
                ray.shutdown()
    best = max(by_strategy, key=lambda name: median(by_strategy[name]))
    result = summarise(sequential_per_s, by_strategy[best], latencies_s)
    result["pipelined_strategies"] = {name: round(median(rates), 1) for name, rates in by_strategy.items()}
    result["pipelined_best"] = best
    result["settings"] = {"ray": ray.__version__, "window": window, "actor": "sync, num_cpus=0",
                          "init": "num_cpus=2, include_dashboard=False, log_to_driver=False"}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the runtime benchmark's peers; print JSON.")
    parser.add_argument("--num-sequential", type=int, default=1000)
    parser.add_argument("--num-pipelined", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    counts = (args.num_sequential, args.num_pipelined)
    result = {
        "raw_zmq_ipc": raw_zmq("ipc", *counts, reps=args.reps),
        "raw_zmq_tcp": raw_zmq("tcp", *counts, reps=args.reps),
        "ray_actor": ray_actor(*counts, reps=args.reps),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
