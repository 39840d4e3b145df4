"""The data plane: bulk bytes kept in shared memory by the process that made them, read by reference.

Control messages are capped at `RuntimeConfig.max_message_bytes` and carry references, never bulk
arrays. A process puts bytes into its own data plane and sends the `BlobRef` instead; any process
of the run reads them back, in place when it can:

    ref = system.dataplane.put(token_ids.tobytes())     # a copy into a segment of this process
    await trainer.tell(Train(tokens=ref))               # ~100 bytes on the wire
    ...                                                 # in the trainer's process:
    view = await system.dataplane.read(ref)             # zero copy on the same node
    tokens = np.frombuffer(view, dtype=np.int32)
    system.dataplane.free([ref])                        # back to the owner (a FreeBlobs tell)

Storage (the owner): segments are files in a shared-memory folder (`RuntimeConfig.dataplane_dir`,
/dev/shm by default), mode 0600, named `miles-<run>-<pid>-dp<hex>-<seq>` (segments.py: the run's
prefix, so that a parent finds the segments a dead child left), each starting with a 64-byte header (magic, generation token, size),
mapped read-write. Blobs are bump-allocated at 64-byte offsets into the current segment; a blob
that does not fit its remainder opens a new segment, and one larger than a segment gets a segment
of its own. Each segment counts its live blobs: an emptied segment is unmapped and unlinked,
unless it is the current one, which starts over under a new token (so older refs into it fail
instead of reading newer blobs); a segment that goes is marked retired in its header first, so
a reader that still maps it sees that too. Freed space is reused only when its whole segment empties. The
segments' sizes summed are bounded by `dataplane_max_bytes` (`DataPlaneFullError` past it), and
each put reserves its pages first (`posix_fallocate`), so a full tmpfs is an error, not a SIGBUS.

Reading: the owner reads its own blobs from its own mapping. Another process of the node opens
the segment file, checks the header's token against the ref's, and maps it read-only (kept in an
LRU of `dataplane_max_peer_mappings`). Where the file cannot be opened (another node, another
folder, another user) the bytes come from the owner's `$dataplane` actor over the mailbox (CURVE
across nodes, like every mailbox), in pieces of a quarter of `max_message_bytes`, several in
flight. Which of the two a segment takes is decided once and remembered. A ref whose blob was
freed, or whose owner is gone, raises `BlobGoneError`. A view returned by `read` is valid until
the blob is freed. A same-node read checks the segment's token, not each blob, so reading a freed
blob whose segment still holds live ones returns its old bytes; the owner's checks are exact.

Freeing and lifetime: `free` releases this process's refs at once and sends the others to their
owners (`FreeBlobs`, batched per owner, fire and forget). Freeing twice is a no-op. A system
unlinks its segments when it closes, and unlinks those of a child process it spawned when that
child exits (`reap_process`: a SIGKILLed child leaks no shared memory, its shared weights
included); segments.py lists the backstops behind these (process exit, run exit, dead runs). A mapping with views still exported
cannot be closed (`mmap.close` raises BufferError): it is dropped instead, and CPython unmaps it
when the last view goes.

Not thread-safe: call it from the system's event loop thread.
Try it: `pytest tests/unit/test_dataplane.py tests/dist/test_dataplane_processes.py`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import re
import secrets
import struct
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import msgspec

from miles_async.runtime import segments, wire
from miles_async.runtime.errors import (
    ActorDeadError,
    ActorError,
    BadMessageError,
    BlobGoneError,
    DataPlaneFullError,
    RemoteError,
    UnknownActorError,
)
from miles_async.runtime.messages import ActorAddress, BlobRef, FreeBlobs, ReadBlob

if TYPE_CHECKING:
    from miles_async.runtime.config import RuntimeConfig
    from miles_async.runtime.refs import ActorRef

__all__ = ["DATAPLANE_ACTOR", "BlobRef", "DataPlane", "DataPlaneStats", "default_dataplane_dir"]

log = logging.getLogger("miles_async.runtime")

DATAPLANE_ACTOR = "$dataplane"
DATAPLANE_CAPACITY = 1 << 16  # the `$dataplane` mailbox: one sender's unfinished reads and frees
ALIGN_BYTES = 64
MAGIC = b"MILESDP1"
HEADER = struct.Struct("<8sQQ")  # magic, generation token, segment size
TOKEN = struct.Struct("<Q")  # the token alone, at offset 8
RETIRED = 1 << 63  # the token of a segment that is gone: outside every generation's 63 bits
HEADER_BYTES = ALIGN_BYTES  # the header, padded so that the first blob is aligned
# A remote read asks for pieces of a quarter of max_message_bytes, at most MAX_PIECE_BYTES, and
# keeps PIECES_IN_FLIGHT of them in flight. Each piece is copied several times on its way (encode,
# frame, socket, decode, out): 4 MiB pieces stay warm in cache and in the allocator, and moved
# 100 MiB over ipc about twice as fast as 16 MiB pieces on this project's 2-core test machine.
MAX_PIECE_BYTES = 4 * 1024 * 1024
PIECES_IN_FLIGHT = 4
_SEGMENT_NAME = re.compile(r"miles-[0-9a-f]{8}-\d+-dp[0-9a-f]+-\d+")
_HAS_FALLOCATE = hasattr(os, "posix_fallocate")  # Linux; macOS has none
_HAS_POPULATE = hasattr(mmap, "MAP_POPULATE")  # Linux


class DataPlaneStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a process's data plane holds, and how its reads were served."""

    num_blobs: int  # live blobs this process owns
    bytes_held: int  # their bytes
    num_segments: int  # this process's segments (files in the folder)
    segment_bytes: int  # their sizes summed: what `dataplane_max_bytes` bounds
    num_peer_mappings: int  # segments of other processes of this node mapped here
    num_mapped_reads: int  # reads served in place, from this process's or a peer's mapping
    num_fetched_reads: int  # reads fetched from the owner's `$dataplane` over the mailbox
    num_fetched_pieces: int
    bytes_fetched: int


