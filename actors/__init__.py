"""The RL roles as actors (installed as `miles_async.actors`).

This folder holds the rollout worker, the refill scheduler, the buffer, the trainer rank, the
weight pusher, the evaluator, the router and the controller that wires them together (DESIGN.md,
"The RL loop"). Written so far: `trainer.TrainerRank` (one FSDP2 rank per process),
`trainer.TrainerGroup` (spawns and addresses the ranks of one process group),
`engine.EngineActor` (an embedded engine, with the engine's side of weight updates) and
`weights.WeightPusher` (pushes each version to the engines over the recipe's transport).
"""
