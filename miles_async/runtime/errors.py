"""Runtime faults: what a caller of an actor can see go wrong.

Every fault that crosses a process boundary carries a `Failure` (exception type, message and
traceback text), so the caller sees the root cause of a remote crash, not a bare timeout.
"""

from __future__ import annotations

import traceback

import msgspec


class Failure(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The root cause of a fault, as text that survives the wire."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type=type(exc).__qualname__, message=str(exc), traceback=text)

    def describe(self) -> str:
        head = f"{self.type}: {self.message}" if self.message else self.type
        if not self.traceback:
            return head
        return f"{head}\n--- remote traceback ---\n{self.traceback.rstrip()}"


class ActorError(Exception):
    """Base class of the runtime's faults."""


class RemoteError(ActorError):
    """A handler raised while serving an `ask`; the actor keeps serving.

    `failure.type` names the remote exception class, `failure.traceback` holds its traceback.
    """

    def __init__(self, actor: str, failure: Failure) -> None:
        super().__init__(f"actor {actor!r} raised {failure.describe()}")
        self.actor = actor
        self.failure = failure


class ActorDeadError(ActorError):
    """The actor (or its process, or its node) is dead; `cause` is the root cause."""

    def __init__(self, actor: str, cause: Failure) -> None:
        super().__init__(f"actor {actor!r} is dead: {cause.describe()}")
        self.actor = actor
        self.cause = cause


class AskTimeoutError(ActorError, TimeoutError):
    """No reply within the ask's timeout (the peer may still be working on it)."""


class MailboxFullError(ActorError):
    """The target's mailbox has no room and the caller asked not to wait."""


class BadMessageError(ActorError):
    """The receiver could not decode or validate the message (unknown type, bad fields, bad frame)."""


class UnknownActorError(ActorError):
    """No actor of that name is hosted at that address or known to the directory."""


class SpawnError(ActorError):
    """An actor could not be started (its constructor or `on_start` raised, or its process died)."""

    def __init__(self, actor: str, cause: Failure) -> None:
        super().__init__(f"actor {actor!r} failed to start: {cause.describe()}")
        self.actor = actor
        self.cause = cause


class BlobGoneError(ActorError):
    """A data-plane blob cannot be read: it was freed, or its owner process is gone."""


class DataPlaneFullError(ActorError):
    """A process's data plane would pass `RuntimeConfig.dataplane_max_bytes`, or its
    shared-memory folder is full: free blobs once their readers are done, or raise the limit."""
