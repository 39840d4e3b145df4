"""The RL roles as actors (installed as `miles_async.actors`).

This folder holds the rollout worker, the refill scheduler, the buffer, the trainer rank, the
weight pusher, the evaluator, the router and the controller that wires them together (docs/design.md,
"The RL loop"). Written so far: the loop's actors, `scheduler.RefillScheduler` (sample-level
or group-level refill with admission control), `rollout.RolloutWorker` (generate and score one sample),
`buffer.Buffer` (bounded, filters and staleness), `trainer.TrainerRank` / `trainer.TrainerGroup`
(FSDP2 ranks, one process each), `engine.EngineActor` (an embedded engine and its side of weight
updates), `weights.WeightPusher` (each version to the engines over the recipe's transport); the
controller that wires them (`controller.Controller`, `miles-async run`) and the recipe format
(`recipe.load_recipe`).
"""

# What the fork server of a run's child processes imports (RuntimeConfig.preload): the modules of
# the actors that run in processes (engines, trainer ranks), torch first, and what a trainer rank
# imports at its first shard and checkpoint (FSDP2, DTensor and torch.distributed.checkpoint: the
# command's own process never needs them). Here rather than in
# controller.py so that the command line can start the server before it imports the controller
# (runtime/child.py, start_fork_server).
PRELOAD = ("torch", "miles_async.actors.engine", "miles_async.actors.trainer", "torch.distributed.fsdp",
           "torch.distributed.checkpoint")
