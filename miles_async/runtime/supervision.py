"""Restart policies: what an owner does when an actor it owns dies.

The decision is a pure function of the policy and the times of recent restarts, so it can be
tested (and simulated) without a clock: `policy.next_delay(restart_times, now)` returns the
backoff before the next restart, or None to give up. `RestartBudget` keeps those restart times
for several actors, for an owner that restarts them itself (the run's engines: miles_async/actors/liveness.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """`never` (the default): a crashed actor stays dead and callers get `ActorDeadError`.
    `on_failure`: restart it, at most `max_restarts` times within `within_s` seconds, after an
    exponential backoff (`backoff_s` * `backoff_factor` ** recent restarts, capped at
    `max_backoff_s`). Past the limit it stays dead; with `escalate`, its owner then crashes too.
    A graceful stop never restarts.
    """

    mode: Literal["never", "on_failure"] = "never"
    max_restarts: int = 3
    within_s: float = 60.0
    backoff_s: float = 0.1
    backoff_factor: float = 2.0
    max_backoff_s: float = 10.0
    escalate: bool = False

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 0, got {self.max_restarts}")
        if self.within_s <= 0 or self.backoff_s < 0 or self.backoff_factor < 1 or self.max_backoff_s < 0:
            raise ValueError(f"RestartPolicy has a bad window or backoff: {self!r}")

    def next_delay(self, restart_times: Sequence[float], now: float) -> float | None:
        """Seconds to wait before restarting, or None to leave the actor dead."""
        if self.mode == "never":
            return None
        recent = sum(1 for t in restart_times if now - t < self.within_s)
        if recent >= self.max_restarts:
            return None
        return min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** recent)


class RestartBudget:
    """The restarts of several actors (by name) under one `RestartPolicy`, for an owner that
    restarts them itself (e.g. the run's engines, which must get weights before they serve).
    Pure: the caller gives the time.

        budget = RestartBudget(RestartPolicy(mode="on_failure", max_restarts=3, within_s=600, backoff_s=1))
        budget.next_delay("engine-0", now=0.0)  # 1.0: restart after 1 s (counted from now)
        budget.next_delay("engine-0", now=5.0)  # 2.0; then 4.0; then None (given up) until 600 s pass
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restart_times: dict[str, list[float]] = {}

    def next_delay(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting `name` (the restart is then counted), or None to leave it dead."""
        times = self.restart_times.setdefault(name, [])
        delay = self.policy.next_delay(times, now)
        if delay is not None:
            times[:] = [t for t in times if now - t < self.policy.within_s]  # older ones no longer count
            times.append(now)
        return delay

    def recent(self, name: str, now: float) -> int:
        """How many restarts of `name` fall within the policy's window."""
        return sum(1 for t in self.restart_times.get(name, ()) if now - t < self.policy.within_s)
