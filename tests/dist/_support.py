"""Helpers of the multi-process tests: bounded waits, process checks and a raw ZeroMQ client.

Every wait here has a deadline; polling (a check every few milliseconds until a deadline) stands
in for sleeping, since a child process's timing on a loaded machine is anyone's guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from miles_async.runtime import ActorError, ActorRef, Message, RuntimeConfig, run, wire

T = TypeVar("T")

TRANSPORTS = ("ipc", "tcp")
POLL_S = 0.02


def scenario(main: Callable[[], Coroutine[Any, Any, T]], timeout_s: float) -> T:
    """Run one test's scenario on uvloop, failing (not hanging) if it takes over `timeout_s`."""
    return run(asyncio.wait_for(main(), timeout_s))


def config(transport: str, **overrides: Any) -> RuntimeConfig:
    # generous defaults for a loaded 2-core machine; tests that time detection pass their own
    fields: dict[str, Any] = {
        "transport": transport, "ask_timeout_s": 30.0, "spawn_timeout_s": 60.0, "stop_grace_s": 2.0}
    fields.update(overrides)
    return RuntimeConfig(**fields)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False
    state = stat[stat.rindex(")") + 2]
    return state not in "ZX"


async def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `check` until it is true; returns the seconds it took, fails after `timeout_s`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not true within {timeout_s:g}s")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - start


async def wait_pid_gone(pid: int, timeout_s: float) -> float:
    return await wait_until(lambda: not pid_alive(pid), timeout_s, f"process {pid} exits")


async def ask_until_ok(ref: ActorRef, msg: Message, timeout_s: float, per_ask_s: float = 2.0) -> Any:
    """Ask until the actor answers (it may be restarting); fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await ref.ask(msg, timeout_s=per_ask_s)
        except ActorError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{ref.name!r} did not answer within {timeout_s:g}s; last: {exc!r}") from exc
        await asyncio.sleep(POLL_S)


async def raises_within(awaitable: Awaitable[Any], timeout_s: float) -> tuple[BaseException, float]:
    """Await something that must fail within `timeout_s`; returns the exception and how long it took."""
    start = time.monotonic()
    try:
        value = await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"still pending after {timeout_s:g}s") from None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - start
    raise AssertionError(f"expected a failure, got {value!r}")


# -- a raw client: frames built by hand, as wire.py describes them --------------------------


def raw_dealer(ctx: zmq.asyncio.Context, address: str, *, curve: tuple[bytes, bytes, bytes] | None = None
               ) -> zmq.asyncio.Socket:
    """A DEALER connected to `address`; `curve` is (public, secret, server public) to use CURVE."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    return sock


def message_frame(target: str, msg: Any, msg_id: int = 1, kind: int = wire.ASK) -> bytes:
    """An ASK (or another kind) of `msg` to `target`, encoded with msgspec as any caller would."""
    return wire.frame(kind, msg_id, target.encode(), msgspec.msgpack.encode(msg))


async def recv_or_none(sock: zmq.asyncio.Socket, timeout_s: float) -> list[bytes] | None:
    """The next message on `sock`, or None if nothing came within `timeout_s`."""
    if await sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return await sock.recv_multipart()
    return None


async def recv_frame(sock: zmq.asyncio.Socket, timeout_s: float = 10.0) -> tuple[int, int, bytes, bytes]:
    """(kind, msg_id, route, body) of the next reply; fails if none comes or it is not one frame."""
    frames = await recv_or_none(sock, timeout_s)
    assert frames is not None, f"no reply within {timeout_s:g}s"
    assert len(frames) == 1, f"a reply is one frame, got {len(frames)}"
    kind, msg_id, route, body = wire.parse(frames[0])
    return kind, msg_id, bytes(route), bytes(body)


async def recv_error(sock: zmq.asyncio.Socket, timeout_s: float = 10.0) -> tuple[int, bytes, wire.ErrorReply]:
    """(msg_id, route, ErrorReply) of the next reply, which must be an ERROR frame."""
    kind, msg_id, route, body = await recv_frame(sock, timeout_s)
    assert kind == wire.ERROR, f"expected an ERROR frame, got kind {kind} (body {body[:80]!r})"
    return msg_id, route, wire.ERROR_DECODER.decode(body)


def signal_if_alive(pid: int, sig: int) -> None:
    """Send a signal from a `finally`, where the process may already be gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
