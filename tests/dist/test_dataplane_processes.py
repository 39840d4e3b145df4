"""The data plane across processes: same-node reads in place, remote reads in pieces (ipc, and tcp
with CURVE), frees sent to the owner, and a SIGKILLed child's segments unlinked by its parent.

Each test uses a fresh folder under the shared-memory folder as `dataplane_dir` and checks at the
end that no segment was left in it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest
import zmq
from _actors import BlobKeeper, FreeRefs, Pid, PlaneStats, PutRandom, ReadRef
from _support import config, raises_within, scenario, signal_if_alive, wait_until

from miles_async.runtime import ActorSystem, BlobGoneError, segments
from miles_async.runtime.dataplane import MAX_PIECE_BYTES, default_dataplane_dir

TIMEOUT_S = 120.0
MiB = 1024 * 1024
BIG_BYTES = 100 * MiB


def _folder(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir=default_dataplane_dir())


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = _folder("dp-dist-")
    try:
        yield path
        assert os.listdir(path) == [], "segments were left behind"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _segments_of(folder: str, pid: int) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith(segments.process_prefix(pid)))


def test_parent_and_child_read_each_others_blobs_in_place_and_free_them(shm_dir: str) -> None:
    async def main() -> None:
        cfg = config("ipc", dataplane_dir=shm_dir, dataplane_segment_bytes=MiB)
        async with ActorSystem(config=cfg) as system:
            keeper = await system.spawn(BlobKeeper, "keeper", process=True)
            child_pid = await keeper.ask(Pid())

            # the parent reads the child's blob through a read-only mapping of its segment
            theirs = await keeper.ask(PutRandom(num_bytes=200_000))
            assert theirs.ref.owner == keeper.address and theirs.ref.segment.startswith(segments.process_prefix(child_pid))
            view = await system.dataplane.read(theirs.ref)
            assert hashlib.sha256(view).hexdigest() == theirs.sha256
            view.release()
            stats = system.dataplane.stats
            assert (stats.num_mapped_reads, stats.num_fetched_reads, stats.num_peer_mappings) == (1, 0, 1)

            # the child reads the parent's blob the same way
            data = os.urandom(300_000)
            mine = system.dataplane.put(data)
            read = await keeper.ask(ReadRef(ref=mine))
            assert read.sha256 == hashlib.sha256(data).hexdigest()
            assert (read.stats.num_mapped_reads, read.stats.num_fetched_reads) == (1, 0)

            # frees from the other process reach the owner: the child's blob larger than a
            # segment had a segment of its own, which goes
            big = await keeper.ask(PutRandom(num_bytes=3 * MiB))
            assert len(_segments_of(shm_dir, child_pid)) == 2
            system.dataplane.free([big.ref, theirs.ref])
            await wait_until(lambda: big.ref.segment not in os.listdir(shm_dir), 20, "the child unlinks its segment")
            child_stats = await keeper.ask(PlaneStats())
            assert (child_stats.num_blobs, child_stats.num_segments) == (0, 1)  # the current one stays
            await keeper.ask(FreeRefs(refs=[mine]))
            await wait_until(lambda: system.dataplane.stats.num_blobs == 0, 20, "the parent frees its blob")

    scenario(main, TIMEOUT_S)


@pytest.mark.parametrize("transport", ["ipc", "tcp-curve"])
def test_remote_reads_move_100mb_intact_in_pieces(shm_dir: str, transport: str) -> None:
    curve = transport == "tcp-curve"
    if curve and not zmq.has("curve"):
        pytest.skip("this libzmq was built without CURVE")
    kind = "tcp" if curve else "ipc"

    async def main() -> None:
        other_dir = _folder("dp-dist-reader-")
        try:
            async with ActorSystem(config=config(kind, curve=curve, dataplane_dir=shm_dir)) as system:
                keeper = await system.spawn(BlobKeeper, "keeper", process=True)
                info = await keeper.ask(PutRandom(num_bytes=BIG_BYTES), timeout_s=60)
                if curve:
                    assert system.curve_keys is not None and info.ref.owner.startswith("tcp://")
                # a reader whose folder is another one cannot map the segment, as on another node
                key_dir = os.path.join(system.run_dir, "keys") if curve else None
                reader_cfg = config(kind, curve=curve, dataplane_dir=other_dir)
                async with ActorSystem("reader", config=reader_cfg, directory=system.address,
                                       key_dir=key_dir) as reader:
                    view = await reader.dataplane.read(info.ref)
                    assert hashlib.sha256(view).hexdigest() == info.sha256
                    view.release()
                    stats = reader.dataplane.stats
                    piece_bytes = min(MAX_PIECE_BYTES, reader_cfg.max_message_bytes // 4 - 64)
                    assert (stats.num_mapped_reads, stats.num_fetched_reads) == (0, 1)
                    assert stats.num_fetched_pieces == -(-BIG_BYTES // piece_bytes) >= 4
                    assert stats.bytes_fetched == BIG_BYTES
                    reader.dataplane.free([info.ref])
                    await wait_until(lambda: os.listdir(shm_dir) == [], 20, "the owner unlinks the 100 MB segment")
                    err, _ = await raises_within(reader.dataplane.read(info.ref), 20)
                    assert isinstance(err, BlobGoneError) and "freed" in str(err), err
        finally:
            assert os.listdir(other_dir) == []
            shutil.rmtree(other_dir, ignore_errors=True)

    scenario(main, TIMEOUT_S)


def test_a_sigkilled_childs_segments_are_unlinked_by_its_parent(shm_dir: str) -> None:
    async def main() -> None:
        cfg = config("ipc", dataplane_dir=shm_dir, dataplane_segment_bytes=MiB)
        async with ActorSystem(config=cfg) as system:
            keeper = await system.spawn(BlobKeeper, "keeper", process=True)
            pid = await keeper.ask(Pid())
            try:
                infos = [await keeper.ask(PutRandom(num_bytes=n)) for n in (600_000, 600_000, 600_000, 3 * MiB)]
                view = await system.dataplane.read(infos[0].ref)  # the parent maps one of them
                assert hashlib.sha256(view).hexdigest() == infos[0].sha256
                view.release()
                assert len(_segments_of(shm_dir, pid)) == 4  # three 1 MiB segments, and the big blob's own
                os.kill(pid, signal.SIGKILL)
                await wait_until(lambda: _segments_of(shm_dir, pid) == [], 20, "the parent unlinks the dead child's segments")
                err, _ = await raises_within(system.dataplane.read(infos[0].ref), 20)
                assert isinstance(err, BlobGoneError) and keeper.address in str(err), err
            finally:
                signal_if_alive(pid, signal.SIGKILL)

    scenario(main, TIMEOUT_S)
