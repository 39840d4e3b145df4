"""The wire under hostile or greedy callers: garbage gets typed errors, full mailboxes push back.

A raw DEALER builds frames by hand (see `miles_async.runtime.wire`), so these tests see exactly
what any process that can reach a mailbox can send.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import zmq
import zmq.asyncio
from _actors import (
    Add,
    Blob,
    CloseGate,
    Counter,
    Fill,
    Gate,
    Get,
    Held,
    Hold,
    OpenGate,
    Record,
    Sleep,
    Stats,
    Unhandled,
)
from _support import (
    TRANSPORTS,
    config,
    message_frame,
    raw_dealer,
    recv_error,
    recv_frame,
    recv_or_none,
    scenario,
)

from miles_async.runtime import ActorRef, ActorSystem, MailboxFullError, RemoteError, wire

TIMEOUT_S = 60.0
SEED = 20240611
NUM_RANDOM = 25
CAPACITY = Gate.mailbox_capacity
MAX_MESSAGE_BYTES = 64 * 1024


def _garbage(rng: random.Random) -> list[tuple[str, list[bytes], str, int | None]]:
    """(what, frames, expected error kind, expected msg_id or None) for each bad input."""
    enc = msgspec.msgpack.encode
    frame, ask, tell, to = wire.frame, wire.ASK, wire.TELL, b"counter"
    cases: list[tuple[str, list[bytes], str, int | None]] = []
    for i in range(NUM_RANDOM):  # too short for a head
        short = rng.randbytes(rng.randrange(wire.HEAD_BYTES))
        cases.append((f"short random frame {i}", [short], "bad_frame", 0))
    for i in range(NUM_RANDOM):  # a long random frame whose kind is none of ASK, TELL, PING
        data = bytearray(rng.randbytes(rng.randrange(wire.HEAD_BYTES, 300)))
        data[0] = rng.choice([0, wire.REPLY, wire.ERROR, wire.ACK, wire.PONG, *range(8, 256)])
        cases.append((f"long random frame {i}", [bytes(data)], "bad_frame", None))
    for i in range(5):  # several frames where one is expected
        frames = [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(2, 5))]
        cases.append((f"random multipart {i}", frames, "bad_frame", 0))
    cases += [
        ("3-byte head", [b"\x01\x02\x03"], "bad_frame", 0),
        ("empty frame", [b""], "bad_frame", 0),
        ("route longer than the frame", [wire.HEAD.pack(ask, 5, 200) + to], "bad_frame", 0),
        ("REPLY sent to a host", [frame(wire.REPLY, 6, to, enc(Get()))], "bad_frame", 6),
        ("unknown kind", [frame(99, 7, to, enc(Add(amount=1)))], "bad_frame", 7),
        ("a valid ask and an extra frame", [frame(ask, 8, to, enc(Add(amount=1))), b"x"], "bad_frame", 0),
        ("ask to an unknown actor", [frame(ask, 9, b"nobody", enc(Add(amount=1)))], "unknown_actor", 9),
        ("tell to an unknown actor", [frame(tell, 10, b"nobody", enc(Add(amount=1)))], "unknown_actor", 10),
        ("ask with an empty body", [frame(ask, 11, to)], "bad_message", 11),
        ("ask of an unhandled type", [frame(ask, 12, to, enc(Unhandled(x=1)))], "bad_message", 12),
        ("tell of an unhandled type", [frame(tell, 13, to, enc(Unhandled(x=1)))], "bad_message", 13),
        ("ask with a mistyped field", [frame(ask, 14, to, enc(["Add", "many"]))], "bad_message", 14),
        ("tell of a crash, mistyped", [frame(tell, 15, to, enc(["Crash", 1]))], "bad_message", 15),
        ("garbage to the directory", [frame(ask, 16, b"$directory", b"\xc1\xc1")], "bad_message", 16),
    ]
    for i in range(NUM_RANDOM):  # a valid head, a random body
        kind = rng.choice([ask, tell])
        body = rng.randbytes(rng.randrange(1, 200))
        cases.append((f"random body {i}", [frame(kind, 100 + i, to, body)], "bad_message", 100 + i))
    return cases


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_at_a_live_mailbox_gets_typed_errors(transport: str) -> None:
    async def main() -> None:
        async with ActorSystem(config=config(transport)) as system:
            counter = await system.spawn(Counter, "counter", kwargs={"start": 3})
            ctx = zmq.asyncio.Context()
            sock = raw_dealer(ctx, system.address)
            try:
                await _raw_get_is(sock, 3, msg_id=1)  # the hand-built frames are right

                for what, frames, kind, msg_id in _garbage(random.Random(SEED)):
                    await sock.send_multipart(frames)
                    got_id, _, err = await recv_error(sock)
                    assert err.kind == kind, (what, err)
                    assert err.failure.message, what
                    if msg_id is not None:
                        assert got_id == msg_id, what

                await _raw_get_is(sock, 3, msg_id=2)
                assert await recv_or_none(sock, 0.1) is None  # one answer per input, no more
            finally:
                sock.close(linger=0)
                ctx.term()

            stats = await counter.ask(Stats())
            assert (stats.count, stats.history) == (3, [])  # none of the garbage reached the actor
            # and over the wire, from another process's point of view (its own system and link)
            async with ActorSystem("peer", config=config(transport), directory=system.address) as peer:
                remote = await peer.lookup("counter")
                assert not remote.is_local
                assert await remote.ask(Add(amount=2)) == 5
                await remote.tell(Record(seq=1))
                assert (await remote.ask(Stats())).history == [1]

    scenario(main, TIMEOUT_S)


async def _raw_get_is(sock: zmq.asyncio.Socket, expected: int, msg_id: int) -> None:
    await sock.send(message_frame("counter", Get(), msg_id))
    kind, got_id, _, body = await recv_frame(sock)
    assert (kind, got_id) == (wire.REPLY, msg_id)
    assert msgspec.msgpack.decode(body) == expected


def test_full_mailbox_pushes_back_over_the_wire() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            gate = await system.spawn(Gate, "gate", process=True)
            assert gate.capacity == CAPACITY
            # a second system has its own window at the gate: it can open it while ours is full
            async with ActorSystem("opener", config=config("ipc"), directory=system.address) as other:
                opener = await other.lookup("gate")

                for tag in range(CAPACITY):
                    gate.tell_nowait(Hold(tag=tag))
                with pytest.raises(MailboxFullError):
                    gate.tell_nowait(Hold(tag=99))
                blocked = asyncio.ensure_future(gate.tell(Hold(tag=CAPACITY)))
                done, _ = await asyncio.wait({blocked}, timeout=0.3)
                assert not done, "a tell past the window must wait for room"
                assert await opener.ask(Held()) == []

                await opener.tell(OpenGate())
                await asyncio.wait_for(blocked, 10.0)
                expected = list(range(CAPACITY + 1))
                await _wait_held(opener, expected)
                assert await gate.ask(Held()) == expected  # our window has room again

                await opener.ask(CloseGate())
                await _raw_caller_is_refused(gate.address, opener, expected)

    scenario(main, TIMEOUT_S)


async def _raw_caller_is_refused(address: str, opener: ActorRef, held_before: list[int]) -> None:
    """A caller that ignores its window is refused past the capacity, and nothing is lost before it."""
    num_sent = CAPACITY + 2
    ctx = zmq.asyncio.Context()
    sock = raw_dealer(ctx, address)
    try:
        for i in range(num_sent):
            await sock.send(message_frame("gate", Hold(tag=10 + i), msg_id=i + 1, kind=wire.TELL))
        refused = []
        for _ in range(num_sent - CAPACITY):
            msg_id, route, err = await recv_error(sock)
            assert (err.kind, route) == ("mailbox_full", b"gate"), err
            refused.append(msg_id)
        assert refused == list(range(CAPACITY + 1, num_sent + 1))
        assert await recv_or_none(sock, 0.2) is None  # the accepted tells wait at the gate: no ACK yet

        await opener.tell(OpenGate())
        num_acked = 0
        while num_acked < CAPACITY:
            kind, count, route, _ = await recv_frame(sock)
            assert (kind, route) == (wire.ACK, b"gate")
            num_acked += count
        assert num_acked == CAPACITY
        await _wait_held(opener, held_before + [10 + i for i in range(CAPACITY)])
    finally:
        sock.close(linger=0)
        ctx.term()


async def _wait_held(ref: ActorRef, expected: list[int]) -> None:
    last: list[int] = []

    async def poll() -> None:
        nonlocal last
        while last != expected:
            last = await ref.ask(Held())
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), 10.0)
    except asyncio.TimeoutError:
        raise AssertionError(f"held {last}, expected {expected}") from None


def test_an_oversized_message_or_reply_fails_alone() -> None:
    # Over ZMQ_MAXMSGSIZE the receiving socket drops the whole connection, and every reply in flight
    # on it with it; so sizes are checked before sending, on both sides.
    async def main() -> None:
        async with ActorSystem(config=config("ipc", max_message_bytes=MAX_MESSAGE_BYTES)) as system:
            ref = await system.spawn(Counter, "small", process=True)
            in_flight = ref.ask_future(Sleep(seconds=0.5), timeout_s=20.0)
            await ref.ask(Get())  # the Sleep is running in the child

            with pytest.raises(ValueError, match="max_message_bytes"):
                await ref.ask(Blob(data=b"x" * (2 * MAX_MESSAGE_BYTES)), timeout_s=10.0)
            with pytest.raises(ValueError, match="max_message_bytes"):
                await ref.tell(Blob(data=b"x" * (2 * MAX_MESSAGE_BYTES)))
            with pytest.raises(RemoteError) as info:
                await ref.ask(Fill(num_bytes=2 * MAX_MESSAGE_BYTES), timeout_s=10.0)
            assert "max_message_bytes" in info.value.failure.message

            assert await asyncio.wait_for(in_flight, 10.0) == 0.5  # the connection survived
            assert await ref.ask(Blob(data=b"x" * 1000)) == 1000
            assert len(await ref.ask(Fill(num_bytes=1000))) == 1000

    scenario(main, TIMEOUT_S)
