"""The actor runtime: actors, mailboxes over ZeroMQ, msgspec messages, supervision, clocks.

It knows nothing of RL; the roles in `miles_async.actors` are built on it. See `system.py` for
an example, `actor.py` for handler semantics, `wire.py` for the frames on the wire, `dataplane.py`
for bulk bytes passed by reference.
"""

from miles_async.runtime.actor import Actor, handler
from miles_async.runtime.clock import Clock, RealClock, VirtualClock
from miles_async.runtime.config import RuntimeConfig
from miles_async.runtime.dataplane import BlobRef, DataPlane, DataPlaneStats
from miles_async.runtime.errors import (
    ActorDeadError,
    ActorError,
    AskTimeoutError,
    BadMessageError,
    BlobGoneError,
    DataPlaneFullError,
    Failure,
    MailboxFullError,
    RemoteError,
    SpawnError,
    UnknownActorError,
)
from miles_async.runtime.loop import run
from miles_async.runtime.messages import ActorAddress, Message
from miles_async.runtime.refs import ActorRef
from miles_async.runtime.supervision import RestartPolicy
from miles_async.runtime.system import ActorSystem

__all__ = [
    "Actor", "ActorAddress", "ActorDeadError", "ActorError", "ActorRef", "ActorSystem", "AskTimeoutError",
    "BadMessageError", "BlobGoneError", "BlobRef", "Clock", "DataPlane", "DataPlaneFullError", "DataPlaneStats",
    "Failure", "MailboxFullError", "Message", "RealClock", "RemoteError", "RestartPolicy", "RuntimeConfig",
    "SpawnError", "UnknownActorError", "VirtualClock", "handler", "run",
]
