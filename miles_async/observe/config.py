"""The recipe's `[observe]`: where a run's metrics and samples go besides metrics.jsonl.

    [observe]
    wandb = true                  # needs `pip install 'miles-async[wandb]'`; WANDB_MODE=offline: no network
    wandb_project = "gsm8k"
    wandb_tags = ["qwen3", "async"]
    tensorboard = true            # RUN_DIR/tensorboard/; needs `pip install 'miles-async[tensorboard]'`
    log_samples = 4               # 4 decoded samples per RL step to RUN_DIR/samples.jsonl and the trackers

The same section in an RL recipe (`miles-async run`) and an SFT recipe (`miles-async sft`; there
`log_samples` must stay 0: SFT generates nothing). wandb reads its key from WANDB_API_KEY (or
`wandb login`): never from the recipe.
"""

from __future__ import annotations

import importlib.util

import msgspec

__all__ = ["ObserveConfig"]


class ObserveConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[observe]` (module docstring)."""

    wandb: bool = False  # log every metrics row (and the samples) to Weights & Biases
    wandb_project: str = "miles-async"  # the Weights & Biases project the run is logged to
    wandb_name: str = ""  # the run's display name ("": the run folder's name)
    wandb_entity: str = ""  # the team or user ("": wandb's default for the key)
    wandb_tags: list[str] = []  # tags of the wandb run
    tensorboard: bool = False  # mirror the metrics (and the samples, as text) to RUN_DIR/tensorboard/
    log_samples: int = 0  # decoded samples per RL step to RUN_DIR/samples.jsonl and the trackers' tables

    def __post_init__(self) -> None:
        if self.log_samples < 0:
            raise ValueError(f"observe.log_samples must be >= 0 (samples per step), got {self.log_samples}")
        if self.wandb and not self.wandb_project:
            raise ValueError('observe.wandb = true needs observe.wandb_project (e.g. "miles-async")')
        # Said when the recipe is read, before a run starts or writes anything.
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("observe.wandb = true needs the wandb package: pip install 'miles-async[wandb]'")
