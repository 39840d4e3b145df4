"""`run_state.json`: the RL run's own state, saved in each checkpoint beside the trainer's.

The controller (miles_async/actors/controller.py) writes one into every checkpoint it asks the trainer for,
and reads the latest back on `--resume`: the RL step, the first prompt never admitted, the
prompts admitted and not yet trained (generated again, so no prompt is trained twice nor
skipped), and how long metrics.jsonl, trace.jsonl and samples.jsonl were (a resume cuts them
back to that, `roll_back_logs`). The keys are the file's since the first runs; checkpoints of
older runs read too: one from before `next_new_prompt` held `next_prompt` (the lowest prompt not
trained), and one from before the log lengths leaves the logs as they are.

Try it: `RunState.read(checkpoint.latest(Path(run_dir) / "checkpoints"))`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from miles_async.observe import SAMPLES_FILE, roll_back
from miles_async.trainer import checkpoint

__all__ = ["RUN_STATE_FILE", "RunState", "roll_back_logs"]

log = logging.getLogger("miles_async.actors.controller")

RUN_STATE_FILE = "run_state.json"
LOG_FILES = ("metrics.jsonl", "trace.jsonl", SAMPLES_FILE)  # what a resume cuts back


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    """What `run_state.json` holds (module docstring)."""

    rl_step: int
    next_new_prompt: int | None = None  # the first dataset position never admitted (None: an older checkpoint)
    unfinished: list[int] = msgspec.field(default_factory=list)  # admitted, not yet trained
    # the logs' lengths in bytes when it was taken (None: a checkpoint from before these keys)
    metrics_bytes: int | None = None
    trace_bytes: int | None = None
    samples_bytes: int | None = None
    # read, never written: checkpoints from before next_new_prompt held the lowest prompt not trained
    next_prompt: int | msgspec.UnsetType = msgspec.UNSET

    @property
    def first_prompt(self) -> int:
        """Where admission goes on from on resume."""
        if self.next_new_prompt is not None:
            return self.next_new_prompt
        return self.next_prompt if isinstance(self.next_prompt, int) else 0

    def log_bytes(self) -> dict[str, int | None]:
        """Each log file's name and its length at the checkpoint (None: not recorded)."""
        return dict(zip(LOG_FILES, (self.metrics_bytes, self.trace_bytes, self.samples_bytes)))

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def read(cls, folder: Path) -> RunState:
        """The run state of a checkpoint folder; ValueError naming the file when it is not one."""
        path = folder / RUN_STATE_FILE
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"{path} is not a run state ({e}): a checkpoint of another kind of run? "
                             "Resume from another checkpoint or delete this one") from e


def roll_back_logs(run_dir: Path) -> tuple[Path, RunState] | None:
    """On resume: the latest checkpoint under `run_dir` and its run state (None: there is none),
    with metrics.jsonl, trace.jsonl and samples.jsonl cut back to their length at that checkpoint
    (to nothing without one: the run starts over)."""
    latest = checkpoint.latest(run_dir / "checkpoints")
    state = RunState.read(latest) if latest is not None else None
    moved = 0
    sizes: dict[str, int | None] = state.log_bytes() if state is not None else dict.fromkeys(LOG_FILES, 0)
    for name, size in sizes.items():
        if size is not None:  # (checkpoints from before these keys: left as they are)
            moved += roll_back(run_dir / name, size)
    if moved:
        log.info("resuming: the steps after %s were cut from metrics.jsonl, trace.jsonl and samples.jsonl "
                 "(kept in *.rolled_back.jsonl); they run again", latest.name if latest else "the start")
    return None if latest is None or state is None else (latest, state)
