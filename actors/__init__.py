"""The RL roles as actors (installed as `miles_async.actors`).

This folder will hold the rollout worker, the refill scheduler, the buffer, the trainer rank, the
weight pusher, the evaluator, the router and the controller that wires them together (DESIGN.md,
"The RL loop"). None of them is written yet.
"""
