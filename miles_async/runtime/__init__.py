"""The actor runtime: actors, mailboxes over ZeroMQ, msgspec messages, supervision, clocks.

It knows nothing of RL; the roles in `miles_async.actors` are built on it. See `system.py` for
an example, `actor.py` for handler semantics, `wire.py` for the frames on the wire, `dataplane.py`
for bulk bytes passed by reference.

The names below load on first use (PEP 562), so that importing the plain-data modules
(`runtime.messages`, `runtime.clock`, `runtime.errors`) pulls in no ZeroMQ: the pure policies and
the simulator use them without sockets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Actor": "actor", "handler": "actor",
    "Clock": "clock", "RealClock": "clock", "VirtualClock": "clock",
    "RuntimeConfig": "config",
    "DataPlane": "dataplane", "DataPlaneStats": "dataplane",
    "ActorDeadError": "errors", "ActorError": "errors", "AskTimeoutError": "errors", "BadMessageError": "errors",
    "BlobGoneError": "errors", "DataPlaneFullError": "errors", "Failure": "errors", "MailboxFullError": "errors",
    "RemoteError": "errors", "SpawnError": "errors", "UnknownActorError": "errors",
    "run": "loop",
    "ActorAddress": "messages", "BlobRef": "messages", "Message": "messages",
    "ActorRef": "refs",
    "RestartBudget": "supervision", "RestartPolicy": "supervision",
    "ActorSystem": "system",
}

__all__ = [
    "Actor", "ActorAddress", "ActorDeadError", "ActorError", "ActorRef", "ActorSystem", "AskTimeoutError",
    "BadMessageError", "BlobGoneError", "BlobRef", "Clock", "DataPlane", "DataPlaneFullError",
    "DataPlaneStats", "Failure", "MailboxFullError", "Message", "RealClock", "RemoteError", "RestartBudget",
    "RestartPolicy", "RuntimeConfig", "SpawnError", "UnknownActorError", "VirtualClock", "handler", "run",
]


assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_async.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"miles_async.runtime.{module}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


if TYPE_CHECKING:
    from miles_async.runtime.actor import Actor, handler
    from miles_async.runtime.clock import Clock, RealClock, VirtualClock
    from miles_async.runtime.config import RuntimeConfig
    from miles_async.runtime.dataplane import DataPlane, DataPlaneStats
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
    from miles_async.runtime.messages import ActorAddress, BlobRef, Message
    from miles_async.runtime.refs import ActorRef
    from miles_async.runtime.supervision import RestartBudget, RestartPolicy
    from miles_async.runtime.system import ActorSystem
