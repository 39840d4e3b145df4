"""The buffer's decisions: which finished groups to keep, which to drop, which to hand the trainer.

`BufferPolicy` is pure: the buffer actor passes it groups and `clock.now()`, and acts on what it
returns. Bounded: it holds at most `capacity_groups` groups. When full, `put` takes nothing and
answers "full"; the actor then blocks the producer (it stops acknowledging finished groups; admission
control still bounds the groups pending) until a `get` makes room. Nothing is evicted to make room.

    policy = BufferPolicy(BufferConfig(capacity_groups=8, max_staleness=1))
    policy.put(group, now=clock.now())            # PutDecision(status="accepted")
    drawn = policy.get(2, trainer_version=3, now=clock.now())
    drawn.groups, drawn.retry, drawn.discarded, drawn.metrics

Drops and their reasons: "aborted" (a sample was aborted: `on_abort` says retry or discard),
"filtered" (the `filter` removed it, e.g. all rewards equal, so no advantage signal: always
discarded, never retried, since generating it again would most likely give the same) and "stale"
(drawn at a trainer version more than `max_staleness` past its oldest engine call, see
`staleness.py`: `on_stale` says retry or discard). A retried prompt goes back to the refill
scheduler, which counts it as a new admission.
"""

from __future__ import annotations

import statistics
from typing import Literal

import msgspec

from miles_async.policies.staleness import group_staleness
from miles_async.trajectory import Trajectory

DropReason = Literal["aborted", "filtered", "stale"]
DROP_REASONS: tuple[DropReason, ...] = ("aborted", "filtered", "stale")


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """The n samples of one prompt, trained together (their advantages are relative to each other)."""

    prompt_id: int
    samples: tuple[Trajectory, ...]  # their metadata is all the policies read; the arrays stay in the data plane
    attempt: int = 0

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"Group {self.prompt_id} has no samples; a group holds the n samples of one prompt")
        strays = [s.prompt_id for s in self.samples if s.prompt_id != self.prompt_id]
        if strays:
            raise ValueError(f"Group {self.prompt_id} holds samples of other prompts: {strays}")

    def staleness(self, trainer_version: int) -> int:
        return group_staleness((s.weight_versions for s in self.samples), trainer_version)

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)


class BufferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """capacity_groups: most groups held; `put` answers "full" past it (the actor blocks producers).
    max_staleness: a group drawn at trainer version v with `v - oldest version > max_staleness` is
        dropped as "stale" (0: synchronous, 1: one-step-off, k: fully asynchronous).
    on_stale / on_abort: what becomes of a stale / aborted group's prompt: generated again or dropped.
    filter: "nonzero_std" drops groups whose rewards are all equal (no learning signal; unscored
        samples do not count, so a group with fewer than two scored ones goes too); "none" keeps all.
    """

    capacity_groups: int = 64  # groups held at most; producers wait while it is full
    max_staleness: int = 1
    on_stale: Literal["retry", "discard"] = "retry"  # a stale group's prompt: generated again, or dropped
    on_abort: Literal["retry", "discard"] = "retry"  # an aborted group's prompt: generated again, or dropped
    # "nonzero_std": drop groups whose scored rewards are all equal (no signal; fewer than two scored
    # samples counts as equal); "none": keep every group
    filter: Literal["nonzero_std", "none"] = "nonzero_std"

    def __post_init__(self) -> None:
        if self.capacity_groups < 1:
            raise ValueError(f"BufferConfig.capacity_groups must be >= 1, got {self.capacity_groups}")
        if self.max_staleness < 0:
            raise ValueError(f"BufferConfig.max_staleness must be >= 0 (0 is synchronous), got {self.max_staleness}")
        for field in ("on_stale", "on_abort"):
            if getattr(self, field) not in ("retry", "discard"):
                raise ValueError(f"BufferConfig.{field} must be 'retry' or 'discard', got {getattr(self, field)!r}")
        if self.filter not in ("nonzero_std", "none"):
            raise ValueError(f"BufferConfig.filter must be 'nonzero_std' or 'none', got {self.filter!r}")


class PutDecision(msgspec.Struct, frozen=True, kw_only=True):
    """accepted: held for a batch. dropped: not held (`reason`; `retry` says whether to generate the
    prompt again). full: not held; the caller keeps the group and offers it again after a `get`."""

    status: Literal["accepted", "dropped", "full"]
    reason: DropReason | None = None
    retry: bool = False


class BufferMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """One train step's view of the buffer; drop counts are those since the previous `get`."""

    trainer_version: int
    num_drawn: int
    drawn_staleness_mean: float
    drawn_staleness_max: int
    waiting_staleness_mean: float
    waiting_staleness_max: int
    drawn_wait_s_mean: float
    drawn_wait_s_max: float
    num_dropped: dict[str, int]
    num_full_refusals: int
    num_waiting: int
    occupancy: float


