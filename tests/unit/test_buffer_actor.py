"""The Buffer actor over the real runtime: a full buffer keeps the producer waiting until a get
makes room; a get waits for a whole batch; drops reach the scheduler with their reason."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from miles_async.actors.buffer import Buffer, GetBatch, GroupsDropped, PutGroup
from miles_async.policies.buffer import BufferConfig, Group, SampleRecord
from miles_async.runtime import Actor, ActorSystem, Message, RemoteError, handler
from miles_async.runtime import run as run_async


class Drops(Message):
    Reply: ClassVar[Any] = list


class FakeScheduler(Actor):
    """Stands in for the refill scheduler (the boundary this test is not about): records drops."""

    def __init__(self) -> None:
        self.drops: list[tuple[list[int], bool, str]] = []

    @handler
    async def dropped(self, msg: GroupsDropped) -> None:
        self.drops.append((msg.prompt_ids, msg.retry, msg.reason))

    @handler
    async def get_drops(self, msg: Drops) -> list:
        return self.drops


def group(prompt_id: int, rewards: list[float], aborted: bool = False) -> Group:
    return Group(prompt_id=prompt_id, samples=tuple(
        SampleRecord(prompt_id=prompt_id, index=i, versions=(0,), reward=r, aborted=aborted and i == 0)
        for i, r in enumerate(rewards)))


def test_a_full_buffer_blocks_the_producer_until_a_get_makes_room():
    async def main():
        async with ActorSystem() as system:
            scheduler = await system.spawn(FakeScheduler, "scheduler")
            buffer = await system.spawn(Buffer, "buffer", args=(BufferConfig(capacity_groups=1), "scheduler"))
            assert (await buffer.ask(PutGroup(group=group(0, [0.0, 1.0])), timeout_s=10)).status == "accepted"
            blocked = buffer.ask_future(PutGroup(group=group(1, [1.0, 0.0])), timeout_s=10)
            await asyncio.sleep(0.2)
            assert not blocked.done(), "the second put must wait while the buffer is full"
            batch = await buffer.ask(GetBatch(batch_groups=1, trainer_version=0, timeout_s=10), timeout_s=15)
            assert [g.prompt_id for g in batch.groups] == [0]
            assert (await asyncio.wait_for(blocked, 10)).status == "accepted"
            with pytest.raises(RemoteError, match="can never fill"):
                await buffer.ask(GetBatch(batch_groups=2, trainer_version=0, timeout_s=10), timeout_s=15)
            await system.stop(buffer)
            buffer = await system.spawn(Buffer, "buffer2", args=(BufferConfig(capacity_groups=4), "scheduler"))
            await buffer.ask(PutGroup(group=group(1, [1.0, 0.0])), timeout_s=10)
            waiting = buffer.ask_future(GetBatch(batch_groups=2, trainer_version=0, timeout_s=10), timeout_s=15)
            await asyncio.sleep(0.1)
            assert not waiting.done(), "a get waits for a whole batch"
            await buffer.ask(PutGroup(group=group(2, [0.0, 1.0])), timeout_s=10)
            assert [g.prompt_id for g in (await asyncio.wait_for(waiting, 10)).groups] == [1, 2]
            dropped = [await buffer.ask(PutGroup(group=g), timeout_s=10)
                       for g in (group(3, [1.0, 1.0]), group(4, [0.0, 1.0], aborted=True))]
            assert [(d.status, d.reason) for d in dropped] == [("dropped", "filtered"), ("dropped", "aborted")]
            await asyncio.sleep(0.1)
            return await scheduler.ask(Drops(), timeout_s=10)

    drops = run_async(asyncio.wait_for(main(), 60))
    assert drops == [([3], False, "filtered"), ([4], True, "aborted")]
