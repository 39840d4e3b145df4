"""The weight-sync half of `miles-async bench gpu`: one engine's weight update by each transport, timed.

Every transport moves the same tensors (the trainer's weights after its steps, in the engine's
dtype, on the trainer's device) into one running engine (`engine.Engine`, double-buffered), the way
the run's pusher and engine actor do it (miles_async/actors/weights.py, actors/engine.py):

- colocated: `transport.colocated.handoff` to the engine registered in this process; tensors of
  the engine's dtype and device are taken as they are (a pointer swap, `num_aliased`);
- shm (CPU engines only: `EngineConfig.shared_weights` keeps the weights in CPU shared memory):
  a second engine with shared weights; `begin_update`, the pusher attaches the target segment by
  name and writes every tensor into it, `commit_update`;
- ipc: the weights of another process shared by handle, as SGLang's `update_weights_from_tensor`
  takes them from a colocated trainer: a spawned process pickles fresh tensors with torch's
  reductions (`ForkingPickler`: CUDA IPC handles on a GPU, file descriptors of shared memory on
  a CPU); the engine's side, timed, opens them and copies them in (`update_from_tensors`);
- broadcast_gloo / broadcast_nccl: `transport.broadcast.send_buckets` from a pusher rank (a thread
  of this process) over a `WeightGroup` of two, `recv_buckets` on the engine's compute thread, as
  `EngineActor.receive_broadcast` does (gloo: into host tensors, then copied into a GPU engine's
  weights; NCCL: straight into them). NCCL needs the pusher on a second GPU (it refuses two ranks
  on one GPU): with one GPU, or on a CPU, it is skipped with the reason.

Each transport runs `reps` timed pushes after one warm-up, alternating the tensors and their
negation so that every push changes every weight, each timed from its start to the engine serving
the version with the bytes in place (`torch.cuda.synchronize` on a GPU, where copies are queued);
the last push is the tensors themselves, and `equal` says whether the engine's live weights then
equal them (`torch.equal`, on the device).
Each figure is the median push beside one copy of the same bytes at the device's measured copy
rate (`fraction_of_copy`, miles_async/bench/limits.py).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import statistics
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import msgspec
import torch
import torch.multiprocessing  # registers torch's reductions (tensors by handle) with ForkingPickler

from miles_async.engine import Engine, compute
from miles_async.transport import colocated
from miles_async.transport.broadcast import layout_of, recv_buckets, send_buckets
from miles_async.transport.buckets import split_buckets
from miles_async.transport.groups import WeightGroup
from miles_async.transport.shm import SharedWeights

TIMEOUT_S = 120.0
BUCKET_BYTES = 64 << 20  # WeightSyncConfig's default bucket_mib
Named = dict[str, torch.Tensor]


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU's kernels return once queued; a CPU's when done)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def nbytes_of(named: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named.values())


def _equal(live: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> bool:
    return all(torch.equal(live[name], tensor.to(live[name].device)) for name, tensor in expected.items())


def figure(times_s: list[float], nbytes: int, copy_bytes_per_s: float) -> dict[str, Any]:
    """Median seconds per push, GB/s, and the fraction of one copy of the bytes at the copy rate."""
    median_s = statistics.median(times_s)
    return {"s_per_update": median_s, "gb_per_s": nbytes / median_s / 1e9,
            "fraction_of_copy": nbytes / copy_bytes_per_s / median_s, "reps_s": times_s}


async def _pushes(engine: Engine, new: Named, old: Named, reps: int,
                  push: Callable[[Named, int], Awaitable[Any]]) -> tuple[list[float], Any]:
    """One warm-up push and `reps` timed ones, alternating `old` and `new`, `new` last; each
    timed from the call to the engine serving the version. Returns the timed seconds and the
    last push's result."""
    times, result = [], None
    for i in range(reps + 1):
        source = new if (reps - i) % 2 == 0 else old
        t0 = time.perf_counter()
        result = await push(source, engine.weights.version + 1)
        sync(engine.device)  # the copies (and NCCL's receives) are queued on the GPU when the push returns
        times.append(time.perf_counter() - t0)
    return times[1:], result


async def colocated_sync(engine: Engine, new: Named, old: Named, reps: int, copy_bytes_per_s: float) -> dict:
    name = f"bench-gpu-{os.getpid()}"
    colocated.register(name, engine.weights)
    try:
        times, aliased = await _pushes(engine, new, old, reps,
                                       lambda source, version: colocated.handoff(name, source, version))
    finally:
        colocated.unregister(name)
    return {**figure(times, nbytes_of(new), copy_bytes_per_s), "num_aliased": aliased,
            "num_copied": len(new) - aliased, "equal": await compute.run(_equal, engine.weights.live, new)}


