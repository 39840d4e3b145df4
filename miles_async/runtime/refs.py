"""The calling side: `ActorRef` (tell / ask / stop) and the per-host `Link` it sends through.

A Link is this process's view of one host process: a DEALER socket connected to the host's
ROUTER (none for actors hosted here), the asks waiting for replies, and, per target actor, how
many of our messages are still unfinished there. That count never exceeds the target's mailbox
capacity: past it `tell`/`ask` wait for room (or `tell_nowait` raises `MailboxFullError`), which
is how a full mailbox pushes back on its senders without dropping anything.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import zmq

from miles_async.runtime import wire
from miles_async.runtime.errors import ActorDeadError, AskTimeoutError, Failure, MailboxFullError
from miles_async.runtime.messages import ActorAddress, Message

if TYPE_CHECKING:
    from miles_async.runtime.config import RuntimeConfig

R = TypeVar("R")


class Sender(Protocol):
    """What an `ActorRef` sends through: its process's `ActorSystem`, the one implementation.

    A ref asks for the Link to its target's host once, waits on it for room in the target's
    window, and hands each message to `send`, which encodes it onto the Link's socket (or, for an
    actor hosted in this process, delivers it into its mailbox).
    """

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def link_to(self, address: str) -> Link: ...

    async def wait_room(self, link: Link, ref: ActorRef, timeout_s: float | None) -> float: ...

    def send(self, link: Link, ref: ActorRef, kind: int, msg: Message, fut: asyncio.Future[Any] | None,
             timer: asyncio.TimerHandle | None) -> None: ...

    async def stop(self, target: ActorRef | str, *, timeout_s: float | None = None) -> None: ...


class Link:
    __slots__ = ("address", "dead", "last_heard", "pending", "scheduled", "sock", "used", "waiters", "watchers")

    def __init__(self, address: str, sock: zmq.Socket | None, now: float) -> None:
        self.address = address
        self.sock = sock  # None: the actors live in this process
        # msg_id -> [future, reply decoder, target name, timeout handle]; kept after a timeout
        # until the reply (or the link's death) frees the target's window
        self.pending: dict[int, list[Any]] = {}
        self.used: dict[str, int] = {}
        self.waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self.last_heard = now
        self.dead: Failure | None = None
        self.scheduled = False
        self.watchers: list[asyncio.Future[Failure]] = []  # `ActorSystem.watch` of actors not owned here

    def release(self, target: str, count: int = 1) -> None:
        left = self.used.get(target, 0) - count
        self.used[target] = max(0, left)
        waiters = self.waiters.get(target)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                break

    def wake_all(self) -> None:
        for waiters in self.waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(None)


_reply_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def reply_decoder(msg_type: type) -> msgspec.msgpack.Decoder:
    dec = _reply_decoders.get(msg_type)
    if dec is None:
        dec = _reply_decoders[msg_type] = msgspec.msgpack.Decoder(getattr(msg_type, "Reply", Any))
    return dec


class ActorRef:
    """A live handle to an actor, wherever it runs. Cheap to copy; send `.entry` in messages."""

    __slots__ = ("_link", "_system", "address", "capacity", "name", "route")

    def __init__(self, system: Sender, entry: ActorAddress) -> None:
        self.name = entry.name
        self.address = entry.address
        self.capacity = entry.capacity
        self._system = system
        self._link = system.link_to(entry.address)
        self.route = entry.name.encode()  # the name as frames carry it

    @property
    def entry(self) -> ActorAddress:
        return ActorAddress(name=self.name, address=self.address, capacity=self.capacity)

    @property
    def is_local(self) -> bool:
        return self._link.sock is None

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r} at {self.address})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and (self.name, self.address) == (other.name, other.address)

    def __hash__(self) -> int:
        return hash((self.name, self.address))

    async def tell(self, msg: Message, *, timeout_s: float | None = None) -> None:
        """Send without waiting for handling; waits only while the target's mailbox is full.

        Raises `ActorDeadError` if the target (or its process) is known dead, and
        `AskTimeoutError` if `timeout_s` passes while waiting for room.
        """
        link = self._link
        if link.dead is not None:
            raise ActorDeadError(self.name, link.dead)
        if link.used.get(self.name, 0) >= self.capacity:
            await self._system.wait_room(link, self, timeout_s)
        self._system.send(link, self, wire.TELL, msg, None, None)

    def tell_nowait(self, msg: Message) -> None:
        """Like `tell`, but raises `MailboxFullError` instead of waiting for room."""
        self._system.send(self._link_with_room(), self, wire.TELL, msg, None, None)

    async def ask(self, msg: Message[R], *, timeout_s: float | None = None) -> R:
        """Send and wait for the handler's return value (decoded as the message's reply type R).

        Waits while the target's mailbox is full. Raises `RemoteError` if the handler raised,
        `ActorDeadError` if the actor or its process died (with the root cause),
        `AskTimeoutError` after `timeout_s` (default: the system's `ask_timeout_s`),
        `BadMessageError` if the actor cannot take this message.
        """
        link = self._link
        if link.dead is not None:
            raise ActorDeadError(self.name, link.dead)
        timeout = self._system.config.ask_timeout_s if timeout_s is None else timeout_s
        if link.used.get(self.name, 0) >= self.capacity:
            timeout = await self._system.wait_room(link, self, timeout)
        return await self._ask(link, msg, timeout)

    def ask_future(self, msg: Message[R], *, timeout_s: float | None = None) -> asyncio.Future[R]:
        """Send an ask now and return the future of its reply (for pipelining many asks).

        Raises `MailboxFullError` instead of waiting when the target's mailbox is full; the
        future fails like `ask` does.
        """
        link = self._link_with_room()
        return self._ask(link, msg, self._system.config.ask_timeout_s if timeout_s is None else timeout_s)

    def _link_with_room(self) -> Link:
        link = self._link
        if link.dead is not None:
            raise ActorDeadError(self.name, link.dead)
        if link.used.get(self.name, 0) >= self.capacity:
            raise MailboxFullError(
                f"mailbox of actor {self.name!r} is full ({self.capacity} unfinished messages from this process)")
        return link

    def _ask(self, link: Link, msg: Message[R], timeout_s: float) -> asyncio.Future[R]:
        loop = self._system.loop
        fut: asyncio.Future[R] = loop.create_future()  # resolved with the reply decoded as R (system.py)
        timer = loop.call_later(timeout_s, _expire, fut, self.name, timeout_s)
        try:
            self._system.send(link, self, wire.ASK, msg, fut, timer)
        except BaseException:
            timer.cancel()
            raise
        return fut

    async def stop(self, *, timeout_s: float | None = None) -> None:
        """Stop the actor gracefully (`on_stop` runs, its children stop first); no restart."""
        await self._system.stop(self, timeout_s=timeout_s)


def _expire(fut: asyncio.Future[Any], name: str, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(AskTimeoutError(f"no reply from actor {name!r} within {timeout_s:g}s"))
