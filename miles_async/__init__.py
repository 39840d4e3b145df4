"""miles-async: asynchronous RL post-training of language models on an actor runtime of its own.

Rollout engines generate trajectories, trainer ranks update the policy and new weights flow back
to the engines, all three stages running at once; the actors that do this talk through ZeroMQ
mailboxes carrying msgspec messages under asyncio, with no Ray. See docs/design.md for the map and
README.md for the quick start (`python3 dev.py demo`, `python3 dev.py test`).

This module stays light on purpose: importing `miles_async` must not import torch or ZeroMQ, so
that the command line and the simulator start fast and the pure policies import cleanly.
"""

__version__ = "0.1.0"
