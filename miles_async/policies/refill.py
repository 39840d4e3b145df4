"""Refill: what to generate next, and on which engine.

The refill scheduler keeps `target_in_flight` samples generating. A new weight version, a trained
step or a dropped group may let admission open, and a finished sample may free slots; free slots
are refilled in the same call. A prompt is admitted as a group (its n samples) only if
`staleness.admissible` says so, so generation never runs more than `max_staleness` versions ahead
of training; its samples are then issued one slot at a time, each to the least loaded engine
(ties: the engine added first).

When a finished sample frees its slot is `RefillConfig.refill`:

- "sample" (the default): at once, so the slot is refilled in the same call. A group's long-tailed
  sample then holds only its own slot while its finished siblings' slots go on generating.
- "group": a finished sample keeps its slot (it counts in `num_in_flight` and in its engine's load)
  until the last sample of its group finishes; then all n slots are freed and refilled together.
  Engines see whole groups come and go, at the cost of slots sitting idle behind a group's slowest
  sample. A removed engine's finished-but-held samples are done (not reissued); their slots go
  with the engine at once, so a group never holds more than n slots.

    policy = RefillPolicy(RefillConfig(target_in_flight=32, group_size=8, batch_groups=4))
    submits = policy.add_engine("e0", version=0, now=clock.now())   # [Submit(...), ...]
    submits = policy.on_sample_done(request_id, now=clock.now())    # the freed slot(s), refilled
    submits = policy.on_trainer_step(1, trained_prompt_ids, now=...) # those groups leave the count
    submits = policy.on_groups_dropped([7], retry=True, now=...)     # the buffer dropped prompt 7

Pure and deterministic: the same events give the same submissions. Prompt ids are dataset
positions handed out in order (`max_prompts` ends the dataset); a retried prompt keeps its id
and gets `attempt + 1`. A group counts as pending (see `staleness.py`) from its admission until
the trainer reports it trained or the buffer reports it dropped. Bounded: admission caps pending
groups at `(max_staleness + 1) * batch_groups`, which caps every queue here. Cheap at scale
(hundreds of engines, as the simulator drives it): picking the engine is O(log E) amortized and
the oldest engine version a min over the few distinct versions.

What admission does not promise: groups finish out of order, so a slow group can be overtaken by
later ones and be trained later than its place in line; it may then be stale when drawn, and the
buffer's check at `get` (the same formula) drops it (retry or discard). `admission_idle_s` in the
scheduler's state is the time the engines sat idle because admission refused every prompt.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from typing import Literal

import msgspec

from miles_async.policies.staleness import admissible


class RefillConfig(msgspec.Struct, frozen=True, kw_only=True):
    """target_in_flight: samples generating at once, over all engines.
    group_size: n, samples per prompt. batch_groups: groups per train step.
    max_staleness: how many versions generation may run ahead (0: synchronous).
    max_prompts: prompts in the dataset (None: endless); ids run 0 .. max_prompts - 1.
    max_in_flight_per_engine: most samples one engine generates at once (None: no cap but the target).
    refill: when a finished sample frees its slot: "sample" at once, "group" when its whole group
    has finished (see the module docstring).
    """

    target_in_flight: int = 64  # samples generating at once, over all engines
    group_size: int = 8  # samples per prompt (a group: its rewards are compared with each other)
    batch_groups: int = 8
    max_staleness: int = 1
    max_prompts: int | None = None  # prompts admitted in all (ids 0 .. max_prompts - 1); unset: endless
    max_in_flight_per_engine: int | None = None  # samples one engine generates at once at most; unset: no cap
    # When a finished sample's slot is refilled: "sample" at once, "group" once its whole group is done
    refill: Literal["sample", "group"] = "sample"

    def __post_init__(self) -> None:
        for field in ("target_in_flight", "group_size", "batch_groups"):
            if getattr(self, field) < 1:
                raise ValueError(f"RefillConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.max_staleness < 0:
            raise ValueError(f"RefillConfig.max_staleness must be >= 0 (0 is synchronous), got {self.max_staleness}")
        if self.max_prompts is not None and self.max_prompts < 0:
            raise ValueError(f"RefillConfig.max_prompts must be >= 0 or None, got {self.max_prompts}")
        if self.max_in_flight_per_engine is not None and self.max_in_flight_per_engine < 1:
            raise ValueError("RefillConfig.max_in_flight_per_engine must be >= 1 or None, got "
                             f"{self.max_in_flight_per_engine}")
        if self.refill not in ("sample", "group"):
            raise ValueError(f"RefillConfig.refill must be 'sample' or 'group', got {self.refill!r}")


class Submit(msgspec.Struct, frozen=True, kw_only=True):
    """Generate sample `index` of prompt `prompt_id` on `engine`; `request_id` names this request."""

    request_id: int
    prompt_id: int
    index: int
    attempt: int
    engine: str


class EngineRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """lost_request_ids: the removed engine's requests (their late replies must be ignored).
    submit: their samples, issued again on the other engines (and any refill)."""

    lost_request_ids: list[int]
    submit: list[Submit]


class RefillMetrics(msgspec.Struct, frozen=True, kw_only=True):
    trainer_version: int
    policy_version: int | None
    num_in_flight: int
    in_flight_per_engine: dict[str, int]
    num_pending_groups: int
    num_queued_samples: int
    num_retry_prompts: int
    admission_idle_s: float


class _Request(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: int
    index: int
    attempt: int
    engine: str


class RefillPolicy:
    """See the module docstring. Every event method returns the submissions to make now."""

    def __init__(self, config: RefillConfig, *, trainer_version: int = 0, first_prompt_id: int = 0,
                 retry_prompt_ids: Iterable[int] = ()) -> None:
        """`first_prompt_id`: the first new prompt; `retry_prompt_ids`: earlier prompts to generate
        first (a resumed run's prompts that were admitted and not yet trained or discarded)."""
        retry = list(retry_prompt_ids)
        if trainer_version < 0 or first_prompt_id < 0 or any(p < 0 or p >= first_prompt_id for p in retry):
            raise ValueError(f"need trainer_version >= 0, first_prompt_id >= 0 and retry prompts in "
                             f"[0, first_prompt_id), got {trainer_version}, {first_prompt_id} and {retry}")
        self.config = config
        self.trainer_version = trainer_version
        self._next_prompt_id = first_prompt_id
        self._next_request_id = 0
        self._engine_version: dict[str, int] = {}
        # Engines per version: the oldest is the min over a few distinct versions, not over all
        # engines (admission asks for it on every refill that admits).
        self._version_count: Counter[int] = Counter()
        self._engine_load: dict[str, set[int]] = {}  # its requests generating (and, in group mode, held)
        self._engine_rank: dict[str, int] = {}  # engine -> when it was added: ties go to the lowest
        self._next_rank = 0
        # Min-heap of (load, rank, engine), so the least loaded engine is found in O(log E) amortized
        # instead of a scan over hundreds of engines per submit. Every load change pushes the engine's
        # new entry and leaves the old one behind; an entry that no longer matches (its load changed,
        # or its engine was removed or added again under a new rank) is dropped when it reaches the
        # top, and the heap is rebuilt once it holds more than twice the engines (see `_push_load`).
        self._load_heap: list[tuple[int, int, str]] = []
        self._in_flight: dict[int, _Request] = {}  # requests not reported yet
        # Group mode: finished requests whose slots stay taken until their group's last sample is
        # done, by prompt id (one attempt of a prompt generates at a time) and by request id.
        self._held: dict[int, list[int]] = {}
        self._held_requests: dict[int, _Request] = {}
        self._queue: deque[tuple[int, int, int]] = deque()  # admitted samples awaiting a slot
        self._generating: dict[int, list[int]] = {}  # prompt_id -> [attempt, samples done]
        self._generated: dict[int, int] = {}  # prompt_id -> attempt: waiting to be trained or dropped
        self._retry: deque[tuple[int, int]] = deque((p, 0) for p in dict.fromkeys(retry))
        self._idle_since: float | None = None
        self._idle_s = 0.0

    # -- state ---------------------------------------------------------------------------------

    @property
    def retry_prompt_ids(self) -> list[int]:
        """Prompts waiting to be generated again (not admitted yet)."""
        return [prompt_id for prompt_id, _ in self._retry]

    @property
    def num_in_flight(self) -> int:
        """Slots taken: requests generating, plus (group mode) finished ones held for their group."""
        return len(self._in_flight) + len(self._held_requests)

    @property
    def num_pending_groups(self) -> int:
        return len(self._generating) + len(self._generated)

    @property
    def policy_version(self) -> int | None:
        """The oldest live engine's version: what a group admitted now may be generated at."""
        return min(self._version_count, default=None)

    @property
    def next_prompt_id(self) -> int:
        """The next new dataset position admission will hand out."""
        return self._next_prompt_id

    @property
    def exhausted(self) -> bool:
        """The dataset is used up and nothing is pending or waiting for a retry."""
        out_of_prompts = self.config.max_prompts is not None and self._next_prompt_id >= self.config.max_prompts
        return out_of_prompts and not self._retry and self.num_pending_groups == 0

    def owns(self, request_id: int) -> bool:
        """Whether a reply for `request_id` counts (False once reported, or for a removed engine's)."""
        return request_id in self._in_flight

    def metrics(self, now: float) -> RefillMetrics:
        idle_s = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return RefillMetrics(
            trainer_version=self.trainer_version, policy_version=self.policy_version,
            num_in_flight=self.num_in_flight,
            in_flight_per_engine={name: len(load) for name, load in self._engine_load.items()},
            num_pending_groups=self.num_pending_groups, num_queued_samples=len(self._queue),
            num_retry_prompts=len(self._retry), admission_idle_s=idle_s)

    # -- events --------------------------------------------------------------------------------

    def add_engine(self, engine: str, version: int, now: float) -> list[Submit]:
        if engine in self._engine_version:
            raise ValueError(f"engine {engine!r} is already known; remove it before adding it again")
        self._check_version(engine, version)
        self._set_version(engine, version)
        self._engine_load[engine] = set()
        self._engine_rank[engine] = self._next_rank
        self._next_rank += 1
        self._push_load(engine)
        return self.refill(now)

    def remove_engine(self, engine: str, now: float) -> EngineRemoved:
        """Forget a dead or removed engine; its in-flight samples go first in line on the others."""
        if engine not in self._engine_version:
            raise ValueError(f"engine {engine!r} is not known (known: {sorted(self._engine_version)})")
        self._set_version(engine, None)
        del self._engine_rank[engine]  # its heap entries no longer match: dropped when they surface
        taken = self._engine_load.pop(engine)
        lost = sorted(r for r in taken if r in self._in_flight)
        # Group mode: its finished-but-held samples are done, so they are not issued again; their
        # slots go with the engine now (the group's lost samples take new slots on the others, so a
        # group never holds more than n slots, and nothing is left to free when it completes).
        for request_id in sorted(taken.difference(lost)):
            prompt_id = self._held_requests.pop(request_id).prompt_id
            self._held[prompt_id].remove(request_id)
            if not self._held[prompt_id]:
                del self._held[prompt_id]
        requests = [self._in_flight.pop(request_id) for request_id in lost]
        self._queue.extendleft((r.prompt_id, r.index, r.attempt) for r in reversed(requests))
        return EngineRemoved(lost_request_ids=lost, submit=self.refill(now))

    def on_weight_version(self, engine: str, version: int, now: float) -> list[Submit]:
        """An engine now generates with `version` (admission may open)."""
        if engine not in self._engine_version:
            raise ValueError(f"engine {engine!r} is not known; add_engine it first")
        if version < self._engine_version[engine]:
            raise ValueError(f"engine {engine!r} went back from version {self._engine_version[engine]} to {version}")
        self._check_version(engine, version)
        self._set_version(engine, version)
        return self.refill(now)

    def on_sample_done(self, request_id: int, now: float) -> list[Submit]:
        """A sample finished (whatever its outcome): the slots it frees are refilled in this call
        (its own; in group mode, none until the group's last sample, then the whole group's)."""
        request = self._in_flight.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id} is not in flight (reported twice, or its engine was "
                             "removed); check owns(request_id) before reporting a reply")
        state = self._generating[request.prompt_id]
        state[1] += 1
        if self.config.refill == "group" and state[1] < self.config.group_size:
            self._held.setdefault(request.prompt_id, []).append(request_id)
            self._held_requests[request_id] = request
        else:
            self._free(request_id, request)
            for held_id in self._held.pop(request.prompt_id, []):  # group mode: the rest of the group
                self._free(held_id, self._held_requests.pop(held_id))
        if state[1] == self.config.group_size:
            del self._generating[request.prompt_id]
            self._generated[request.prompt_id] = state[0]
        return self.refill(now)

    def on_trainer_step(self, trainer_version: int, trained_prompt_ids: list[int], now: float) -> list[Submit]:
        """The trainer finished a step on these groups and now holds `trainer_version`."""
        if trainer_version < self.trainer_version:
            raise ValueError(f"trainer version went back from {self.trainer_version} to {trainer_version}")
        self._release(trained_prompt_ids)
        self.trainer_version = trainer_version
        return self.refill(now)

    def on_groups_dropped(self, prompt_ids: list[int], *, retry: bool, now: float) -> list[Submit]:
        """The buffer dropped these generated groups; with `retry` they are generated again, first."""
        attempts = self._release(prompt_ids)
        if retry:
            self._retry.extend(zip(prompt_ids, (a + 1 for a in attempts)))
        return self.refill(now)

    def refill(self, now: float) -> list[Submit]:
        """Fill free slots: queued samples first, then newly admitted groups (retries before new prompts)."""
        submits: list[Submit] = []
        blocked = False
        while (engine := self._least_loaded()) is not None and self.num_in_flight < self.config.target_in_flight:
            if not self._queue and not self._admit_one():
                blocked = self._has_prompts()
                break
            prompt_id, index, attempt = self._queue.popleft()
            submits.append(self._issue(engine, prompt_id, index, attempt))
        self._track_idle(blocked and not self._in_flight, now)
        return submits

    # -- internals -----------------------------------------------------------------------------

    def _has_prompts(self) -> bool:
        return bool(self._retry) or self.config.max_prompts is None or self._next_prompt_id < self.config.max_prompts

    def _admit_one(self) -> bool:
        version = self.policy_version
        if version is None or not self._has_prompts():
            return False
        if not admissible(self.trainer_version, version, self.config.max_staleness,
                          batch_groups=self.config.batch_groups, num_pending_groups=self.num_pending_groups):
            return False
        if self._retry:
            prompt_id, attempt = self._retry.popleft()
        else:
            prompt_id, attempt = self._next_prompt_id, 0
            self._next_prompt_id += 1
        self._generating[prompt_id] = [attempt, 0]
        self._queue.extend((prompt_id, index, attempt) for index in range(self.config.group_size))
        return True

    def _least_loaded(self) -> str | None:
        """The engine with the fewest samples in flight (ties: added first), None when all are full."""
        heap, cap = self._load_heap, self.config.max_in_flight_per_engine
        while heap:
            load, rank, name = heap[0]
            if self._engine_rank.get(name) == rank and len(self._engine_load[name]) == load:
                # Every engine has an entry for its current load, so the top matching one is the
                # least loaded (lowest rank among equals); if it is full, every engine is.
                return name if cap is None or load < cap else None
            heapq.heappop(heap)  # outdated: the engine's load changed, or it was removed
        return None

    def _push_load(self, engine: str) -> None:
        """Record `engine`'s new load in the heap (call after every change of its load)."""
        heapq.heappush(self._load_heap, (len(self._engine_load[engine]), self._engine_rank[engine], engine))
        # Outdated entries of loads above the minimum only surface late; rebuilding once they
        # outnumber the engines keeps the heap O(E) at O(1) amortized cost per push.
        if len(self._load_heap) > 2 * len(self._engine_load) + 16:
            self._load_heap = [(len(load), self._engine_rank[name], name) for name, load in self._engine_load.items()]
            heapq.heapify(self._load_heap)

    def _free(self, request_id: int, request: _Request) -> None:
        self._engine_load[request.engine].remove(request_id)
        self._push_load(request.engine)

    def _issue(self, engine: str, prompt_id: int, index: int, attempt: int) -> Submit:
        request_id = self._next_request_id
        self._next_request_id += 1
        self._in_flight[request_id] = _Request(prompt_id=prompt_id, index=index, attempt=attempt, engine=engine)
        self._engine_load[engine].add(request_id)
        self._push_load(engine)
        return Submit(request_id=request_id, prompt_id=prompt_id, index=index, attempt=attempt, engine=engine)

    def _release(self, prompt_ids: list[int]) -> list[int]:
        unknown = [p for p in prompt_ids if p not in self._generated]
        if unknown or len(set(prompt_ids)) != len(prompt_ids):
            raise ValueError(f"prompts {unknown or prompt_ids} are not generated groups awaiting training "
                             "(unknown, still generating, repeated, or already released)")
        return [self._generated.pop(p) for p in prompt_ids]

    def _set_version(self, engine: str, version: int | None) -> None:
        """Set (None: forget) `engine`'s version, keeping `_version_count` in step."""
        old = self._engine_version.get(engine)
        if old is not None:
            self._version_count[old] -= 1
            if not self._version_count[old]:
                del self._version_count[old]
        if version is None:
            self._engine_version.pop(engine, None)
        else:
            self._engine_version[engine] = version
            self._version_count[version] += 1

    def _check_version(self, engine: str, version: int) -> None:
        if not 0 <= version <= self.trainer_version:
            raise ValueError(f"engine {engine!r} version {version} is outside 0..trainer_version="
                             f"{self.trainer_version}: engines only hold weights the trainer made")

    def _track_idle(self, idle: bool, now: float) -> None:
        # Time the engines had nothing to do because admission refused every prompt: the bubble
        # that low staleness costs (in sync mode, each train step plus each weight update).
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self._idle_s += now - self._idle_since
            self._idle_since = None
