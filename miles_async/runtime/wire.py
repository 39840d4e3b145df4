"""The frames actor systems exchange over ZeroMQ.

Every message is one ZeroMQ frame: a 10-byte head, `kind` (u8), `msg_id` (u64, little-endian)
and the length of the route (u8), then the route (the UTF-8 name of the target actor, at most
255 bytes), then the body (msgpack). A caller's DEALER sends it to the host's ROUTER, which
prepends the caller's identity; answers travel back over the same connection:

    ASK   id, target + message   ->  REPLY id + value   |  ERROR id, target + ErrorReply
    TELL  id, target + message   ->  (later) ACK n, target: n tells to target are finished
    PING  id                     ->  PONG id            (heartbeats; any frame counts)

A tell is answered only by an ACK (credit returned) or an ERROR, which is how a sender's
window of unfinished messages per target (the mailbox bound) is kept without a reply per tell.
One frame per message, and the socket calls of pyzmq's Cython layer (`raw_send`, `raw_recv`,
`raw_get`), keep the per-message cost near the cost of the system calls themselves.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import uuid
from collections.abc import Callable
from typing import Literal, cast

import msgspec
import zmq
import zmq.backend

from miles_async.runtime.errors import (
    ActorDeadError,
    ActorError,
    BadMessageError,
    Failure,
    MailboxFullError,
    RemoteError,
    UnknownActorError,
)

ASK, TELL, REPLY, ERROR, ACK, PING, PONG = range(1, 8)
HEAD = struct.Struct("<BQB")
HEAD_BYTES = HEAD.size
MAX_ROUTE_BYTES = 255

# The Cython methods under pyzmq's Python layer: the same calls without its per-call overhead
# (several microseconds each, more than libzmq's own work for a small frame).
_Raw = zmq.backend.Socket if issubclass(zmq.Socket, zmq.backend.Socket) else zmq.Socket
raw_send, raw_recv = _Raw.send, _Raw.recv
# pyzmq types `get` as returning `int | bytes` whatever the option; the options read with it
# (EVENTS, RCVMORE) are ints.
raw_get = cast("Callable[[zmq.Socket, int], int]", _Raw.get)
NOBLOCK, SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE) | int(zmq.NOBLOCK)
EVENTS, RCVMORE, POLLIN = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.POLLIN)


def frame(kind: int, msg_id: int, route: bytes = b"", body: bytes = b"") -> bytes:
    """One wire frame (see the module docstring)."""
    return HEAD.pack(kind, msg_id, len(route)) + route + body


def parse(data: bytes) -> tuple[int, int, bytes, memoryview]:
    """(kind, msg_id, route, body) of a frame; ValueError if it is too short for its head."""
    if len(data) < HEAD_BYTES:
        raise ValueError(f"a frame needs a {HEAD_BYTES}-byte head, got {len(data)} bytes")
    kind, msg_id, route_len = HEAD.unpack_from(data)
    end = HEAD_BYTES + route_len
    if len(data) < end:
        raise ValueError(f"the frame's route needs {route_len} bytes, got {len(data) - HEAD_BYTES}")
    return kind, msg_id, data[HEAD_BYTES:end], memoryview(data)[end:]

ErrorKind = Literal["handler", "dead", "bad_message", "bad_frame", "unknown_actor", "mailbox_full"]


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    kind: ErrorKind
    failure: Failure


ERROR_ENCODER = msgspec.msgpack.Encoder()
ERROR_DECODER = msgspec.msgpack.Decoder(ErrorReply)


def error_frame(kind: ErrorKind, failure: Failure) -> bytes:
    return ERROR_ENCODER.encode(ErrorReply(kind=kind, failure=failure))


def to_exception(actor: str, err: ErrorReply) -> ActorError:
    """The exception a caller sees for an ERROR frame."""
    if err.kind == "handler":
        return RemoteError(actor, err.failure)
    if err.kind == "dead":
        return ActorDeadError(actor, err.failure)
    if err.kind == "unknown_actor":
        return UnknownActorError(err.failure.message)
    if err.kind == "mailbox_full":
        return MailboxFullError(err.failure.message)
    return BadMessageError(f"actor {actor!r} rejected the message: {err.failure.message}")


def problem(type_name: str, message: str) -> Failure:
    """A fault found by the runtime itself (no Python traceback worth sending)."""
    return Failure(type=type_name, message=message)


def ipc_path(run_dir: str, name: str) -> str:
    """The socket file of a process named `name` in the run folder (short enough for AF_UNIX)."""
    path = os.path.join(run_dir, f"{name}.sock")
    if len(path.encode()) > 100:  # AF_UNIX paths are limited to ~107 bytes
        path = os.path.join(tempfile.gettempdir(), f"ma-{uuid.uuid5(uuid.NAMESPACE_URL, path).hex[:16]}.sock")
    return path


def check_ipc_free(path: str) -> None:
    """Refuse to bind a socket file a live process listens on (libzmq would silently take it over).

    A file left by a dead process refuses connections and may be reused (a restart does that).
    """
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return
    finally:
        probe.close()
    raise OSError(f"{path} is in use by a live process (another actor system or actor of that name)")