def _write_segment(segment: str, source: Named) -> None:
    """The pusher's side of the shm transport (actors/weights.py `_write_segments`)."""
    handle = SharedWeights.attach(segment)
    try:
        handle.write(source.items())
    finally:
        handle.close()


async def shm_sync(model_dir: str, config: Any, new: Named, old: Named, reps: int, copy_bytes_per_s: float) -> dict:
    """A second engine with its weights in shared memory (CPU only), pushed to by segment name."""
    engine = Engine.from_pretrained(model_dir, config=msgspec.structs.replace(config, shared_weights=True))

    async def push(source: Named, version: int) -> None:
        await engine.weights.begin_update(version)
        segment = engine.weights.target_segment
        assert segment is not None, "a shared, double-buffered store has a target segment"
        await asyncio.to_thread(_write_segment, segment, source)
        await engine.weights.commit_update()

    try:
        async with engine:
            times, _ = await _pushes(engine, new, old, reps, push)
            equal = await compute.run(_equal, engine.weights.live, new)
    finally:
        await compute.run(engine.weights.close)
    return {**figure(times, nbytes_of(new), copy_bytes_per_s), "equal": equal,
            "implementation": "EngineConfig(shared_weights=True); SharedWeights.attach(target_segment).write"}


def _ipc_pusher(conn: Any, device: str, specs: dict[str, tuple[list[int], str]], num_pushes: int) -> None:
    """The other process of the ipc transport: seeded tensors on `device`, fresh copies pickled by
    handle for every push (the last one the tensors themselves, the others negated), each kept
    alive until the engine says it is done with it."""
    try:
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)
        generator = torch.Generator(device=device).manual_seed(1)
        base = {name: torch.randn(shape, generator=generator, device=device).to(getattr(torch, dtype))
                for name, (shape, dtype) in specs.items()}
        for i in range(num_pushes):
            named = {name: t.clone() if (num_pushes - 1 - i) % 2 == 0 else t.neg() for name, t in base.items()}
            sync(device)
            t0 = time.perf_counter()
            payload = bytes(ForkingPickler.dumps(named))
            conn.send(("ok", time.perf_counter() - t0, payload))
            conn.recv()  # the engine has copied them: they may go
            del named
        conn.send(("done", 0.0, b""))
    except Exception:  # noqa: BLE001 - a process boundary: the parent raises it with the traceback
        conn.send(("crash", 0.0, traceback.format_exc().encode()))


async def ipc_sync(engine: Engine, reps: int, copy_bytes_per_s: float) -> dict:
    live = engine.weights.live
    specs = {name: (list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in live.items()}
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_ipc_pusher, args=(theirs, str(engine.device), specs, reps + 1), daemon=True)
    proc.start()
    times, serialize_s, equal, finished = [], [], False, False

    async def receive() -> tuple[float, bytes]:
        if not await asyncio.to_thread(ours.poll, TIMEOUT_S):
            raise TimeoutError(f"the ipc pusher process sent nothing in {TIMEOUT_S:g} s")
        status, seconds, payload = ours.recv()
        if status == "crash":
            raise RuntimeError(f"the ipc pusher process failed:\n{payload.decode()}")
        return seconds, payload

    try:
        for i in range(reps + 1):
            seconds, payload = await receive()
            t0 = time.perf_counter()
            named = await compute.run(ForkingPickler.loads, payload)  # opens the handles
            await engine.weights.update_from_tensors(named, engine.weights.version + 1)
            sync(engine.device)
            times.append(time.perf_counter() - t0)
            serialize_s.append(seconds)
            if i == reps:
                equal = await compute.run(_equal, engine.weights.live, named)
            del named
            ours.send("next")
        await receive()  # "done"
        finished = True
    finally:
        if not finished:  # it waits for a word that will not come
            proc.kill()
        proc.join(TIMEOUT_S / 4)
        if proc.is_alive():
            proc.kill()
    handles = "CUDA IPC" if engine.device.type == "cuda" else "file descriptors (shared memory)"
    return {**figure(times[1:], nbytes_of(live), copy_bytes_per_s), "equal": equal, "handles": handles,
            "pusher_serialize_s": statistics.median(serialize_s[1:]),
            "implementation": "ForkingPickler (torch.multiprocessing reductions) -> update_from_tensors"}


def nccl_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"NCCL moves GPU memory only and the engine runs on {device}"
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    if torch.cuda.device_count() < 2:
        return (f"the pusher and the engine need two GPUs (NCCL refuses two ranks on one GPU); "
                f"{torch.cuda.device_count()} visible")
    return None


def _pusher_device(engine_device: torch.device, backend: str) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")  # gloo moves host memory: the pusher sends from the host
    return torch.device("cuda", 1 if (engine_device.index or 0) == 0 else 0)


