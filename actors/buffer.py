"""`Buffer`: the finished groups between rollout and training, bounded, with the policy's decisions.

    RefillScheduler ──PutGroup──► Buffer ──GetBatch──► controller (trainer side)
          ▲                         │
          └──── GroupsDropped ──────┘ (retry or discard: aborted, filtered, stale)

Consumes `PutGroup` (a complete group of n samples) and `GetBatch` (B groups for the trainer at
its current version); produces `PutReply` and `Batch`, and tells the scheduler which prompts
were dropped and whether to generate them again (`GroupsDropped`). The decisions are
`policies.buffer.BufferPolicy`'s; this actor adds waiting: a full buffer keeps a `PutGroup`
unanswered until a `GetBatch` makes room (backpressure on the scheduler's put; its sample slots were
already freed, and admission control still bounds the groups pending),
and a `GetBatch` waits until B groups are there (or its timeout passes: it then answers with
what is there only if `allow_partial`). A group holds its samples' `Trajectory` records, typed
wherever the buffer runs; their token arrays stay in the data plane of the process that made
them, and the buffer frees those of every group it drops (aborted, filtered, stale).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import msgspec

from miles_async.policies.buffer import BufferConfig, BufferMetrics, BufferPolicy, Drawn, Group
from miles_async.runtime import Actor, ActorRef, Clock, Message, RealClock, handler
from miles_async.trajectory import blobs


class PutReply(msgspec.Struct, frozen=True, kw_only=True):
    status: str  # "accepted" | "dropped"
    reason: str = ""


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    groups: list[Group]
    metrics: BufferMetrics
    waited_s: float  # how long the trainer waited for data


class PutGroup(Message[PutReply], frozen=True):
    group: Group


class GetBatch(Message[Batch], frozen=True):
    batch_groups: int
    trainer_version: int
    timeout_s: float = 600.0
    allow_partial: bool = False


class GroupsDropped(Message, frozen=True):
    prompt_ids: list[int]
    retry: bool
    reason: str


class BufferState(msgspec.Struct, frozen=True, kw_only=True):
    num_groups: int  # waiting for a batch
    dropped: dict[str, int]  # groups dropped since the start, by reason (aborted, filtered, stale)


class BufferStats(Message[BufferState], frozen=True):
    """What the buffer holds and has dropped."""


class Buffer(Actor):
    """Holds groups for the trainer (module docstring). `scheduler` is told of every drop."""

    mailbox_capacity: ClassVar[int] = 4096

    def __init__(self, config: BufferConfig, scheduler: str, clock: Clock | None = None) -> None:
        self.policy = BufferPolicy(config)
        self.scheduler_name = scheduler
        self.scheduler: ActorRef | None = None
        self.clock = clock or RealClock()
        self.changed = asyncio.Event()  # set on every put and get: waiters re-check
        self.dropped: dict[str, int] = {"aborted": 0, "filtered": 0, "stale": 0}

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _free(self, groups: list[Group]) -> None:
        self.system.dataplane.free(blobs(s for g in groups for s in g.samples))

    async def _tell_dropped(self, prompt_ids: list[int], retry: bool, reason: str) -> None:
        if prompt_ids:
            self.dropped[reason] = self.dropped.get(reason, 0) + len(prompt_ids)
            if self.scheduler is None:
                self.scheduler = await self.system.lookup(self.scheduler_name, timeout_s=60.0)
            await self.scheduler.tell(GroupsDropped(prompt_ids=prompt_ids, retry=retry, reason=reason))

    @handler(concurrent=True)
    async def put(self, msg: PutGroup) -> PutReply:
        while True:
            decision = self.policy.put(msg.group, now=self.clock.now())
            if decision.status != "full":
                break
            await self.changed.wait()  # backpressure: answered once a get makes room
        if decision.status == "dropped":
            self._free([msg.group])
            await self._tell_dropped([msg.group.prompt_id], decision.retry, decision.reason or "aborted")
            return PutReply(status="dropped", reason=decision.reason or "")
        self._notify()
        return PutReply(status="accepted")

    @handler(concurrent=True)
    async def get(self, msg: GetBatch) -> Batch:
        capacity = self.policy.config.capacity_groups
        if msg.batch_groups > capacity and not msg.allow_partial:
            raise ValueError(f"a batch of {msg.batch_groups} groups can never fill from a buffer of "
                             f"capacity_groups={capacity}; raise buffer.capacity_groups")
        start = self.clock.now()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + msg.timeout_s
        while True:
            drawn: Drawn = self.policy.get(msg.batch_groups, msg.trainer_version, now=self.clock.now(),
                                           allow_partial=msg.allow_partial)
            self._free(drawn.stale)
            await self._tell_dropped(drawn.retry, True, "stale")
            await self._tell_dropped(drawn.discarded, False, "stale")
            if drawn.groups:
                self._notify()
                return Batch(groups=drawn.groups, metrics=drawn.metrics, waited_s=self.clock.now() - start)
            remaining = deadline - loop.time()
            if remaining <= 0:
                dropped = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items() if n) or "none"
                hint = (" (every group scoring the same reward is filtered: is the reward always 0? a longer "
                        "SFT warm start, or filter = \"none\")" if self.dropped.get("filtered") else "")
                raise TimeoutError(f"no batch of {msg.batch_groups} groups within {msg.timeout_s:g}s: "
                                   f"{self.policy.num_groups} waiting, dropped so far: {dropped}{hint}")
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    @handler
    async def stats(self, msg: BufferStats) -> BufferState:
        return BufferState(num_groups=self.policy.num_groups, dropped=dict(self.dropped))
