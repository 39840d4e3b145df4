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
