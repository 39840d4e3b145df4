"""The `Actor` base class: one handler per message type, lifecycle hooks, opt-in concurrency.

    class Counter(Actor):
        def __init__(self, start: int = 0) -> None:
            self.count = start

        @handler
        async def add(self, msg: Add) -> int:      # the annotation picks the message type
            self.count += msg.amount
            return self.count

        @handler(concurrent=True)                  # may overlap other handlers
        async def slow_report(self, msg: Report) -> None: ...

Handling order: an actor runs one handler at a time, in arrival order (so per-sender FIFO),
unless a handler opts into `concurrent=True`; such handlers start at once and may overlap
anything, so they must not assume exclusive access to the actor's state across an `await`.

Failures: a handler that raises while serving an `ask` sends the error to that caller and the
actor keeps serving. A handler that raises while serving a `tell` has nobody to tell, so the
actor crashes: `on_failure` runs, pending callers get `ActorDeadError`, and the owner's
`RestartPolicy` decides whether a fresh instance (a new `__init__`, then `on_start`) replaces it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, Union

import msgspec

from miles_async.runtime.errors import Failure
from miles_async.runtime.messages import Message

if TYPE_CHECKING:
    import asyncio

    from miles_async.runtime.config import RuntimeConfig
    from miles_async.runtime.dataplane import DataPlane
    from miles_async.runtime.messages import ActorAddress
    from miles_async.runtime.refs import ActorRef
    from miles_async.runtime.security import CurveKeys
    from miles_async.runtime.supervision import RestartPolicy

F = TypeVar("F", bound=Callable[..., Any])
A = TypeVar("A", bound="Actor")

_MARK = "__miles_handler__"


class ActorHost(Protocol):
    """What an actor sees of the system that hosts it (`self.system`): the public API of
    `ActorSystem`, its one implementation, less the lifecycle, which belongs to whoever made it.
    Typed as this seam rather than the class so that the actor module stays below the system."""

    @property
    def name(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def run_dir(self) -> str: ...

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def dataplane(self) -> DataPlane: ...

    @property
    def curve_keys(self) -> CurveKeys | None: ...

    @property
    def directory(self) -> ActorRef: ...

    def ref(self, entry: ActorAddress) -> ActorRef: ...

    async def lookup(self, name: str, *, timeout_s: float | None = None) -> ActorRef: ...

    async def spawn(self, cls: type[Actor], name: str, *, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None, process: bool = False,
                    restart: RestartPolicy | None = None, owner: str | None = None,
                    env: dict[str, str] | None = None) -> ActorRef: ...

    def watch(self, target: ActorRef) -> asyncio.Future[Failure]: ...

    async def stop(self, target: ActorRef | str, *, timeout_s: float | None = None) -> None: ...


def handler(fn: F | None = None, *, concurrent: bool = False) -> Any:
    """Mark a method as the handler of the message type its one parameter is annotated with."""

    def mark(f: F) -> F:
        setattr(f, _MARK, concurrent)
        return f

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    fn: Callable[..., Any]
    msg_type: type
    concurrent: bool
    is_async: bool


class _Table:
    """What a class handles, resolved once per class: handlers and the mailbox's one decoder."""

    __slots__ = ("decoder", "names", "specs")

    def __init__(self, cls: type[Actor]) -> None:
        self.specs: dict[type, HandlerSpec] = {}
        seen: set[str] = set()
        for klass in cls.__mro__:
            for attr, fn in vars(klass).items():
                if attr in seen or not callable(fn) or not hasattr(fn, _MARK):
                    continue
                seen.add(attr)
                msg_type = _message_type(cls, fn)
                if msg_type in self.specs:
                    other = self.specs[msg_type].fn.__name__
                    raise TypeError(f"{cls.__qualname__}: both {other}() and {attr}() handle {msg_type.__name__}")
                self.specs[msg_type] = HandlerSpec(
                    fn, msg_type, getattr(fn, _MARK), inspect.iscoroutinefunction(fn))
        if not self.specs:
            raise TypeError(f"{cls.__qualname__} has no @handler methods")
        types = tuple(self.specs)
        self.decoder = msgspec.msgpack.Decoder(types[0] if len(types) == 1 else Union[types])  # noqa: UP007
        self.names = sorted(t.__name__ for t in types)


def _message_type(cls: type, fn: Callable[..., Any]) -> type:
    params = list(inspect.signature(fn).parameters.values())
    where = f"{cls.__qualname__}.{fn.__name__}"
    if len(params) != 2:
        raise TypeError(f"handler {where} must take (self, msg: SomeMessage), got {len(params) - 1} arguments")
    try:
        hints = typing.get_type_hints(fn)
    except NameError as exc:
        raise TypeError(f"handler {where}: cannot resolve its annotations ({exc})") from exc
    msg_type = hints.get(params[1].name)
    if not (isinstance(msg_type, type) and issubclass(msg_type, Message)):
        raise TypeError(f"handler {where}: annotate its parameter with a Message subclass, got {msg_type!r}")
    return msg_type


class Actor:
    """Base class of every actor (see the module docstring).

    Set by the hosting system before `on_start`: `name`, `system`, `ref`.
    """

    #: How many of one sender's messages may wait unfinished in this actor's mailbox; a
    #: sender past it blocks in `tell`/`ask` (or `tell_nowait` raises `MailboxFullError`).
    mailbox_capacity: ClassVar[int] = 1024
    # The handler table, set on each class by `handler_table()` (declared only: no default, so
    # that Actor itself, which has no handlers, has none).
    _miles_table: ClassVar[_Table]

    name: str
    system: ActorHost
    ref: ActorRef

    async def on_start(self) -> None:
        """Runs before the first message; raising here fails the spawn (or the restart)."""

    async def on_stop(self) -> None:
        """Runs on a graceful stop, after the last handler finished or was cancelled."""

    async def on_failure(self, failure: Failure) -> None:
        """Runs when the actor crashes (instead of `on_stop`), before its owner decides."""

    async def spawn(self, cls: type[A], name: str, *, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None, process: bool = False,
                    restart: RestartPolicy | None = None) -> ActorRef:
        """Spawn an actor owned by this one: it stops when this actor stops or crashes."""
        return await self.system.spawn(cls, name, args=args, kwargs=kwargs, process=process,
                                       restart=restart, owner=self.name)

    @classmethod
    def handler_table(cls) -> _Table:
        table = cls.__dict__.get("_miles_table")
        if table is None:
            table = _Table(cls)
            cls._miles_table = table  # cached per class, not inherited (subclasses add handlers)
        return table