default_dataplane_dir = segments.default_folder


def _align(num_bytes: int) -> int:
    return (num_bytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _describe(ref: BlobRef) -> str:
    return f"blob {ref.segment}@{ref.offset} ({ref.size} bytes) of {ref.owner}"


def _output_buffer(num_bytes: int) -> mmap.mmap | bytearray:
    """Memory for a fetched blob. An anonymous mapping populated up front costs less than a
    bytearray, which zero-fills page by page before the copy touches every page again
    (100 MiB: 72 ms against 167 ms with the copy, measured here)."""
    if _HAS_POPULATE:
        return mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return bytearray(num_bytes)


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        # views into it are still alive; they hold the mmap object, and CPython unmaps it when
        # the last of them is released, so dropping our reference is all that is left to do
        log.debug("a data-plane mapping is still viewed; it is unmapped when its last view goes")


class _Segment:
    """One of this process's segments: its file, its mapping and its live blobs."""

    __slots__ = ("fd", "live", "mm", "name", "path", "size", "token", "top")

    def __init__(self, name: str, path: str, fd: int, mm: mmap.mmap, size: int) -> None:
        self.name = name
        self.path = path
        self.fd = fd  # kept open for posix_fallocate
        self.mm = mm
        self.size = size
        self.live: dict[int, int] = {}  # offset -> size of each live blob
        self.token = 0
        self.top = HEADER_BYTES
        self.new_generation()

    def new_generation(self) -> None:
        """Start over, empty, under a fresh token: every older ref into this segment is retired."""
        self.token = secrets.randbits(63)
        HEADER.pack_into(self.mm, 0, MAGIC, self.token, self.size)
        self.top = HEADER_BYTES


class DataPlaneHost(Protocol):
    """What a data plane needs of its `ActorSystem`: the address its blobs name as their owner,
    the settings, and refs to other processes' `$dataplane` actors."""

    @property
    def address(self) -> str: ...

    @property
    def config(self) -> RuntimeConfig: ...

    def ref(self, entry: ActorAddress) -> ActorRef: ...


class DataPlane:
    """The data plane of one `ActorSystem` (`system.dataplane`; see the module docstring)."""

    def __init__(self, system: DataPlaneHost) -> None:
        cfg = system.config
        self.folder = cfg.dataplane_dir or default_dataplane_dir()
        if not os.path.isdir(self.folder) or not os.access(self.folder, os.W_OK | os.X_OK):
            raise ValueError(f"RuntimeConfig.dataplane_dir {self.folder!r} is not a writable folder: "
                             "create it, or leave the setting unset for /dev/shm")
        segments.use_folder(self.folder)  # the exit sweeps look there too; dead runs' segments go
        self._system = system
        self._segment_bytes = cfg.dataplane_segment_bytes
        self._max_bytes = cfg.dataplane_max_bytes
        self._max_peers = cfg.dataplane_max_peer_mappings
        self._piece_bytes = max(1, min(MAX_PIECE_BYTES, cfg.max_message_bytes // 4 - 64))  # 64: framing
        self._refs_per_free = max(1, cfg.max_message_bytes // 4 // 512)  # a ref encodes to < 512 bytes
        self._max_serve_bytes = cfg.max_message_bytes - wire.HEAD_BYTES - wire.MAX_ROUTE_BYTES - 16  # a reply frame
        self._tag = secrets.token_hex(4)  # two systems of one process never share a name
        self._seq = 0
        self._segments: dict[str, _Segment] = {}
        self._current: _Segment | None = None
        self._total_bytes = 0
        self._bytes_held = 0
        self._num_blobs = 0
        self._fallocate = _HAS_FALLOCATE
        self._peers: OrderedDict[str, mmap.mmap | None] = OrderedDict()  # None: read from the owner
        self._num_mapped_reads = 0
        self._num_fetched_reads = 0
        self._num_fetched_pieces = 0
        self._bytes_fetched = 0
        self._closed = False

    @property
    def stats(self) -> DataPlaneStats:
        return DataPlaneStats(
            num_blobs=self._num_blobs, bytes_held=self._bytes_held, num_segments=len(self._segments),
            segment_bytes=self._total_bytes, num_peer_mappings=sum(mm is not None for mm in self._peers.values()),
            num_mapped_reads=self._num_mapped_reads, num_fetched_reads=self._num_fetched_reads,
            num_fetched_pieces=self._num_fetched_pieces, bytes_fetched=self._bytes_fetched)

    # -- the owner's side -------------------------------------------------------------------

    def put(self, data: bytes | bytearray | memoryview) -> BlobRef:
        """Copy `data` (any C-contiguous buffer, e.g. a numpy array) into a segment of this process.

        Raises `DataPlaneFullError` when a new segment would pass `dataplane_max_bytes` or the
        folder is full, `ValueError` for a buffer that is not contiguous.
        """
        self._check_open()
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError("DataPlane.put takes a C-contiguous buffer; copy it first (e.g. np.ascontiguousarray)")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        size = view.nbytes
        need = max(ALIGN_BYTES, _align(size))  # a zero-byte blob still gets an offset of its own
        seg = self._current
        if need > self._segment_bytes - HEADER_BYTES:
            seg = self._open_segment(HEADER_BYTES + need, size)  # a segment of its own, never current
        elif seg is None or seg.top + need > seg.size:
            seg = self._open_segment(self._segment_bytes, size)
            old, self._current = self._current, seg
            if old is not None and not old.live:
                self._drop(old)
        offset = seg.top
        try:
            self._reserve(seg, offset, size)
        except BaseException:
            if not seg.live and seg is not self._current:
                self._drop(seg)
            raise
        seg.mm[offset:offset + size] = view
        seg.top = offset + need
        seg.live[offset] = size
        self._num_blobs += 1
        self._bytes_held += size
        return BlobRef(owner=self._system.address, segment=seg.name, token=seg.token, offset=offset, size=size)

    def _open_segment(self, size: int, blob_bytes: int) -> _Segment:
        if self._total_bytes + size > self._max_bytes:
            raise DataPlaneFullError(
                f"the data plane of {self._system.address} cannot take a {blob_bytes}-byte blob: it holds "
                f"{self._bytes_held} bytes in {self._num_blobs} live blobs, in {len(self._segments)} segments "
                f"of {self._total_bytes} bytes, and a new {size}-byte segment would pass "
                f"RuntimeConfig.dataplane_max_bytes ({self._max_bytes}); free blobs once their readers are "
                "done, or raise the setting")
        self._seq += 1
        name = f"{segments.process_prefix()}dp{self._tag}-{self._seq}"
        path = os.path.join(self.folder, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            seg = _Segment(name, path, fd, mmap.mmap(fd, size), size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._segments[name] = seg
        self._total_bytes += size
        return seg

    def _reserve(self, seg: _Segment, offset: int, size: int) -> None:
        """Allocate the blob's pages before writing them: a write into a tmpfs page that cannot
        be allocated kills the process with SIGBUS, while fallocate reports ENOSPC."""
        if not self._fallocate or size == 0:
            return
        try:
            os.posix_fallocate(seg.fd, offset, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._fallocate = False  # a file system without it: write and hope, as mmap users do
                return
            if exc.errno == errno.ENOSPC:
                raise DataPlaneFullError(
                    f"the data plane's folder {self.folder} is full: no room for a {size}-byte blob "
                    f"(this process holds {self._bytes_held} bytes in {self._num_blobs} blobs); free blobs, "
                    "or give RuntimeConfig.dataplane_dir a larger folder") from exc
            raise

    def _release(self, ref: BlobRef) -> None:
        seg = self._segments.get(ref.segment)
        if seg is None or seg.token != ref.token or seg.live.get(ref.offset) != ref.size:
            log.debug("free of %s ignored: not a live blob here (freed twice?)", _describe(ref))
            return
        del seg.live[ref.offset]
        self._num_blobs -= 1
        self._bytes_held -= ref.size
        if not seg.live:
            if seg is self._current:
                seg.new_generation()
            else:
                self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        del self._segments[seg.name]
        self._total_bytes -= seg.size
        if self._current is seg:
            self._current = None
        TOKEN.pack_into(seg.mm, 8, RETIRED)  # readers that still map it see it is gone
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            log.debug("segment %s was already unlinked", seg.path)
        os.close(seg.fd)
        _unmap(seg.mm)

    def serve_read(self, ref: BlobRef, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of one of this process's live blobs (the `$dataplane`
        actor's side of `ReadBlob`). Raises `BlobGoneError` if it is not live here."""
        view = self._own_view(ref)
        if offset < 0 or length < 0 or offset + length > ref.size:
            raise ValueError(f"bytes [{offset}, {offset + length}) are outside {_describe(ref)}")
        if length > self._max_serve_bytes:  # refused before copying it into a reply too large to send
            raise ValueError(f"a {length}-byte piece of {_describe(ref)} does not fit a reply frame: "
                             f"ask for pieces of at most {self._max_serve_bytes} bytes")
        return view[offset:offset + length]

    def serve_free(self, refs: Iterable[BlobRef]) -> None:
        """Release those of `refs` that are live blobs of this process (the `$dataplane` actor's
        side of `FreeBlobs`); others are ignored, never an error, whatever a peer sends."""
        for ref in refs:
            self._release(ref)

    def _own_view(self, ref: BlobRef) -> memoryview:
        seg = self._segments.get(ref.segment)
        if seg is None or seg.token != ref.token or seg.live.get(ref.offset) != ref.size:
            raise BlobGoneError(f"{_describe(ref)} is gone: it was freed (or its process restarted)")
        return memoryview(seg.mm)[ref.offset:ref.offset + ref.size].toreadonly()

    # -- readers ----------------------------------------------------------------------------

    async def read(self, ref: BlobRef) -> memoryview:
        """The bytes of `ref` as a read-only view: in place when the segment is this process's or
        mappable on this node, else fetched from the owner (see the module docstring).

        Raises `BlobGoneError` if the blob was freed or its owner is gone, `AskTimeoutError` if
        the owner does not answer within `ask_timeout_s`.
        """
        self._check_open()
        if ref.offset < 0 or ref.size < 0:
            raise ValueError(f"{_describe(ref)} is not a blob: negative offset or size")
        if ref.owner == self._system.address:
            own = self._own_view(ref)
            self._num_mapped_reads += 1
            return own
        view = self._peer_view(ref)
        if view is not None:
            self._num_mapped_reads += 1
            return view
        return await self._fetch(ref)

    def _peer_view(self, ref: BlobRef) -> memoryview | None:
        """A view into a peer's segment mapped here, or None when the owner must serve it."""
        if not _SEGMENT_NAME.fullmatch(ref.segment):
            raise ValueError(f"{ref.segment!r} is not the name of a data-plane segment")
        peers = self._peers
        if ref.segment in peers:
            peers.move_to_end(ref.segment)
            mm = peers[ref.segment]
            if mm is None:
                return None
        else:
            mm = self._map_peer(ref)
            if mm is None:
                return None
        token = TOKEN.unpack_from(mm, 8)[0]
        if token != ref.token:
            why = "its segment was unlinked (freed, or its owner is gone)" if token == RETIRED else (
                "its owner recycled the segment, so the blob was freed")
            raise BlobGoneError(f"{_describe(ref)} is gone: {why}")
        if ref.offset < HEADER_BYTES or ref.offset + ref.size > len(mm):
            raise ValueError(f"{_describe(ref)} lies outside its {len(mm)}-byte segment")
        return memoryview(mm)[ref.offset:ref.offset + ref.size]

    def _map_peer(self, ref: BlobRef) -> mmap.mmap | None:
        path = os.path.join(self.folder, ref.segment)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:  # another node, another folder or user, or already unlinked
            log.debug("segment %s is read from its owner: %s", ref.segment, exc)
            self._remember(ref.segment, None)
            return None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size >= HEADER_BYTES else None
        finally:
            os.close(fd)
        if mm is None:
            self._remember(ref.segment, None)
            return None
        magic, token, _ = HEADER.unpack_from(mm)
        if magic != MAGIC or token != ref.token:
            # not proof that this file is the ref's segment: the owner decides, and this segment
            # is looked at again next time (a fresh ref into it will match)
            mm.close()
            return None
        self._remember(ref.segment, mm)
        return mm

    def _remember(self, segment: str, mm: mmap.mmap | None) -> None:
        self._peers[segment] = mm
        while len(self._peers) > self._max_peers:
            _, old = self._peers.popitem(last=False)
            if old is not None:
                _unmap(old)

    async def _fetch(self, ref: BlobRef) -> memoryview:
        """The blob's bytes from its owner's `$dataplane`, in pieces, several in flight."""
        self._num_fetched_reads += 1
        if ref.size == 0:
            return memoryview(b"")
        out = _output_buffer(ref.size)
        host = self._host(ref.owner)
        window = asyncio.Semaphore(PIECES_IN_FLIGHT)

        async def piece(start: int) -> None:
            length = min(self._piece_bytes, ref.size - start)
            async with window:
                data = await host.ask(ReadBlob(ref=ref, offset=start, length=length))
            if len(data) != length:
                raise BadMessageError(f"{_describe(ref)}: its owner sent {len(data)} bytes for a {length}-byte piece")
            out[start:start + length] = data
            self._num_fetched_pieces += 1
            self._bytes_fetched += length

        tasks = [asyncio.ensure_future(piece(start)) for start in range(0, ref.size, self._piece_bytes)]
        try:
            await asyncio.gather(*tasks)
        except RemoteError as exc:
            if exc.failure.type == BlobGoneError.__name__:
                raise BlobGoneError(exc.failure.message) from exc
            raise
        except (ActorDeadError, UnknownActorError) as exc:
            raise BlobGoneError(f"{_describe(ref)} is gone: its owner is unreachable ({exc})") from exc
        finally:
            for task in tasks:
                task.cancel()
        return memoryview(out).toreadonly()

    def _host(self, owner: str) -> ActorRef:
        return self._system.ref(ActorAddress(name=DATAPLANE_ACTOR, address=owner, capacity=DATAPLANE_CAPACITY))

    # -- freeing and lifetime ---------------------------------------------------------------

    def free(self, refs: Iterable[BlobRef]) -> None:
        """Release blobs: this process's at once, others' through their owners (`FreeBlobs`,
        batched per owner, fire and forget). A blob freed twice, or whose owner is gone, is
        ignored (debug log): freeing never raises for that."""
        own = self._system.address
        others: dict[str, list[BlobRef]] = {}
        for ref in refs:
            if ref.owner == own:
                self._release(ref)
            else:
                others.setdefault(ref.owner, []).append(ref)
        for owner, batch in others.items():
            if self._closed:
                log.debug("%d blobs of %s not freed: this data plane is closed", len(batch), owner)
                continue
            host = self._host(owner)
            for start in range(0, len(batch), self._refs_per_free):
                try:
                    host.tell_nowait(FreeBlobs(refs=batch[start:start + self._refs_per_free]))
                except ActorError as exc:  # a dead owner: its blobs went with it (or with its parent)
                    log.debug("could not free %d blobs of %s: %s", len(batch), owner, exc)
                    break

    def reap_process(self, pid: int) -> int:
        """Unlink the segments a dead process `pid` of this run left, its data plane's and any
        other (shared weights: segments.py), in this folder and the default one (its parent calls
        this when it sees the child exit); returns how many there were."""
        if pid == os.getpid():
            raise ValueError("reap_process is for dead processes, not this one")
        prefix = segments.process_prefix(pid)
        for name in [name for name in self._peers if name.startswith(prefix)]:
            mm = self._peers.pop(name)
            if mm is not None:
                _unmap(mm)
        with os.scandir(self.folder) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(prefix) and _SEGMENT_NAME.fullmatch(entry.name)]
        for name in names:
            try:
                fd = os.open(os.path.join(self.folder, name), os.O_WRONLY)
            except FileNotFoundError:
                continue  # the process unlinked it itself while exiting
            try:
                if os.fstat(fd).st_size >= HEADER_BYTES:
                    os.pwrite(fd, TOKEN.pack(RETIRED), 8)  # siblings that map it see it is gone
            finally:
                os.close(fd)
        gone = segments.reap_process(pid, [self.folder, segments.default_folder()])
        if gone:
            log.info("unlinked %d shared-memory segments left by process %d", len(gone), pid)
        return len(gone)

    def close(self) -> None:
        """Unlink every segment of this process and unmap every mapping (the system's teardown)."""
        if self._closed:
            return
        self._closed = True
        for seg in list(self._segments.values()):
            self._drop(seg)
        peers, self._peers = self._peers, OrderedDict()
        for mm in peers.values():
            if mm is not None:
                _unmap(mm)
        self._num_blobs = self._bytes_held = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the data plane of {self._system.address} is closed (its actor system closed)")
