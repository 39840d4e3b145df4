"""The Buffer actor over the real runtime: a full buffer keeps the producer waiting until a get
makes room; a get waits for a whole batch; drops reach the scheduler with their reason. The buffer
owns the groups' data-plane blobs from their put: it frees those it drops, a batch it hands out
stays readable until its `ReleaseBatch` (then freed once), and what it holds when it stops."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.actors.buffer import Buffer, BufferStats, GetBatch, GroupsDropped, PutGroup, ReleaseBatch
from miles_async.policies.buffer import BufferConfig, Group
from miles_async.runtime import Actor, ActorSystem, BlobGoneError, BlobRef, Message, RemoteError, handler
from miles_async.runtime import run as run_async
from miles_async.runtime.dataplane import DataPlane
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, decode_data, encode_data


class Drops(Message[list]):
    """The drops the stand-in scheduler heard of."""


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


def sample(dataplane: DataPlane, prompt_id: int, index: int, version: int, reward: float, aborted: bool) -> Trajectory:
    """A finished sample whose arrays are in `dataplane`, as a rollout worker makes it."""
    data = TokenData.build(tokens=[prompt_id, index, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.1])
    return Trajectory(prompt_id=prompt_id, index=index, versions=(VersionSpan(version, 1, 3),), reward=reward,
                      finish_reason="abort" if aborted else "stop", num_tokens=3, num_prompt_tokens=1,
                      num_generated_tokens=2, data=dataplane.put(encode_data(data)))


def group(dataplane: DataPlane, prompt_id: int, rewards: list[float], aborted: bool = False, version: int = 0) -> Group:
    return Group(prompt_id=prompt_id, samples=tuple(sample(dataplane, prompt_id, i, version, r, aborted and i == 0)
                                                   for i, r in enumerate(rewards)))


def refs(*groups: Group) -> list[BlobRef]:
    return [s.data for g in groups for s in g.samples if isinstance(s.data, BlobRef)]


async def assert_freed(dataplane: DataPlane, *groups: Group) -> None:
    for ref in refs(*groups):
        with pytest.raises(BlobGoneError):
            await dataplane.read(ref)


async def assert_readable(dataplane: DataPlane, *groups: Group) -> None:
    for g in groups:
        for s in g.samples:
            assert isinstance(s.data, BlobRef)
            assert decode_data(await dataplane.read(s.data)).token_ids().tolist() == [g.prompt_id, s.index, 7]


def test_a_full_buffer_blocks_the_producer_until_a_get_makes_room():
    async def main():
        async with ActorSystem() as system:
            dp = system.dataplane
            scheduler = await system.spawn(FakeScheduler, "scheduler")
            buffer = await system.spawn(Buffer, "buffer", args=(BufferConfig(capacity_groups=1), "scheduler"))
            g0, g1 = group(dp, 0, [0.0, 1.0]), group(dp, 1, [1.0, 0.0])
            assert (await buffer.ask(PutGroup(group=g0), timeout_s=10)).status == "accepted"
            blocked = buffer.ask_future(PutGroup(group=g1), timeout_s=10)
            await asyncio.sleep(0.2)
            assert not blocked.done(), "the second put must wait while the buffer is full"
            batch = await buffer.ask(GetBatch(batch_groups=1, trainer_version=0, timeout_s=10), timeout_s=15)
            assert [g.prompt_id for g in batch.groups] == [0]
            assert (await asyncio.wait_for(blocked, 10)).status == "accepted"
            with pytest.raises(RemoteError, match="can never fill"):
                await buffer.ask(GetBatch(batch_groups=2, trainer_version=0, timeout_s=10), timeout_s=15)
            await system.stop(buffer)  # it frees what it holds: g0 lent, g1 waiting
            await assert_freed(dp, g0, g1)
            assert dp.stats.num_blobs == 0
            buffer = await system.spawn(Buffer, "buffer2", args=(BufferConfig(capacity_groups=4), "scheduler"))
            g1, g2 = group(dp, 1, [1.0, 0.0]), group(dp, 2, [0.0, 1.0])
            await buffer.ask(PutGroup(group=g1), timeout_s=10)
            waiting = buffer.ask_future(GetBatch(batch_groups=2, trainer_version=0, timeout_s=10), timeout_s=15)
            await asyncio.sleep(0.1)
            assert not waiting.done(), "a get waits for a whole batch"
            await buffer.ask(PutGroup(group=g2), timeout_s=10)
            lent = await asyncio.wait_for(waiting, 10)
            assert [g.prompt_id for g in lent.groups] == [1, 2]
            handed_out = [g1, g2]
            assert dp.stats.num_blobs == 2 * len(handed_out)  # handed out: the trainer reads them later

            g3, g4 = group(dp, 3, [1.0, 1.0]), group(dp, 4, [0.0, 1.0], aborted=True)
            dropped = [await buffer.ask(PutGroup(group=g), timeout_s=10) for g in (g3, g4)]
            assert [(d.status, d.reason) for d in dropped] == [("dropped", "filtered"), ("dropped", "aborted")]
            assert dp.stats.num_blobs == 2 * len(handed_out)  # both groups' blobs freed by the buffer
            await assert_freed(dp, g3, g4)

            g5, g6 = group(dp, 5, [0.0, 1.0], version=0), group(dp, 6, [1.0, 0.0], version=3)
            for g in (g5, g6):
                assert (await buffer.ask(PutGroup(group=g), timeout_s=10)).status == "accepted"
            batch = await buffer.ask(GetBatch(batch_groups=1, trainer_version=3, timeout_s=10), timeout_s=15)
            assert [g.prompt_id for g in batch.groups] == [6]  # 5 is 3 versions old (max_staleness 1): dropped
            assert batch.batch_id != lent.batch_id
            handed_out.append(g6)
            assert dp.stats.num_blobs == 2 * len(handed_out)
            await assert_freed(dp, g5)
            await assert_readable(dp, *handed_out)
            state = await buffer.ask(BufferStats(), timeout_s=10)
            assert (state.num_groups, state.dropped, state.num_lent) == (0, {"aborted": 1, "filtered": 1, "stale": 1}, 2)
            for trained in (lent, batch):  # the steps that trained them: the buffer frees their blobs
                await buffer.tell(ReleaseBatch(batch_id=trained.batch_id))
            assert (await buffer.ask(BufferStats(), timeout_s=10)).num_lent == 0
            assert dp.stats.num_blobs == 0
            await asyncio.sleep(0.1)
            return await scheduler.ask(Drops(), timeout_s=10)

    drops = run_async(asyncio.wait_for(main(), 60))
    assert drops == [([3], False, "filtered"), ([4], True, "aborted"), ([5], True, "stale")]


def test_a_batch_is_freed_once_by_its_release_and_nothing_leaks(caplog: pytest.LogCaptureFixture):
    """One owner per blob: a batch's blobs live until its release and are freed exactly once (a
    second release frees nothing: the data plane never sees a free of a blob not live); groups
    dropped stale and a buffer stopped with groups waiting and lent leave no blob behind."""

    async def main() -> None:
        async with ActorSystem() as system:
            dp = system.dataplane
            await system.spawn(FakeScheduler, "scheduler")
            buffer = await system.spawn(Buffer, "buffer", args=(BufferConfig(capacity_groups=8), "scheduler"))
            groups = [group(dp, i, [0.0, 1.0], version=0 if i < 2 else 2) for i in range(4)]
            for g in groups[:2]:
                assert (await buffer.ask(PutGroup(group=g), timeout_s=10)).status == "accepted"
            first = await buffer.ask(GetBatch(batch_groups=2, trainer_version=0, timeout_s=10), timeout_s=15)
            await assert_readable(dp, *first.groups)  # lent: the trainer reads them until the release
            await buffer.tell(ReleaseBatch(batch_id=first.batch_id))
            await buffer.tell(ReleaseBatch(batch_id=first.batch_id))  # twice: the second frees nothing
            await buffer.ask(BufferStats(), timeout_s=10)  # (the mailbox is in order: both were handled)
            await assert_freed(dp, *first.groups)
            assert dp.stats.num_blobs == 2 * 2  # groups 2 and 3's, not put yet
            stale = group(dp, 9, [0.0, 1.0], version=0)
            for g in (*groups[2:], stale):
                assert (await buffer.ask(PutGroup(group=g), timeout_s=10)).status == "accepted"
            second = await buffer.ask(GetBatch(batch_groups=1, trainer_version=2, timeout_s=10), timeout_s=15)
            assert [g.prompt_id for g in second.groups] == [2]
            await assert_freed(dp, stale)  # dropped stale: freed by the buffer at once
            waiting = [groups[3]]
            await system.stop(buffer)  # with one batch lent and one group waiting
            await assert_freed(dp, *second.groups, *waiting)
            assert dp.stats.num_blobs == 0

    with caplog.at_level("DEBUG", logger="miles_async"):
        run_async(asyncio.wait_for(main(), 60))
    assert not [r for r in caplog.records if "freed twice" in r.getMessage()], "a blob was freed twice"
    assert any("not lent (released twice?)" in r.getMessage() for r in caplog.records)
