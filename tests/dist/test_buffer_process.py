"""The buffer in a process of its own (as `placement.buffer` puts it): it owns the groups' blobs,
which live in the producer's process, and frees them through their owner: a dropped group's at
once, a batch's at its `ReleaseBatch`, once, and what it still holds when it stops."""

from __future__ import annotations

from _support import config, scenario, wait_until

from miles_async.actors.buffer import Buffer, BufferStats, GetBatch, GroupsDropped, PutGroup, ReleaseBatch
from miles_async.policies.buffer import BufferConfig, Group
from miles_async.runtime import Actor, ActorSystem, BlobGoneError, BlobRef, handler
from miles_async.runtime.dataplane import DataPlane
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, encode_data

TIMEOUT_S = 60.0


class Scheduler(Actor):
    """Stands in for the refill scheduler (the boundary this test is not about): hears the drops."""

    @handler
    async def dropped(self, msg: GroupsDropped) -> None:
        pass


def group(dataplane: DataPlane, prompt_id: int, rewards: list[float]) -> Group:
    """A finished group whose arrays are in `dataplane` (this process's), as rollout workers make it."""
    data = encode_data(TokenData.build(tokens=[prompt_id, 5, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.1]))
    return Group(prompt_id=prompt_id, samples=tuple(
        Trajectory(prompt_id=prompt_id, index=i, versions=(VersionSpan(0, 1, 3),), reward=r, finish_reason="stop",
                   num_tokens=3, num_prompt_tokens=1, num_generated_tokens=2, data=dataplane.put(data))
        for i, r in enumerate(rewards)))


async def readable(dataplane: DataPlane, g: Group) -> bool:
    refs = [s.data for s in g.samples if isinstance(s.data, BlobRef)]
    try:
        return all([len(await dataplane.read(ref)) > 0 for ref in refs])
    except BlobGoneError:
        return False


def test_a_buffer_in_its_own_process_frees_every_blob_it_owns_once() -> None:
    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            dp = system.dataplane
            await system.spawn(Scheduler, "scheduler")
            buffer = await system.spawn(Buffer, "buffer", args=(BufferConfig(capacity_groups=4), "scheduler"),
                                        process=True)
            assert buffer.address != system.address  # another process: its frees go to the blobs' owner, here
            kept, filtered, waiting = group(dp, 0, [0.0, 1.0]), group(dp, 1, [1.0, 1.0]), group(dp, 2, [1.0, 0.0])
            for g, status in ((kept, "accepted"), (filtered, "dropped")):
                assert (await buffer.ask(PutGroup(group=g), timeout_s=10)).status == status
            batch = await buffer.ask(GetBatch(batch_groups=1, trainer_version=0, timeout_s=10), timeout_s=15)
            assert (await buffer.ask(PutGroup(group=waiting), timeout_s=10)).status == "accepted"
            await wait_until(lambda: dp.stats.num_blobs == 4, 10, "the filtered group's blobs freed by their owner")
            assert not await readable(dp, filtered)
            assert await readable(dp, kept) and batch.groups[0].prompt_id == 0  # lent: readable until released
            for _ in range(2):  # the second release frees nothing more
                await buffer.tell(ReleaseBatch(batch_id=batch.batch_id))
            assert (await buffer.ask(BufferStats(), timeout_s=10)).num_lent == 0
            await wait_until(lambda: dp.stats.num_blobs == 2, 10, "the trained batch's blobs freed")
            assert await readable(dp, waiting) and not await readable(dp, kept)
            await system.stop(buffer)
            await wait_until(lambda: dp.stats.num_blobs == 0, 10, "the waiting group's blobs freed at the stop")

    scenario(main, TIMEOUT_S)
