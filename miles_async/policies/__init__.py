"""The pure policies of the RL loop: data and a time (`clock.now()`) in, decisions out.

`staleness`: the one staleness formula (`v - min(versions)`) and admission control, shared by
the buffer, the refill scheduler and the simulator. `buffer`: which finished groups to keep, drop
(aborted, filtered, stale: retried or discarded) or hand to the trainer, bounded, with per-step
metrics. `refill`: sample- (or group-) level refill, which prompt sample to generate next and on which
engine.
No I/O, no sleeping and no sockets here: the actors wrap these, and `miles_async/sim/` drives them on a
`VirtualClock`.
"""

from miles_async.policies.buffer import (
    BufferConfig,
    BufferMetrics,
    BufferPolicy,
    Drawn,
    Group,
    PutDecision,
)
from miles_async.policies.refill import EngineRemoved, RefillConfig, RefillMetrics, RefillPolicy, Submit
from miles_async.policies.staleness import (
    admissible,
    admission_capacity,
    group_staleness,
    is_stale,
    sample_staleness,
    trained_at_version,
)

__all__ = [
    "BufferConfig", "BufferMetrics", "BufferPolicy", "Drawn", "EngineRemoved", "Group", "PutDecision",
    "RefillConfig", "RefillMetrics", "RefillPolicy", "Submit", "admissible", "admission_capacity",
    "group_staleness", "is_stale", "sample_staleness", "trained_at_version",
]
