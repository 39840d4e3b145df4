"""Restart policies: what an owner does when an actor it owns dies.

The decision is a pure function of the policy and the times of recent restarts, so it can be
tested (and simulated) without a clock: `policy.next_delay(restart_times, now)` returns the
backoff before the next restart, or None to give up.
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