class Drawn(msgspec.Struct, frozen=True, kw_only=True):
    """groups: the batch (oldest first), empty when fewer than asked were admissible and the caller
    did not allow a partial batch. retry / discarded: prompt ids of the groups dropped as stale;
    stale: those groups (the caller releases what they hold)."""

    groups: list[Group]
    retry: list[int]
    discarded: list[int]
    metrics: BufferMetrics
    stale: list[Group] = []


class _Entry(msgspec.Struct, kw_only=True):
    group: Group
    put_at: float
    seq: int
    oldest: int  # the group's oldest version, computed once: `get` scans every entry each call

    def staleness(self, trainer_version: int) -> int:
        if self.oldest > trainer_version:  # what `staleness.sample_staleness` refuses, at the cost of one compare
            return self.group.staleness(trainer_version)
        return trainer_version - self.oldest


class BufferPolicy:
    """Holds finished groups; see the module docstring for what it keeps, drops and hands out."""

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self._entries: list[_Entry] = []
        self._seq = 0
        self._num_dropped = dict.fromkeys(DROP_REASONS, 0)
        self._num_full_refusals = 0

    @property
    def num_groups(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.config.capacity_groups

    def put(self, group: Group, now: float) -> PutDecision:
        """Take a finished group, drop it (aborted or filtered: those never take room), or answer "full"."""
        if any(s.aborted for s in group.samples):
            self._num_dropped["aborted"] += 1
            return PutDecision(status="dropped", reason="aborted", retry=self.config.on_abort == "retry")
        if self.config.filter == "nonzero_std" and len({s.reward for s in group.samples if s.scored}) <= 1:
            self._num_dropped["filtered"] += 1
            return PutDecision(status="dropped", reason="filtered", retry=False)
        if self.full:
            self._num_full_refusals += 1
            return PutDecision(status="full")
        if not all(s.versions for s in group.samples):
            raise ValueError(f"group {group.prompt_id}: a sample has no recorded engine version; record the engine's "
                             "weight version with every engine call")
        self._entries.append(_Entry(group=group, put_at=now, seq=self._seq, oldest=group.oldest_version))
        self._seq += 1
        return PutDecision(status="accepted")

    def get(self, batch_groups: int, trainer_version: int, now: float, *, allow_partial: bool = False) -> Drawn:
        """Drop every stale group, then draw the `batch_groups` oldest (by oldest version, then arrival).

        With fewer admissible groups than asked, nothing is drawn unless `allow_partial`; the stale
        ones are dropped either way, so their prompts can be generated again at once.
        """
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        retry: list[int] = []
        discarded: list[int] = []
        stale: list[Group] = []
        fresh: list[_Entry] = []
        for entry in self._entries:
            if entry.staleness(trainer_version) > self.config.max_staleness:
                self._num_dropped["stale"] += 1
                stale.append(entry.group)
                (retry if self.config.on_stale == "retry" else discarded).append(entry.group.prompt_id)
            else:
                fresh.append(entry)
        fresh.sort(key=lambda e: (e.oldest, e.seq))
        take = batch_groups if len(fresh) >= batch_groups or allow_partial else 0
        drawn, self._entries = fresh[:take], fresh[take:]
        self._entries.sort(key=lambda e: e.seq)
        metrics = self._metrics(drawn, trainer_version, now)
        return Drawn(groups=[e.group for e in drawn], retry=retry, discarded=discarded, metrics=metrics, stale=stale)

    def _metrics(self, drawn: list[_Entry], trainer_version: int, now: float) -> BufferMetrics:
        drawn_staleness = [e.staleness(trainer_version) for e in drawn]
        waiting_staleness = [e.staleness(trainer_version) for e in self._entries]
        waits_s = [now - e.put_at for e in drawn]
        metrics = BufferMetrics(
            trainer_version=trainer_version,
            num_drawn=len(drawn),
            drawn_staleness_mean=_mean(drawn_staleness),
            drawn_staleness_max=max(drawn_staleness, default=0),
            waiting_staleness_mean=_mean(waiting_staleness),
            waiting_staleness_max=max(waiting_staleness, default=0),
            drawn_wait_s_mean=_mean(waits_s),
            drawn_wait_s_max=max(waits_s, default=0.0),
            num_dropped={reason: count for reason, count in self._num_dropped.items()},
            num_full_refusals=self._num_full_refusals,
            num_waiting=len(self._entries),
            occupancy=len(self._entries) / self.config.capacity_groups,
        )
        self._num_dropped = dict.fromkeys(DROP_REASONS, 0)
        self._num_full_refusals = 0
        return metrics


def _mean(values: list[int] | list[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0
