"""The refill scheduler over the real runtime, with stand-in workers and buffer (the boundaries this
test is not about): when every sample fails at once, it backs off instead of resubmitting as fast
as the failures come, says why, and goes back to full speed after a sample succeeds."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from miles_async.actors.buffer import PutGroup, PutReply
from miles_async.actors.rollout import Rollout, SamplingConfig, failed
from miles_async.actors.scheduler import FAIL_STREAK, AddEngine, RefillScheduler
from miles_async.policies.refill import RefillConfig
from miles_async.runtime import Actor, ActorSystem, Message, handler
from miles_async.runtime import run as run_async
from miles_async.tasks.reverse import Prompt
from miles_async.trajectory import TokenData, Trajectory, VersionSpan


class Calls(Message[int]):
    """How many rollouts the stand-in worker answered."""


class Heal(Message[None]):
    """Make the stand-in worker succeed from now on."""


class FlakyWorker(Actor):
    """Answers every rollout at once: failed ("error") until healed, then a finished sample."""

    def __init__(self) -> None:
        self.calls = 0
        self.healed = False

    @handler(concurrent=True)
    async def rollout(self, msg: Rollout) -> Trajectory:
        self.calls += 1
        now = time.time()
        if not self.healed:
            return failed(msg, now, 1, "error", "RuntimeError: chat completion failed (401)")
        return Trajectory(prompt_id=msg.prompt_id, index=msg.index, attempt=msg.attempt, request_id=msg.request_id,
                          engine=msg.engine, finish_reason="stop", versions=(VersionSpan(msg.engine_version, 1, 2),),
                          num_tokens=2, num_prompt_tokens=1, num_generated_tokens=1, submit_s=now, end_s=now,
                          data=TokenData.build(tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -0.1]))

    @handler
    def count(self, msg: Calls) -> int:
        return self.calls

    @handler
    def heal(self, msg: Heal) -> None:
        self.healed = True


class Sink(Actor):
    """Stands in for the buffer: takes every group."""

    @handler
    def put(self, msg: PutGroup) -> PutReply:
        return PutReply(status="accepted")


def test_a_streak_of_failures_backs_off_and_a_success_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="miles_async.actors.scheduler")

    async def main() -> tuple[int, int]:
        async with ActorSystem() as system:
            worker = await system.spawn(FlakyWorker, "worker")
            await system.spawn(Sink, "sink")
            dataset = [Prompt(prompt_id=i, text="x", input_ids=[1], answer="x") for i in range(100)]
            config = RefillConfig(target_in_flight=8, group_size=4, batch_groups=1, max_staleness=1000)
            scheduler = await system.spawn(RefillScheduler, "scheduler", args=(config, dataset, SamplingConfig()),
                                           kwargs={"workers": ["worker"], "buffer": "sink"})
            await scheduler.tell(AddEngine(name="e0", url="http://127.0.0.1:9", version=0))
            await asyncio.sleep(1.5)
            failing = await worker.ask(Calls(), timeout_s=10)
            await worker.ask(Heal(), timeout_s=10)
            await asyncio.sleep(1.5)  # the samples in flight end their wait, and then it is full speed
            return failing, await worker.ask(Calls(), timeout_s=10) - failing

    failing, healthy = run_async(asyncio.wait_for(main(), 60))
    # without the back-off the in-process loop resubmits each failure at once: thousands a second
    assert FAIL_STREAK <= failing < 300, failing
    assert healthy > 1000 > 2.5 * failing, (failing, healthy)  # healed: full speed (to the admission limit)
    warnings = [r.getMessage() for r in caplog.records if "in a row failed" in r.getMessage()]
    assert warnings and "chat completion failed (401)" in warnings[0]
