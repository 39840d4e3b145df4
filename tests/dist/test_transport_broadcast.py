"""Broadcast transport over gloo between two real spawned processes: bit-exact transfer, checked
with the random-fill verification, through both paths (packed small tensors, direct large ones,
into contiguous and strided engine tensors); a rank with a different layout fails with
TransportError."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import traceback

import torch

from miles_async.transport.broadcast import (
    layout_from_json,
    layout_of,
    layout_to_json,
    recv_buckets,
    send_buckets,
    staging_for,
)
from miles_async.transport.buckets import split_buckets
from miles_async.transport.errors import TransportError
from miles_async.transport.verify import checksums, compare, random_fill

TIMEOUT_S = 90.0
BUCKET_BYTES = 1024
PACK_MAX_BYTES = 512  # below the default, so that this small model has tensors on both paths


def weights(seed: int) -> dict[str, torch.Tensor]:
    named = {"embed": torch.empty(40, 16), "layers.0.qkv": torch.empty(24, 16, dtype=torch.bfloat16),
             "layers.0.norm": torch.empty(16, dtype=torch.float16), "layers.1.w": torch.empty(300),
             "counts": torch.empty(5, dtype=torch.int64), "empty": torch.empty(0, 3)}
    random_fill(named, seed)
    return named


def engine_weights(seed: int) -> dict[str, torch.Tensor]:
    """Like `weights`, but "embed" (direct) and "layers.0.norm" (packed) are strided views."""
    named = weights(seed)
    named["embed"] = torch.empty(16, 40).t()
    named["layers.0.norm"] = torch.empty(32, dtype=torch.float16)[::2]
    random_fill(named, seed)
    return named


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, layout_json: str, in_place: bool, queue: mp.Queue) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        group = dist.new_group([0, 1])
        if rank == 0:
            buckets = split_buckets(weights(1), BUCKET_BYTES)
            sent = send_buckets(buckets, group, staging=staging_for(layout_of(buckets), PACK_MAX_BYTES),
                                pack_max_bytes=PACK_MAX_BYTES)
            queue.put((rank, "sent", sent))
        else:
            engine = engine_weights(2)
            random_fill(engine, seed=99)  # the verification's random fill: stale values must not survive
            try:
                layout = layout_from_json(layout_json)
                got = recv_buckets(layout, group, out=engine if in_place else None,
                                   staging=staging_for(layout, PACK_MAX_BYTES), pack_max_bytes=PACK_MAX_BYTES)
                queue.put((rank, "ok", checksums(engine), all(got[n] is engine[n] for n in engine)))
            except TransportError as exc:
                queue.put((rank, "transport_error", str(exc)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a process boundary: the parent sees it with the traceback
        queue.put((rank, "crash", traceback.format_exc()))


def _run_pair(layout_json: str, in_place: bool = True) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, layout_json, in_place, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple] = {}
    try:
        while len(results) < 2:
            item = queue.get(timeout=TIMEOUT_S)
            results[item[0]] = item[1:]
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S / 3)
            if proc.is_alive():
                proc.kill()
    return results


def test_two_ranks_transfer_every_bucket_bit_exactly():
    buckets = split_buckets(weights(1), BUCKET_BYTES)
    assert len(buckets) >= 3, "the test should cross several buckets"
    sizes = [t.numel() * t.element_size() for bucket in buckets for _, t in bucket]
    assert any(n > PACK_MAX_BYTES for n in sizes) and any(n <= PACK_MAX_BYTES for n in sizes), "direct and packed"
    assert any(len(b) > 1 for b in buckets)
    results = _run_pair(layout_to_json(layout_of(buckets)))
    assert results[0][0] == "sent", results[0]
    assert results[1][0] == "ok", results[1]
    expected = checksums(weights(1))
    assert compare(expected, results[1][1]) == []
    assert results[1][2], "recv_buckets must write into the engine's own tensors"
    assert results[0][1] == sum(t.numel() * t.element_size() for t in weights(1).values())


def test_a_rank_with_another_layout_refuses_the_update():
    layout = layout_of(split_buckets(weights(1), BUCKET_BYTES))
    layout[0][0] = type(layout[0][0])(layout[0][0].name, (41, 16), layout[0][0].dtype)
    results = _run_pair(layout_to_json(layout), in_place=False)
    assert results[1][0] == "transport_error" and "layout differs" in results[1][1], results[1]


def test_layout_json_round_trip():
    layout = layout_of(split_buckets(weights(1), BUCKET_BYTES))
    assert layout_from_json(layout_to_json(layout)) == layout
