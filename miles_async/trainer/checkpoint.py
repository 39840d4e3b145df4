"""Checkpoints with torch.distributed.checkpoint: model, optimizer, RNG states, step, data cursor.

Layout under the checkpoint folder:

    step_00000004/          one finished checkpoint
        *.distcp, .metadata   model and optimizer, sharded as they are trained (DCP)
        rng_rank<r>.pt        each rank's RNG states
        run_state.json        any `files` the caller adds (the run's own state), before meta.json
        meta.json             step, weight version, data cursor, world size (written last)
    .tmp-step_00000006/     a save in progress, or one that crashed

A save writes everything into `.tmp-step_<N>` and rank 0 renames it to `step_<N>` only after
every rank has written its part, so a crash mid-save leaves the previous checkpoint intact and
`latest()` never returns a partial one (only renamed folders with a meta.json count). With
`keep=K`, rank 0 then deletes all but the newest K finished checkpoints.

A save has two halves, so that it can run in the background: `stage` copies the model's and the
optimizer's state (a memory copy: the caller may go on training as soon as it returns), and
`write` puts the copy on disk. `save` is both in a row. A `write` that runs beside training
must use a process group of its own (`process_group`): two threads issuing collectives on one
group can interleave them.

Every function here but `prune` is a collective: call it on every rank, with the same arguments.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PREFIX = "step_"
META = "meta.json"


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The finished checkpoint with the highest step under `root`, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / META).is_file()]
    return max(done, key=lambda p: int(p.name[len(PREFIX):]), default=None)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Staged:
    """A copy of one rank's model and optimizer state, and its RNG states, taken by `stage`."""

    def __init__(self, state: dict[str, Any], rng: dict[str, Any]) -> None:
        self.state = state
        self.rng = rng


def stage(model: nn.Module, optimizer: torch.optim.Optimizer) -> Staged:
    """Copy the state to save (sharded tensors stay sharded: each rank copies its own shards).
    Cheap next to `write`: a memory copy of the parameters and the optimizer's moments. Imports
    torch.distributed.checkpoint at first use (DTensor and sympy: a second of import)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return Staged({"model": _copied(model_sd), "optim": _copied(optim_sd)}, rng_state())


def _copied(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copied(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copied(v) for v in obj)
    return obj


def save(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
         *, after_write: Callable[[Path], None] | None = None, files: dict[str, bytes] | None = None,
         keep: int = 0) -> Path:
    """Save a checkpoint of `meta["step"]` under `root` now (`stage` then `write`); returns its folder."""
    return write(root, stage(model, optimizer), meta, after_write=after_write, files=files, keep=keep)


def write(root: str | Path, staged: Staged, meta: dict[str, Any], *,
          after_write: Callable[[Path], None] | None = None, files: dict[str, bytes] | None = None,
          keep: int = 0, process_group: dist.ProcessGroup | None = None) -> Path:
    """Write a staged checkpoint of `meta["step"]` under `root`; returns its folder.

    `after_write(tmp_folder)` runs on every rank once its shards are written and before the
    rename (a place to observe, or to fail, a save in the middle). `files` (name -> bytes) are
    written by rank 0 into the folder before its meta.json. `keep` > 0: rank 0 then prunes to the
    newest `keep` checkpoints. Collectives go over `process_group` (default: the default group).
    """
    rank = dist.get_rank()
    final = step_folder(root, int(meta["step"]))
    tmp = final.with_name(f".tmp-{final.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
        tmp.mkdir(parents=True)
    dist.barrier(group=process_group)
    import torch.distributed.checkpoint as dcp  # at first use (stage's import)

    dcp.save(staged.state, checkpoint_id=str(tmp), process_group=process_group)
    torch.save(staged.rng, tmp / f"rng_rank{rank}.pt")
    if after_write is not None:
        after_write(tmp)
    dist.barrier(group=process_group)  # every rank's part is on disk before the rename makes it visible
    if rank == 0:
        for name, data in (files or {}).items():
            _write_durably(tmp / name, data)
        meta = {**meta, "world_size": dist.get_world_size()}
        _write_durably(tmp / META, json.dumps(meta, indent=2).encode())
        if final.exists():  # re-saving a step: swap, so a complete one is there at every instant
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
        if keep > 0:
            prune(root, keep)
    dist.barrier(group=process_group)
    return final


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` finished checkpoints under `root` (and the leftovers of
    crashed saves older than the oldest kept); returns what was deleted. Not a collective."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    done = sorted((p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / META).is_file()),
                  key=lambda p: int(p.name[len(PREFIX):]))
    gone = done[:-keep]
    if done[-keep:]:
        oldest_kept = int(done[-keep:][0].name[len(PREFIX):])
        gone += [p for p in root.iterdir() if p.name.startswith((f".tmp-{PREFIX}", f".old-{PREFIX}"))
                 and int(p.name.rsplit("_", 1)[1]) < oldest_kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def load(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint in `folder` into `model`, `optimizer` and this rank's RNG; returns its meta."""
    folder = Path(folder)
    if not (folder / META).is_file():
        raise ValueError(f"{folder} is not a finished checkpoint (no {META}); use checkpoint.latest(root)")
    meta = json.loads((folder / META).read_text())
    import torch.distributed.checkpoint as dcp  # DTensor, sympy: a second; at first use
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # dcp.load fills it in place
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = folder / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh RNG for the new ones
        set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
