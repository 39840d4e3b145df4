"""Message vocabulary: the `Message` base class and the runtime's own control messages.

A message is a frozen, keyword-only `msgspec.Struct`, tagged by its class name and encoded as a
msgpack array (so new fields are appended, with defaults, to stay wire-compatible). A message
may declare what its `ask` returns with a class attribute `Reply` (a type msgspec can decode);
the asking side decodes the reply with it. Without `Reply`, replies decode to plain builtins.

    class Add(Message):
        amount: int
        Reply: ClassVar[Any] = int  # bare ClassVar fails on Python 3.10 (msgspec evaluates it)

Tensors never ride in messages: a transport moves them and the message carries a handle (for
bulk bytes made by actors, a `BlobRef` into the data plane: see `dataplane.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from miles_async.runtime.errors import Failure


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Base class of every actor message (see the module docstring)."""

    Reply: ClassVar[Any] = Any


class ActorAddress(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where an actor lives: its name, its host's ZeroMQ address and its mailbox capacity.

    Plain data, so it can ride inside messages; `ActorSystem.ref(address)` turns it into a
    live `ActorRef`.
    """

    name: str
    address: str
    capacity: int


# -- control messages between actor systems (handled by each system's `$system` actor) -------


class ChildReady(Message):
    """A child process has started its actor; sent to the owner's system."""

    name: str
    address: str
    capacity: int


class ChildDied(Message):
    """An actor died of `cause`; sent to its owner's system, which applies the restart policy."""

    name: str
    cause: Failure


class StopActor(Message):
    """Stop one hosted actor gracefully (its children first)."""

    name: str


class RestartActor(Message):
    """Re-create a crashed actor in place (the owner's supervisor decided to restart it)."""

    name: str


class ShutdownSystem(Message):
    """Stop every actor of the receiving process and let the process exit."""


# -- the directory (names to addresses) ------------------------------------------------------


class Register(Message):
    entry: ActorAddress


class Unregister(Message):
    name: str


class Lookup(Message):
    name: str
    Reply: ClassVar[Any] = ActorAddress | None


class ListNames(Message):
    Reply: ClassVar[Any] = list[str]


# -- the data plane (handled by each system's `$dataplane` actor; see dataplane.py) -----------


class BlobRef(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Where a blob of bytes lives: in a shared-memory segment of the process at `owner`.

    Plain data (~100 bytes encoded), so it rides inside messages in place of the bytes;
    `system.dataplane.read(ref)` in any process of the run returns the bytes. Tagged (not
    array_like) so that it can share a union with other tagged records, e.g. a field typed
    `TokenData | BlobRef | None` (msgspec allows several structs in a union only when all are
    tagged and all are encoded alike).

    owner: the address of the owning `ActorSystem`, whose `$dataplane` actor serves remote reads
        and frees.
    segment: the file name of the segment (in the run's shared-memory folder).
    token: the random 63-bit id of the segment's generation, also written in its header. A
        reader on the same node maps the file only when the two match, and the owner draws a new
        one whenever it recycles an emptied segment, so a stale ref never reads another blob.
    offset, size: where the blob's bytes are in the segment.
    """

    owner: str
    segment: str
    token: int
    offset: int
    size: int


class ReadBlob(Message):
    """Ask a blob's owner for `length` bytes of it from `offset` (relative to the blob's start).

    The reply is decoded as a view into the received frame (no copy). Sent by readers that cannot
    map the segment (another node, another shared-memory folder), in pieces that fit a frame.
    """

    ref: BlobRef
    offset: int
    length: int
    Reply: ClassVar[Any] = memoryview


class FreeBlobs(Message):
    """Release these blobs of the receiving process (a tell; refs it does not hold are ignored)."""

    refs: list[BlobRef]