async def broadcast_sync(engine: Engine, new: Named, old: Named, reps: int, copy_bytes_per_s: float,
                         backend: str) -> dict:
    """Pusher rank 0 on a thread of this process, the engine rank 1 on its compute thread."""
    pusher_device = _pusher_device(engine.device, backend)
    sources = {id(new): {n: t.to(pusher_device) for n, t in new.items()},
               id(old): {n: t.to(pusher_device) for n, t in old.items()}}
    layout = layout_of(split_buckets(new, BUCKET_BYTES))
    in_place = engine.device.type == "cpu" or backend == "nccl"  # as EngineActor.receive_broadcast
    store = WeightGroup.open_store("127.0.0.1", 2, TIMEOUT_S)
    name = f"bench-gpu-{backend}"

    def join_as_pusher() -> WeightGroup:
        if pusher_device.type == "cuda":
            torch.cuda.set_device(pusher_device)  # this thread's current GPU: NCCL's rank 0 lives there
        return WeightGroup.join("127.0.0.1", store.port, 0, 2, backend=backend, timeout_s=TIMEOUT_S, name=name,
                                store=store)

    pusher_thread = _Thread()
    pusher, receiver = await asyncio.gather(pusher_thread.run(join_as_pusher), compute.run(functools.partial(
        WeightGroup.join, "127.0.0.1", store.port, 1, 2, backend=backend, timeout_s=TIMEOUT_S, name=name)))

    async def push(source: Named, version: int) -> None:
        buckets = split_buckets(sources[id(source)], BUCKET_BYTES)
        sent = pusher_thread.run(functools.partial(send_buckets, buckets, pusher, device=pusher_device))
        target = await engine.weights.begin_update(version)
        received = await compute.run(functools.partial(
            recv_buckets, layout, receiver, out=target if in_place else None,
            device=engine.device if in_place else "cpu"))
        if in_place:
            engine.weights.mark_written(received)
        else:
            await compute.run(engine.weights.write, received)
        await sent
        await engine.weights.commit_update()

    try:
        times, _ = await _pushes(engine, new, old, reps, push)
    finally:
        await asyncio.gather(pusher_thread.run(pusher.close), compute.run(receiver.close))
        pusher_thread.close()
    return {**figure(times, nbytes_of(new), copy_bytes_per_s), "equal": await compute.run(
        _equal, engine.weights.live, new), "backend": backend, "pusher_device": str(pusher_device),
        "num_buckets": len(layout), "bucket_bytes": BUCKET_BYTES, "received_into": (
            "the engine's weights" if in_place else "host tensors, then copied into the engine's weights")}


class _Thread:
    """One thread for every call of the pusher rank (`asyncio.to_thread` may pick another each
    time): the current GPU that NCCL's rank 0 was joined on is per thread."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-gpu-pusher")

    def run(self, fn: Callable[[], Any]) -> asyncio.Future:
        return asyncio.wrap_future(self._executor.submit(fn))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


async def weight_sync(engine: Engine, model_dir: str, config: Any, new: Named, reps: int,
                      copy_bytes_per_s: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every transport this machine has, into `engine` (the module docstring); the others skipped."""
    old = await compute.run(lambda: {name: t.neg() for name, t in new.items()})
    out: dict[str, Any] = {"bytes": nbytes_of(new), "num_tensors": len(new), "reps": reps,
                           "dtype": str(next(iter(new.values())).dtype).removeprefix("torch.")}
    out["colocated"] = await colocated_sync(engine, new, old, reps, copy_bytes_per_s)
    if engine.device.type == "cpu":
        out["shm"] = await shm_sync(model_dir, config, new, old, reps, copy_bytes_per_s)
    else:
        out["shm"] = {"skipped": f"the shm transport keeps the engine's weights in CPU shared memory "
                                 f"(EngineConfig.shared_weights, device cpu only); this engine is on {engine.device}"}
    out["ipc"] = await ipc_sync(engine, reps, copy_bytes_per_s)
    out["broadcast_gloo"] = await broadcast_sync(engine, new, old, reps, copy_bytes_per_s, "gloo")
    reason = nccl_skip_reason(engine.device)
    out["broadcast_nccl"] = ({"skipped": reason} if reason is not None else
                             await broadcast_sync(engine, new, old, reps, copy_bytes_per_s, "nccl"))
    for transport in ("colocated", "shm", "ipc", "broadcast_gloo", "broadcast_nccl"):
        row = out[transport]
        progress(f"weight sync, {transport}: " + (f"skipped ({row['skipped']})" if "skipped" in row else
                                                  f"{row['s_per_update'] * 1e3:.1f} ms a push (equal: {row['equal']})"))
    return out
