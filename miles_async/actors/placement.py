"""The recipe's `[placement]`: which node runs each of the run's processes (miles_async/actors/fleet.py starts them).

It lives apart from the fleet, which reads the whole run's config (`actors.recipe.RunConfig`), so
that the recipe can hold this section without importing the fleet.

Try it: `PlacementConfig(engines=[0, 1], trainer=[0, 1]).trainer_nodes(2)`.
"""

from __future__ import annotations

import msgspec


class PlacementConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which node runs what, in a multi-node run (`miles-async launch`; `run` is one node: all 0).

    engines: the node rank of each engine, in order (cycled when shorter than rollout.num_engines;
        [] puts every engine on the controller's node, 0).
    trainer: the node of every trainer rank (one number), or of each rank in order (a list of
        trainer.world_size numbers: ranks spanning nodes). Trainer ranks off node 0 write
        checkpoints and weight exports that node 0 reads: the run folder must be on a filesystem
        those nodes share (checked when the ranks start).
    scheduler, buffer, sessions: the node of the refill scheduler, of the buffer and of the TITO
        session server (agent runs); each a process of its own off node 0, in the controller's
        process on node 0.
    The controller, rollout workers and weight pusher run on node 0.
    """

    engines: list[int] = []  # node rank of each engine, in order, cycled; []: all on node 0
    trainer: int | list[int] = 0  # node of every trainer rank, or a list of one node per rank
    scheduler: int = 0  # node of the refill scheduler (a process of its own off node 0)
    buffer: int = 0  # node of the buffer (a process of its own off node 0)
    sessions: int = 0  # node of the TITO session server of agent runs (a process of its own off node 0)

    def __post_init__(self) -> None:
        trainer = self.trainer if isinstance(self.trainer, list) else [self.trainer]
        if any(n < 0 for n in (*self.engines, *trainer, self.scheduler, self.buffer, self.sessions)) or not trainer:
            raise ValueError(f"placement node ranks must be >= 0, got engines={self.engines} trainer={self.trainer} "
                             f"scheduler={self.scheduler} buffer={self.buffer} sessions={self.sessions}")

    def engine_node(self, index: int) -> int:
        return self.engines[index % len(self.engines)] if self.engines else 0

    def trainer_nodes(self, world_size: int) -> list[int]:
        """The node of each trainer rank."""
        if isinstance(self.trainer, int):
            return [self.trainer] * world_size
        if len(self.trainer) != world_size:
            raise ValueError(f"placement.trainer lists {len(self.trainer)} node(s) but trainer.world_size is "
                             f"{world_size}: give one node per rank, or one number for all")
        return list(self.trainer)

    @property
    def nodes(self) -> set[int]:
        trainer = self.trainer if isinstance(self.trainer, list) else [self.trainer]
        return {0, *trainer, *self.engines, self.scheduler, self.buffer, self.sessions}
