"""`Buffer`: the finished groups between rollout and training, bounded, with the policy's decisions.

    RefillScheduler ──PutGroup──► Buffer ──GetBatch──► controller (trainer side)
          ▲                         │ ▲                    │
          └──── GroupsDropped ──────┘ └──ReleaseBatch──────┘ (trained: the buffer frees its blobs)
           (retry or discard: aborted, filtered, stale)

Consumes `PutGroup` (a complete group of n samples), `GetBatch` (B groups for the trainer at
its current version) and `ReleaseBatch` (a batch handed out is trained); produces `PutReply`
and `Batch`, and tells the scheduler which prompts were dropped and whether to generate them
again (`GroupsDropped`). The decisions are
`policies.buffer.BufferPolicy`'s; this actor adds waiting: a full buffer keeps a `PutGroup`
unanswered until a `GetBatch` makes room (backpressure on the scheduler's put; its sample slots were
already freed, and admission control still bounds the groups pending),
and a `GetBatch` waits until B groups are there (or its timeout passes: it then answers with
what is there only if `allow_partial`). A group holds its samples' `Trajectory` records, typed
wherever the buffer runs; their token arrays stay in the data plane of the process that made
them.

One owner per blob: from its `PutGroup` on, the buffer owns a group's data-plane blobs, and
`Buffer._release` is the one place they are freed: when the group is dropped (aborted,
filtered, stale), when the step that trained it says so (`ReleaseBatch` with the batch's id:
a batch handed out stays readable until then, and is freed once), or when the buffer stops
(whatever it still holds, lent or waiting). Nobody else frees them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import msgspec

from miles_async.policies.buffer import BufferConfig, BufferMetrics, BufferPolicy, Drawn, Group
from miles_async.runtime import Actor, ActorRef, Clock, Message, RealClock, handler
from miles_async.trajectory import blobs

log = logging.getLogger("miles_async.actors.buffer")


class PutReply(msgspec.Struct, frozen=True, kw_only=True):
    status: str  # "accepted" | "dropped"
    reason: str = ""


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    groups: list[Group]
    metrics: BufferMetrics
    waited_s: float  # how long the trainer waited for data
    batch_id: int = 0  # what `ReleaseBatch` names once it is trained: its blobs are the buffer's till then


class PutGroup(Message[PutReply], frozen=True):
    group: Group


class GetBatch(Message[Batch], frozen=True):
    batch_groups: int
    trainer_version: int
    timeout_s: float = 600.0
    allow_partial: bool = False


class ReleaseBatch(Message, frozen=True):
    """A batch handed out is done with (trained, or its step failed): the buffer frees its blobs."""

    batch_id: int


class GroupsDropped(Message, frozen=True):
    prompt_ids: list[int]
    retry: bool
    reason: str


class BufferState(msgspec.Struct, frozen=True, kw_only=True):
    num_groups: int  # waiting for a batch
    dropped: dict[str, int]  # groups dropped since the start, by reason (aborted, filtered, stale)
    num_lent: int = 0  # batches handed out and not yet released (`ReleaseBatch`)


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
        # The groups whose blobs this buffer owns (module docstring), by id(group): arrived (a put
        # waiting for room, or waiting in the policy), and lent (handed out in a batch, by its id).
        self.held: dict[int, Group] = {}
        self.lent: dict[int, list[Group]] = {}
        self.next_batch_id = 1

    async def on_stop(self) -> None:
        self._release([*self.held.values(), *(g for groups in self.lent.values() for g in groups)])
        self.held.clear()
        self.lent.clear()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _release(self, groups: list[Group]) -> None:
        """Free the blobs of groups this buffer owns and no longer needs: the one place it frees."""
        for g in groups:
            self.held.pop(id(g), None)
        self.system.dataplane.free(blobs(s for g in groups for s in g.samples))

    async def _tell_dropped(self, prompt_ids: list[int], retry: bool, reason: str) -> None:
        if prompt_ids:
            self.dropped[reason] = self.dropped.get(reason, 0) + len(prompt_ids)
            if self.scheduler is None:
                self.scheduler = await self.system.lookup(self.scheduler_name, timeout_s=60.0)
            await self.scheduler.tell(GroupsDropped(prompt_ids=prompt_ids, retry=retry, reason=reason))

    @handler(concurrent=True)
    async def put(self, msg: PutGroup) -> PutReply:
        self.held[id(msg.group)] = msg.group  # its blobs are this buffer's from here
        while True:
            try:
                decision = self.policy.put(msg.group, now=self.clock.now())
            except ValueError:  # a malformed group (the error goes back to the put): never kept
                self._release([msg.group])
                raise
            if decision.status != "full":
                break
            await self.changed.wait()  # backpressure: answered once a get makes room
        if decision.status == "dropped":
            self._release([msg.group])
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
            self._release(drawn.stale)
            await self._tell_dropped(drawn.retry, True, "stale")
            await self._tell_dropped(drawn.discarded, False, "stale")
            if drawn.groups:
                self._notify()
                batch_id, self.next_batch_id = self.next_batch_id, self.next_batch_id + 1
                for g in drawn.groups:
                    self.held.pop(id(g), None)
                self.lent[batch_id] = drawn.groups
                return Batch(groups=drawn.groups, metrics=drawn.metrics, waited_s=self.clock.now() - start,
                             batch_id=batch_id)
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
    async def release(self, msg: ReleaseBatch) -> None:
        groups = self.lent.pop(msg.batch_id, None)
        if groups is None:  # released already (or never lent): its blobs are not freed twice
            log.debug("batch %d is not lent (released twice?): nothing freed", msg.batch_id)
            return
        self._release(groups)

    @handler
    async def stats(self, msg: BufferStats) -> BufferState:
        return BufferState(num_groups=self.policy.num_groups, dropped=dict(self.dropped), num_lent=len(self.lent))
