"""Message vocabulary: the `Message` base class and the runtime's own control messages.

A message is a frozen, keyword-only `msgspec.Struct`, tagged by its class name and encoded as a
msgpack array (so new fields are appended, with defaults, to stay wire-compatible). A message
may declare what its `ask` returns with a class attribute `Reply` (a type msgspec can decode);
the asking side decodes the reply with it. Without `Reply`, replies decode to plain builtins.

    class Add(Message):
        amount: int
        Reply: ClassVar = int

Tensors never ride in messages: a transport moves them and the message carries a handle.
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
