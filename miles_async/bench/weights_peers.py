"""The two-process half of `miles-async bench weights`: our bucketed broadcast beside a raw one.

Two spawned processes join a gloo group over loopback TCP. Rank 0 (the trainer) holds the
weights; rank 1 (an engine) holds same-shaped tensors it receives into in place. Each round
times, on the receiving rank after a barrier, (a) `send_buckets` / `recv_buckets` of the whole
model and (b) one raw `dist.broadcast` of a flat uint8 tensor of the model's byte count (what
`send_buckets` sends, less its 8-byte layout fingerprint), the floor that gloo sets here. Both
use the same pair, the same connections and preallocated buffers; the two alternate which goes
first from round to round, so machine drift and ordering effects hit both alike. The first round
warms up connections and pages and is not timed. At the end the receiver's checksums are
compared with the sender's (bit-exact or not).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import time
import traceback

import torch

TIMEOUT_S = 120.0


def model_weights(shapes: dict[str, tuple[int, ...]], seed: int | None) -> dict[str, torch.Tensor]:
    """fp32 tensors of `shapes`: N(0, 0.02) values when `seed` is given, else uninitialised."""
    if seed is None:
        return {name: torch.empty(shape) for name, shape in shapes.items()}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, shapes: dict, bucket_bytes: int, reps: int, queue: mp.Queue) -> None:
    import torch.distributed as dist

    from miles_async.transport.broadcast import layout_of, recv_buckets, send_buckets, staging_for
    from miles_async.transport.buckets import split_buckets
    from miles_async.transport.verify import checksums

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        weights = model_weights(shapes, seed=0 if rank == 0 else None)
        buckets = split_buckets(weights, bucket_bytes)
        layout = layout_of(buckets)
        staging = staging_for(layout)  # kept between updates, as a pusher and an engine would
        total = sum(t.numel() * t.element_size() for t in weights.values())
        raw = torch.zeros(total, dtype=torch.uint8)
        ours_s: list[float] = []
        raw_s: list[float] = []
        bytes_sent = 0

        def ours() -> None:
            nonlocal bytes_sent
            if rank == 0:
                bytes_sent = send_buckets(buckets, staging=staging)
            else:
                recv_buckets(layout, out=weights, staging=staging)

        for round_index in range(reps + 1):  # round 0 warms up connections and pages
            order = [(ours, ours_s), (lambda: dist.broadcast(raw, src=0), raw_s)]
            for fn, times in order if round_index % 2 == 0 else order[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        sums = checksums(weights)
        queue.put((rank, "ok", {"ours_s": ours_s[1:], "raw_s": raw_s[1:], "checksums": sums,
                                "num_buckets": len(buckets), "bytes": total, "bytes_sent": bytes_sent}))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a process boundary: the parent raises it with the traceback
        queue.put((rank, "crash", traceback.format_exc()))


def gloo_pair(shapes: dict[str, tuple[int, ...]], bucket_bytes: int, reps: int) -> dict:
    """Run both ranks; return the receiver's timings (`reps` of each, after a warm-up round), the
    bytes `send_buckets` sent and the raw broadcast's, and whether the receiver's bytes equal the
    sender's."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, shapes, bucket_bytes, reps, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    results: dict[int, dict] = {}
    try:
        while len(results) < 2:
            rank, status, payload = queue.get(timeout=TIMEOUT_S)
            if status != "ok":
                raise RuntimeError(f"broadcast bench rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S / 4)
            if proc.is_alive():
                proc.kill()
    receiver = results[1]
    return {"ours_s": receiver["ours_s"], "raw_s": receiver["raw_s"], "num_buckets": receiver["num_buckets"],
            "bytes": receiver["bytes"], "bytes_sent": results[0]["bytes_sent"],
            "bit_exact": receiver["checksums"] == results[0]["checksums"]}
