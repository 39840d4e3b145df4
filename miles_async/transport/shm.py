"""Same-node shared-memory weight transport: the engine's weights live in one shared segment.

`SharedWeights.create(specs)` lays every tensor out in one `multiprocessing.shared_memory`
segment, each at a 64-byte-aligned offset after a header; `SharedWeights.attach(name)` in any
process on the node reads the header and hands out name -> tensor views (`torch.frombuffer`)
into the same pages, so an engine can run on those views directly and the pusher's
`write(named_tensors)` copies each shard straight into them (`copy_`, no staging buffer).

Segment layout (little-endian):

    [0:8)    seq: uint64 write counter, seqlock-style
    [8:16)   manifest length in bytes
    [16:..)  manifest JSON: {"tensors": [{"name", "dtype", "shape", "offset", "nbytes"}], ...}
    [header_bytes:..)  the tensors, at their offsets (relative to the segment start)

`seq` is odd while a write is under way and even when it is complete; it is bumped to odd before
the first byte of a write and to even after the last, so `seq // 2` counts complete writes. A
writer that dies or raises midway leaves it odd, and every reader sees the segment as torn
(`complete` is False, `snapshot` raises TransportError) until a later write completes. A
reader that copies the weights out (`snapshot`) also checks that `seq` did not move while it
copied. An engine that serves from the views directly must instead be paused while the pusher
writes (the update protocol's pause -> write -> verify -> resume); the counter then tells it
whether the write it waited for completed.

Lifetime: the creating process owns the segment and unlinks it in `close()` (or on leaving a
`with` block). Its default name is under the run's prefix (`miles_async.runtime.segments`), so
that a segment whose owner died without closing it (SIGKILL) is unlinked by the runtime: by the
owner's parent when it sees it exit, else at the end of the run, else by the next run on the
node. No segment is registered with Python's resource tracker, neither the owner's nor an
attached one: the tracker would warn at exit about segments it does not own, and unlink them
under their owner. Attached handles only unmap. A mapping cannot be closed while tensor views into it are alive:
drop them first, or `close()` raises TransportError naming the segment.

Try it: `pytest tests/unit/test_transport_shm.py -s`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

from miles_async.runtime import segments
from miles_async.transport.buckets import NamedTensors, as_items, tensor_nbytes
from miles_async.transport.errors import TransportError

ALIGN_BYTES = 64
PAGE_BYTES = 4096
_SEQ = struct.Struct("<Q")
_PREFIX = struct.Struct("<QQ")  # seq, manifest length

TensorSpecs = Mapping[str, tuple[Sequence[int], torch.dtype]]


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"shared segment manifest names an unknown dtype {name!r}")
    return dtype


def _layout(specs: TensorSpecs) -> tuple[dict, int]:
    """The manifest (absolute offsets) and the segment's size in bytes."""
    relative: list[dict[str, Any]] = []
    offset = 0
    for name, (shape, dtype) in specs.items():
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"spec for {name!r} must be (shape, torch.dtype), got dtype {dtype!r}")
        shape = [int(d) for d in shape]
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        offset = _align(offset, ALIGN_BYTES)
        relative.append({"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": shape,
                         "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header_bytes = PAGE_BYTES
    while True:  # the offsets' digits depend on the header's size: grow it until the manifest fits
        entries = [{**entry, "offset": entry["offset"] + header_bytes} for entry in relative]
        manifest = {"tensors": entries, "header_bytes": header_bytes}
        needed = _align(_PREFIX.size + len(json.dumps(manifest).encode()), PAGE_BYTES)
        if needed <= header_bytes:
            return manifest, header_bytes + max(offset, 1)
        header_bytes = needed


def _buf(segment: shared_memory.SharedMemory) -> memoryview:
    """The segment's mapping (`buf` is None once the segment is closed)."""
    if segment.buf is None:
        raise TransportError(f"shared weight segment {segment.name!r} is closed")
    return segment.buf


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    """No resource-tracker bookkeeping for the segments opened, created or unlinked inside.

    Before Python 3.13 (`track=False`) every SharedMemory registers its name, and the process's
    tracker unlinks it at exit with a "leaked shared_memory objects" warning, an owner's segment
    included; unregistering afterwards is no fix, since a child started by multiprocessing shares
    its parent's tracker and would drop the owner's entry. `unlink` unregisters: an unregistered
    name makes the tracker print a KeyError traceback. The runtime unlinks our segments instead
    (module docstring).
    """
    register, unregister = resource_tracker.register, resource_tracker.unregister
    resource_tracker.register = resource_tracker.unregister = lambda *args, **kwargs: None  # looked up per call
    try:
        yield
    finally:
        resource_tracker.register, resource_tracker.unregister = register, unregister


def _shared_memory(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)  # type: ignore[call-arg]
    with _untracked():
        return shared_memory.SharedMemory(name=name, create=create, size=size)


class SharedWeights:
    """Named tensors in one shared-memory segment; see the module docstring for the layout."""

    def __init__(self, segment: shared_memory.SharedMemory, manifest: dict, owner: bool) -> None:
        self._segment = segment
        self._owner = owner
        self.manifest = manifest
        self.tensors: dict[str, torch.Tensor] = {}
        for entry in manifest["tensors"]:
            dtype = _dtype(entry["dtype"])
            if entry["nbytes"] == 0:
                self.tensors[entry["name"]] = torch.empty(entry["shape"], dtype=dtype)
                continue
            # Through numpy, not torch.frombuffer: numpy holds a buffer export on the mapping, so
            # unmapping it under a live view fails with BufferError instead of leaving a dangling
            # pointer (torch.frombuffer keeps none). uint8 first: numpy has no bfloat16.
            raw = np.frombuffer(_buf(segment), dtype=np.uint8, count=entry["nbytes"], offset=entry["offset"])
            self.tensors[entry["name"]] = torch.from_numpy(raw).view(dtype).view(entry["shape"])

    @property
    def name(self) -> str:
        """The segment's name: what another process passes to `attach`."""
        return self._segment.name

    @classmethod
    def create(cls, specs: TensorSpecs, name: str | None = None) -> SharedWeights:
        """A new zero-filled segment holding `specs` (name -> (shape, dtype)), owned by this process;
        named under the run's prefix unless `name` is given (then nobody but `close` unlinks it)."""
        if not specs:
            raise ValueError("SharedWeights.create needs at least one (name -> (shape, dtype)) spec")
        manifest, size = _layout(specs)
        segment = _shared_memory(name or f"{segments.process_prefix()}w{secrets.token_hex(3)}", create=True, size=size)
        payload = json.dumps(manifest).encode()
        buf = _buf(segment)
        buf[_PREFIX.size:_PREFIX.size + len(payload)] = payload
        _PREFIX.pack_into(buf, 0, 0, len(payload))
        return cls(segment, manifest, owner=True)

    @classmethod
    def like(cls, named: NamedTensors, name: str | None = None) -> SharedWeights:
        """A segment with the names, shapes and dtypes of `named` (values not copied)."""
        return cls.create({n: (tuple(t.shape), t.dtype) for n, t in as_items(named)}, name=name)

    @classmethod
    def attach(cls, segment_name: str) -> SharedWeights:
        """Map an existing segment by name; the creator keeps ownership (this handle never unlinks)."""
        try:
            segment = _shared_memory(segment_name)
        except FileNotFoundError as exc:
            raise TransportError(f"no shared weight segment named {segment_name!r} on this node") from exc
        buf = _buf(segment)
        _, manifest_len = _PREFIX.unpack_from(buf, 0)
        try:
            manifest = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + manifest_len]))
        except (ValueError, UnicodeDecodeError) as exc:
            segment.close()
            raise TransportError(f"segment {segment_name!r} has no readable weight manifest") from exc
        return cls(segment, manifest, owner=False)

    # ----- the seqlock counter -----

    @property
    def seq(self) -> int:
        """The raw write counter: odd while a write is under way (or after one died), even when complete."""
        return _SEQ.unpack_from(_buf(self._segment), 0)[0]

    def _set_seq(self, value: int) -> None:
        _SEQ.pack_into(_buf(self._segment), 0, value)

    @property
    def complete(self) -> bool:
        """True when the last write finished (or none began)."""
        return self.seq % 2 == 0

    @property
    def version(self) -> int:
        """`seq // 2`: the number of the last complete write while `complete` (a torn write uses up its number)."""
        return self.seq // 2

    # ----- writer and reader -----

    @torch.no_grad()
    def write(self, named_tensors: NamedTensors | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (name, tensor) straight into its view, in arrival order; return the new version.

        Accepts a mapping or any iterable (a generator of converted shards streams without
        holding them all). A mapping is checked whole before any byte is written; a stream is
        checked shard by shard, so a bad shard midway leaves the segment torn (ValueError).
        Names not sent keep their previous values; `copy_` casts to the segment's dtype (fp32 -> bf16).
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if isinstance(named_tensors, Mapping):
            for name, tensor in items:
                self._check(name, tensor)
        start = self.seq
        if start % 2:
            start += 1  # a previous write died midway: this one starts a fresh version
        self._set_seq(start + 1)
        for name, tensor in items:
            self._check(name, tensor)
            self.tensors[name].copy_(tensor)
        self._set_seq(start + 2)
        return (start + 2) // 2

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        view = self.tensors.get(name)
        if view is None:
            raise ValueError(f"weight {name!r} is not in shared segment {self.name!r} "
                             f"(it has e.g. {', '.join(list(self.tensors)[:4])})")
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the segment's is {tuple(view.shape)}")

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, name -> copy) of a complete version; TransportError if torn or written meanwhile."""
        before = self.seq
        if before % 2:
            raise TransportError(f"shared segment {self.name!r} is torn: a write began (seq {before}) and did not "
                                 f"finish; wait for the writer or push a complete version")
        copies = {name: view.clone() for name, view in self.tensors.items()}
        after = self.seq
        if after != before:
            raise TransportError(f"shared segment {self.name!r} was written while being read (seq {before} -> "
                                 f"{after}); read again")
        return before // 2, copies

    # ----- lifetime -----

    def close(self) -> None:
        """Unmap (and unlink, if this process created the segment). Views into it must be dropped first."""
        self.tensors = {}
        if self._owner:
            self._owner = False
            try:
                if sys.version_info >= (3, 13):
                    self._segment.unlink()  # untracked: unregisters nothing
                else:
                    with _untracked():
                        self._segment.unlink()
            except FileNotFoundError:
                pass  # already unlinked by someone else: nothing left to remove
        try:
            self._segment.close()
        except BufferError as exc:
            raise TransportError(f"shared segment {self.name!r} cannot be unmapped while tensor views into it "
                                 f"are alive; drop them (its name is already unlinked)") from exc

    def __enter__(self) -> SharedWeights:  # noqa: PYI034 - typing.Self needs Python 3.11; we support 3.10
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def nbytes(self) -> int:
        """Bytes of all the tensors (not counting the header or alignment)."""
        return sum(tensor_nbytes(t) for t in self.tensors.values())
