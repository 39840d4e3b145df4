"""Message vocabulary: the `Message` base class and the runtime's own control messages.

A message is a frozen, keyword-only `msgspec.Struct`, tagged by its class name and encoded as a
msgpack array (so new fields are appended, with defaults, to stay wire-compatible). A message
that is asked declares what the ask returns as its type parameter, `Message[R]`: the asking side
decodes the reply as `R` (msgspec checks it) and `ActorRef.ask` is typed to return `R`, so a type
checker sees what every ask gives. A plain `Message` (a tell) has replies of any type.

    class Add(Message[int], frozen=True):
        amount: int

    total: int = await counter.ask(Add(amount=2))

Each subclass repeats `frozen=True`: msgspec inherits it anyway, but type checkers follow PEP 681
(`dataclass_transform`), under which a subclass that does not say it is taken as mutable, and
mypy refuses a mutable subclass of a frozen class.

Tensors never ride in messages: a transport moves them and the message carries a handle (for
bulk bytes made by actors, a `BlobRef` into the data plane: see `dataplane.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

import msgspec

from miles_async.runtime.errors import Failure

# Covariant: R is only ever produced (a reply), so a message answered with a dict is also one
# answered with a Mapping, and an ask can be checked against what its caller expects.
R_co = TypeVar("R_co", covariant=True)


class Message(msgspec.Struct, Generic[R_co], frozen=True, kw_only=True, tag=True, array_like=True):
    """Base class of every actor message (see the module docstring)."""

    # The type an ask of this message returns, what the runtime decodes replies as: the class's
    # type parameter, read once when the class is made.
    Reply: ClassVar[Any] = Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            if get_origin(base) is Message:
                (cls.Reply,) = get_args(base)


class ActorAddress(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where an actor lives: its name, its host's ZeroMQ address and its mailbox capacity.

    Plain data, so it can ride inside messages; `ActorSystem.ref(address)` turns it into a
    live `ActorRef`.
    """

    name: str
    address: str
    capacity: int


# -- control messages between actor systems (handled by each system's `$system` actor) -------


class ChildReady(Message[None], frozen=True):
    """A child process has started its actor; sent to the owner's system."""

    name: str
    address: str
    capacity: int


class ChildDied(Message[None], frozen=True):
    """An actor died of `cause`; sent to its owner's system, which applies the restart policy."""

    name: str
    cause: Failure


class StopActor(Message[None], frozen=True):
    """Stop one hosted actor gracefully (its children first)."""

    name: str


class RestartActor(Message[None], frozen=True):
    """Re-create a crashed actor in place (the owner's supervisor decided to restart it)."""

    name: str


class ShutdownSystem(Message, frozen=True):
    """Stop every actor of the receiving process and let the process exit."""


# -- the directory (names to addresses) ------------------------------------------------------


class Register(Message[None], frozen=True):
    entry: ActorAddress


class Unregister(Message, frozen=True):
    name: str


class Lookup(Message[ActorAddress | None], frozen=True):
    name: str


class ListNames(Message[list[str]], frozen=True):
    """Every name in the directory."""


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


class ReadBlob(Message[memoryview], frozen=True):
    """Ask a blob's owner for `length` bytes of it from `offset` (relative to the blob's start).

    The reply is decoded as a view into the received frame (no copy). Sent by readers that cannot
    map the segment (another node, another shared-memory folder), in pieces that fit a frame.
    """

    ref: BlobRef
    offset: int
    length: int


class FreeBlobs(Message, frozen=True):
    """Release these blobs of the receiving process (a tell; refs it does not hold are ignored)."""

    refs: list[BlobRef]
