"""CURVE: only holders of the run's keypair can deliver anything to a run's mailboxes."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from _actors import Add, Counter, Get, Record, Stats
from _support import config, message_frame, raw_dealer, recv_frame, recv_or_none, scenario

from miles_async.runtime import ActorAddress, ActorSystem, UnknownActorError, wire
from miles_async.runtime.messages import Register

TIMEOUT_S = 60.0
SILENCE_S = 1.0

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq was built without CURVE")


def test_only_the_runs_keyholders_get_through() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("tcp", curve=True)) as system:
            ref = await system.spawn(Counter, "vault", kwargs={"start": 1}, process=True)
            assert await ref.ask(Add(amount=1)) == 2  # the child process loaded the run's keys
            assert ref.address.startswith("tcp://127.0.0.1:")

            secrets = sorted(Path(system.run_dir).rglob("*.key_secret"))
            assert len(secrets) == 1, secrets
            key_dir = secrets[0].parent
            assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
            assert stat.S_IMODE(secrets[0].stat().st_mode) == 0o600
            public, secret = zmq.auth.load_certificate(str(secrets[0]))
            assert secret is not None

            ctx = zmq.asyncio.Context()
            foreign_public, foreign_secret = zmq.curve_keypair()
            insiders = raw_dealer(ctx, ref.address, curve=(public, secret, public))
            plain = raw_dealer(ctx, ref.address)
            foreign = raw_dealer(ctx, ref.address, curve=(foreign_public, foreign_secret, public))
            plain_root = raw_dealer(ctx, system.address)
            foreign_root = raw_dealer(ctx, system.address, curve=(foreign_public, foreign_secret, public))
            try:
                # control: the run's keys and the same hand-built frame do get an answer
                await insiders.send(message_frame("vault", Get(), msg_id=1))
                kind, msg_id, _, body = await recv_frame(insiders)
                assert (kind, msg_id, msgspec.msgpack.decode(body)) == (wire.REPLY, 1, 2)

                intruder = ActorAddress(name="intruder", address="tcp://127.0.0.1:1", capacity=1)
                for sock in (plain, foreign):
                    await _send_nowait(sock, message_frame("vault", Add(amount=1000), msg_id=2))
                    await _send_nowait(sock, message_frame("vault", Record(seq=6), msg_id=3, kind=wire.TELL))
                for sock in (plain_root, foreign_root):
                    await _send_nowait(sock, message_frame("$directory", Register(entry=intruder), msg_id=4))
                outsiders = (plain, foreign, plain_root, foreign_root)
                answers = await asyncio.gather(*(recv_or_none(sock, SILENCE_S) for sock in outsiders))
                assert answers == [None] * len(outsiders)
            finally:
                for sock in (insiders, plain, foreign, plain_root, foreign_root):
                    sock.close(linger=0)
                ctx.term()

            stats = await ref.ask(Stats())
            assert (stats.count, stats.history) == (2, [])  # nothing was delivered
            with pytest.raises(UnknownActorError):
                await system.lookup("intruder")

    scenario(main, TIMEOUT_S)


async def _send_nowait(sock: zmq.asyncio.Socket, data: bytes) -> None:
    # A DEALER queues a message only while it has a connection; once the server has refused the
    # handshake there is none, and a blocking send would wait forever. Refused here (zmq.Again)
    # or dropped there, the message must not arrive.
    with contextlib.suppress(zmq.Again):
        await sock.send(data, zmq.NOBLOCK)
