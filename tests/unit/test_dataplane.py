"""In-process tests of the data plane: segments, bounds, frees, and reads by other systems.

Each test gets a fresh folder under the shared-memory folder and checks, at the end, that nothing
was left in it. Systems other than the owner live in this process too, over real ipc sockets;
child processes are tested in tests/dist/test_dataplane_processes.py.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from miles_async.runtime import (
    ActorAddress,
    ActorSystem,
    BlobGoneError,
    BlobRef,
    DataPlaneFullError,
    RuntimeConfig,
    run,
    segments,
)
from miles_async.runtime.dataplane import ALIGN_BYTES, DATAPLANE_ACTOR, HEADER_BYTES, default_dataplane_dir
from miles_async.runtime.messages import ReadBlob

TIMEOUT_S = 30.0
SEGMENT_BYTES = 64 * 1024
KiB = 1024


def arun(coro):
    return run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="dp-unit-", dir=default_dataplane_dir())
    try:
        yield path
        assert os.listdir(path) == [], "segments were left behind"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cfg(folder: str, **overrides) -> RuntimeConfig:
    fields = {"dataplane_dir": folder, "dataplane_segment_bytes": SEGMENT_BYTES}
    fields.update(overrides)
    return RuntimeConfig(**fields)


def files(folder: str) -> list[str]:
    return sorted(os.listdir(folder))


async def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true within {timeout_s:g}s")
        await asyncio.sleep(0.01)


def test_put_read_free_in_place(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            arr = np.arange(1000, dtype=np.int32)
            inputs = [b"abc" * 100, bytearray(b"xyz" * 7), memoryview(b"0123456789")[2:8], arr]
            refs = [dp.put(x) for x in inputs]
            assert all(r.owner == system.address for r in refs)
            views = [await dp.read(r) for r in refs]
            for x, view in zip(inputs, views):
                assert view.readonly
                assert bytes(view) == bytes(memoryview(x).cast("B"))
            assert np.array_equal(np.frombuffer(views[3], dtype=np.int32), arr)
            # zero copy: every view is a window of the one segment mapping
            assert isinstance(views[0].obj, mmap.mmap)
            assert all(view.obj is views[0].obj for view in views)
            stats = dp.stats
            assert (stats.num_blobs, stats.num_segments, stats.segment_bytes) == (4, 1, SEGMENT_BYTES)
            assert stats.bytes_held == sum(r.size for r in refs) == 300 + 21 + 6 + 4000
            assert (stats.num_mapped_reads, stats.num_fetched_reads) == (4, 0)
            for view in views:
                view.release()
            dp.free(refs)
            assert (dp.stats.num_blobs, dp.stats.bytes_held) == (0, 0)

    arun(main())


def test_offsets_are_aligned_and_zero_byte_blobs_work(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            sizes = [1, 63, 64, 65, 0, 1000, 7, 0]
            blobs = [os.urandom(n) for n in sizes]
            refs = [dp.put(b) for b in blobs]
            assert all(r.offset % ALIGN_BYTES == 0 for r in refs)
            assert len({r.offset for r in refs}) == len(refs)  # a zero-byte blob has an offset of its own
            assert refs[0].offset == HEADER_BYTES
            for blob, ref in zip(blobs, refs):
                assert bytes(await dp.read(ref)) == blob
            dp.free(refs)

    arun(main())


def test_segments_roll_over_and_are_unlinked_when_empty(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            a, b, c = (dp.put(os.urandom(30 * KiB)) for _ in range(3))
            assert a.segment == b.segment != c.segment  # c did not fit the first segment's remainder
            assert files(shm_dir) == sorted([a.segment, c.segment])
            assert all(name.startswith(segments.process_prefix()) for name in files(shm_dir))
            assert dp.stats.num_segments == 2

            dp.free([a])
            assert files(shm_dir) == sorted([a.segment, c.segment])  # b still lives there
            dp.free([b])
            assert files(shm_dir) == [c.segment]  # emptied and not current: unlinked
            assert (dp.stats.num_segments, dp.stats.segment_bytes) == (1, SEGMENT_BYTES)

            dp.free([c])  # the current segment empties: it stays, and starts over under a new token
            assert files(shm_dir) == [c.segment]
            d = dp.put(b"fresh")
            assert (d.segment, d.offset) == (c.segment, HEADER_BYTES)
            assert d.token != c.token
            with pytest.raises(BlobGoneError):
                await dp.read(c)  # the same offset now holds d: the old ref must not read it
            dp.free([c])  # a no-op, and d survives it
            assert bytes(await dp.read(d)) == b"fresh"
            dp.free([d])

    arun(main())


def test_a_blob_larger_than_a_segment_gets_its_own(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            small = dp.put(b"s" * 100)
            data = os.urandom(3 * SEGMENT_BYTES + 5)
            big = dp.put(data)
            after = dp.put(b"t" * 100)
            assert big.segment not in (small.segment, after.segment)
            assert after.segment == small.segment  # the current segment is untouched
            assert os.path.getsize(os.path.join(shm_dir, big.segment)) == HEADER_BYTES + 3 * SEGMENT_BYTES + ALIGN_BYTES
            assert bytes(await dp.read(big)) == data
            assert dp.stats.num_segments == 2
            dp.free([big])
            assert files(shm_dir) == [small.segment]
            dp.free([small, after])

    arun(main())


def test_the_bound_fails_a_put_with_a_named_error(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir, dataplane_max_bytes=4 * SEGMENT_BYTES)) as system:
            dp = system.dataplane
            refs = [dp.put(os.urandom(60 * KiB)) for _ in range(4)]  # one segment each
            assert dp.stats.segment_bytes == 4 * SEGMENT_BYTES
            with pytest.raises(DataPlaneFullError) as err:
                dp.put(os.urandom(61 * KiB))
            text = str(err.value)
            assert "RuntimeConfig.dataplane_max_bytes" in text and str(4 * SEGMENT_BYTES) in text
            assert f"{4 * 60 * KiB} bytes in 4 live blobs" in text  # what is held
            assert f"a {61 * KiB}-byte blob" in text
            with pytest.raises(DataPlaneFullError):
                dp.put(b"x" * (5 * SEGMENT_BYTES))  # could never fit
            assert dp.stats.num_blobs == 4 and len(files(shm_dir)) == 4  # a failed put leaves nothing
            dp.free(refs[:1])
            refs[0] = dp.put(os.urandom(61 * KiB))  # room again
            dp.free(refs)

    arun(main())


def test_double_free_is_a_logged_no_op(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            a, b = dp.put(b"a" * 10), dp.put(b"b" * 10)
            dp.free([a])
            with caplog.at_level(logging.DEBUG, logger="miles_async.runtime"):
                dp.free([a])
                dp.free([a, a])
            assert "freed twice" in caplog.text
            assert (dp.stats.num_blobs, dp.stats.bytes_held) == (1, 10)
            assert bytes(await dp.read(b)) == b"b" * 10
            dp.free([b])

    arun(main())


def test_reading_a_freed_blob_fails_clearly(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            dp = system.dataplane
            keep, gone = dp.put(b"keep"), dp.put(b"gone")
            dp.free([gone])
            with pytest.raises(BlobGoneError) as err:
                await dp.read(gone)
            text = str(err.value)
            assert gone.segment in text and system.address in text and "freed" in text
            never = BlobRef(owner=system.address, segment=f"{segments.process_prefix(1)}dpab-1", token=1, offset=64, size=4)
            with pytest.raises(BlobGoneError):
                await dp.read(never)
            dp.free([keep])

    arun(main())


def test_put_refuses_a_strided_buffer(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            with pytest.raises(ValueError, match="C-contiguous"):
                system.dataplane.put(np.arange(100, dtype=np.int64)[::2])

    arun(main())


def test_close_unlinks_every_segment_and_held_views_stay_readable(shm_dir: str) -> None:
    async def main() -> None:
        system = ActorSystem(config=cfg(shm_dir))
        await system.start()
        dp = system.dataplane
        data = os.urandom(40 * KiB)
        refs = [dp.put(data) for _ in range(3)] + [dp.put(os.urandom(2 * SEGMENT_BYTES))]
        assert len(files(shm_dir)) == 4
        held = await dp.read(refs[0])
        await system.close()
        assert files(shm_dir) == []
        assert bytes(held) == data  # its mapping outlives the file until the view goes
        held.release()
        with pytest.raises(RuntimeError, match="closed"):
            dp.put(b"late")

    arun(main())


def test_same_node_systems_map_and_other_folders_fetch(shm_dir: str) -> None:
    async def main() -> None:
        other_dir = tempfile.mkdtemp(prefix="dp-unit-other-", dir=default_dataplane_dir())
        try:
            async with ActorSystem("owner", config=cfg(shm_dir)) as owner:
                peer_cfg = cfg(shm_dir)
                far_cfg = cfg(other_dir, max_message_bytes=64 * KiB)  # 16 KiB pieces
                async with ActorSystem("peer", config=peer_cfg, directory=owner.address) as peer, \
                        ActorSystem("far", config=far_cfg, directory=owner.address) as far:
                    data = os.urandom(1_000_000)
                    ref = owner.dataplane.put(data)

                    view = await peer.dataplane.read(ref)  # same folder: mapped read-only, in place
                    assert bytes(view) == data and isinstance(view.obj, mmap.mmap) and view.readonly
                    view.release()
                    stats = peer.dataplane.stats
                    assert (stats.num_mapped_reads, stats.num_fetched_reads, stats.num_peer_mappings) == (1, 0, 1)

                    view = await far.dataplane.read(ref)  # another folder: fetched in pieces
                    assert bytes(view) == data and view.readonly
                    stats = far.dataplane.stats
                    assert (stats.num_mapped_reads, stats.num_fetched_reads) == (0, 1)
                    assert stats.num_fetched_pieces == -(-len(data) // (16 * KiB - 64))
                    assert stats.bytes_fetched == len(data)
                    assert bytes(await far.dataplane.read(ref)) == data  # decided once, fetched again
                    assert far.dataplane.stats.num_fetched_reads == 2

                    far.dataplane.free([ref])  # a FreeBlobs tell to the owner
                    await wait_until(lambda: owner.dataplane.stats.num_blobs == 0, "the owner frees the blob")
                    assert files(shm_dir) == []  # a blob larger than a segment had its own
                    with pytest.raises(BlobGoneError, match="freed"):
                        await far.dataplane.read(ref)  # the owner's check, sent back
                    with pytest.raises(BlobGoneError, match="unlinked"):
                        await peer.dataplane.read(ref)  # its cached mapping is marked retired

                    small = owner.dataplane.put(b"small")
                    assert bytes(await peer.dataplane.read(small)) == b"small"
                    peer.dataplane.free([small])
                    await wait_until(lambda: owner.dataplane.stats.num_blobs == 0, "the owner frees the blob")
                    with pytest.raises(BlobGoneError, match="recycled"):
                        await peer.dataplane.read(small)  # the emptied current segment has a new token
                    fresh = owner.dataplane.put(b"fresh")
                    assert fresh.offset == small.offset
                    assert bytes(await peer.dataplane.read(fresh)) == b"fresh"  # same mapping, new token
                    assert peer.dataplane.stats.num_peer_mappings == 2
                    assert peer.dataplane.stats.num_fetched_reads == 0
                    owner.dataplane.free([fresh])
        finally:
            assert os.listdir(other_dir) == []
            shutil.rmtree(other_dir, ignore_errors=True)

    arun(main())


def test_peer_mappings_are_bounded(shm_dir: str) -> None:
    async def main() -> None:
        async with ActorSystem("owner", config=cfg(shm_dir)) as owner, \
                ActorSystem("peer", config=cfg(shm_dir, dataplane_max_peer_mappings=2),
                            directory=owner.address) as peer:
            blobs = [os.urandom(40 * KiB) for _ in range(3)]
            refs = [owner.dataplane.put(b) for b in blobs]
            assert len({r.segment for r in refs}) == 3
            views = [await peer.dataplane.read(r) for r in refs]
            assert peer.dataplane.stats.num_peer_mappings == 2  # the first was evicted
            assert [bytes(v) for v in views] == blobs  # its view still holds its mapping
            assert bytes(await peer.dataplane.read(refs[0])) == blobs[0]  # mapped again
            assert peer.dataplane.stats.num_fetched_reads == 0
            for view in views:
                view.release()
            owner.dataplane.free(refs)

    arun(main())


def test_reap_process_unlinks_only_that_pids_segments(shm_dir: str) -> None:
    dead_pid = 4_000_000 + os.getpid()  # above any pid_max: surely not running
    dead, other = segments.process_prefix(dead_pid), segments.process_prefix(dead_pid * 10 + 1)
    weights = os.path.join(segments.default_folder(), f"{dead}w0a1b2c")  # a shared-weights segment of it
    for path in (os.path.join(shm_dir, f"{dead}dpab12-1"), os.path.join(shm_dir, f"{dead}dpab12-2"),
                 os.path.join(shm_dir, f"{other}dpcd-1"), weights):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)

    async def main() -> None:
        async with ActorSystem(config=cfg(shm_dir)) as system:
            mine = system.dataplane.put(b"mine")
            assert system.dataplane.reap_process(dead_pid) == 3
            assert files(shm_dir) == sorted([f"{other}dpcd-1", mine.segment])
            assert not os.path.exists(weights)
            with pytest.raises(ValueError):
                system.dataplane.reap_process(os.getpid())
            os.unlink(os.path.join(shm_dir, f"{other}dpcd-1"))
            system.dataplane.free([mine])

    arun(main())


def test_config_checks_the_data_plane_settings(tmp_path) -> None:
    with pytest.raises(ValueError, match="dataplane_segment_bytes"):
        RuntimeConfig(dataplane_segment_bytes=2 * SEGMENT_BYTES, dataplane_max_bytes=SEGMENT_BYTES)
    with pytest.raises(ValueError, match="dataplane_max_peer_mappings"):
        RuntimeConfig(dataplane_max_peer_mappings=0)

    async def main() -> None:
        with pytest.raises(ValueError, match="dataplane_dir"):
            await ActorSystem(config=RuntimeConfig(dataplane_dir=str(tmp_path / "missing"))).start()

    arun(main())


def test_the_owner_refuses_bad_pieces_and_survives_a_failing_tell(shm_dir: str, tmp_path) -> None:
    async def main() -> None:
        small = cfg(shm_dir, max_message_bytes=64 * KiB)
        far_dir = tmp_path / "far"
        far_dir.mkdir()
        async with ActorSystem("owner", config=small) as owner, \
                ActorSystem("far", config=cfg(str(far_dir), max_message_bytes=64 * KiB),
                            directory=owner.address) as far:
            data = os.urandom(100 * KiB)
            ref = owner.dataplane.put(data)
            with pytest.raises(ValueError, match="does not fit a reply frame"):
                owner.dataplane.serve_read(ref, 0, 100 * KiB)
            with pytest.raises(ValueError, match="outside"):
                owner.dataplane.serve_read(ref, 90 * KiB, 20 * KiB)
            # a ReadBlob sent as a tell fails in the handler with nobody to tell: `$dataplane`
            # logs it and keeps serving (a system actor is not crashed by one bad tell)
            host = far.ref(ActorAddress(name=DATAPLANE_ACTOR, address=owner.address, capacity=16))
            gone = BlobRef(owner=owner.address, segment=ref.segment, token=ref.token + 1, offset=64, size=8)
            await host.tell(ReadBlob(ref=gone, offset=0, length=8))
            with pytest.raises(BlobGoneError):
                await far.dataplane.read(gone)
            assert bytes(await far.dataplane.read(ref)) == data
            owner.dataplane.free([ref])

    arun(main())
