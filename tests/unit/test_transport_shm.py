"""Shared-memory weights: a spawned second process attaches by name and reads exactly what was written;
a write that dies midway (an exception, or the writer process killed) is seen as torn."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_async.transport.errors import TransportError
from miles_async.transport.shm import SharedWeights
from miles_async.transport.verify import checksums, random_fill

TIMEOUT_S = 60.0


def weights(seed: int) -> dict[str, torch.Tensor]:
    named = {"embed": torch.empty(17, 8), "layers.0.w": torch.empty(3, 5, dtype=torch.bfloat16),
             "layers.0.b": torch.empty(7, dtype=torch.float16), "step": torch.empty(2, dtype=torch.int64),
             "empty": torch.empty(0, 4)}
    random_fill(named, seed)
    return named


def _reader(segment_name: str, queue: mp.Queue) -> None:
    shared = SharedWeights.attach(segment_name)
    try:
        version, copies = shared.snapshot()
        queue.put(("ok", version, checksums(copies)))
    except TransportError as exc:
        queue.put(("torn", shared.seq, str(exc)))
    shared.close()


def _dying_writer(segment_name: str, seed: int) -> None:
    shared = SharedWeights.attach(segment_name)

    def shards() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(weights(seed).items()):
            if i == 2:
                os._exit(3)  # killed midway: no cleanup, no exception handler runs
            yield item

    shared.write(shards())


def _in_child(target, *args) -> tuple:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    try:
        result = queue.get(timeout=TIMEOUT_S)
    finally:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    return result


def _segment_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


@pytest.fixture
def shared() -> Iterator[SharedWeights]:
    seg = SharedWeights.like(weights(0))
    yield seg
    seg.close()
    assert not _segment_exists(seg.name)


def test_second_process_reads_exactly_what_was_written(shared: SharedWeights):
    new = weights(1)
    assert shared.version == 0 and shared.complete
    assert shared.write(new) == 1
    status, version, sums = _in_child(_reader, shared.name)
    assert status == "ok" and version == 1
    assert sums == checksums(new)
    # the views are the engine's weights: they hold the values, in place, in this process too
    assert checksums(shared.tensors) == checksums(new)


def test_an_exception_midway_leaves_the_segment_torn_until_a_complete_write(shared: SharedWeights):
    shared.write(weights(1))

    def shards() -> Iterator[tuple[str, torch.Tensor]]:
        yield "embed", torch.zeros(17, 8)
        raise RuntimeError("pusher lost a bucket")

    with pytest.raises(RuntimeError, match="lost a bucket"):
        shared.write(shards())
    assert not shared.complete
    with pytest.raises(TransportError, match="torn"):
        shared.snapshot()
    status, seq, message = _in_child(_reader, shared.name)
    assert status == "torn" and seq % 2 == 1 and "torn" in message
    assert shared.write(weights(2)) == 3  # the torn write used up version 2: a number never names two contents
    assert shared.complete and checksums(shared.snapshot()[1]) == checksums(weights(2))


def test_a_writer_killed_midway_is_detected(shared: SharedWeights):
    shared.write(weights(1))
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_dying_writer, args=(shared.name, 5))
    proc.start()
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 3
    assert _segment_exists(shared.name), "a dead attacher must not unlink the owner's segment"
    assert not shared.complete
    with pytest.raises(TransportError, match="torn"):
        shared.snapshot()


def test_a_mapping_is_checked_before_any_byte_is_written(shared: SharedWeights):
    shared.write(weights(1))
    bad = weights(2)
    bad["layers.0.b"] = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="shape"):
        shared.write(bad)
    with pytest.raises(ValueError, match="not in shared segment"):
        shared.write({"nope": torch.zeros(1)})
    assert shared.complete and checksums(shared.snapshot()[1]) == checksums(weights(1))


def test_attach_unknown_and_close_with_live_views():
    with pytest.raises(TransportError, match="no shared weight segment"):
        SharedWeights.attach("miles-async-no-such-segment")
    seg = SharedWeights.create({"w": ((4,), torch.float32)})
    view = seg.tensors["w"]
    with pytest.raises(TransportError, match="views"):
        seg.close()
    assert not _segment_exists(seg.name)  # unlinked even so: nothing leaks in /dev/shm
    del view
    seg.close()
    with pytest.raises(ValueError, match="at least one"):
        SharedWeights.create({})
