"""The entry point of a child process that hosts one actor for its owner.

The owner's system starts it with multiprocessing's `spawn` method (a fresh interpreter, never
a fork of a process that already has threads and sockets). The child names its process for its
actor (`miles-async: engine-0` in `ps`, `miles:engine-0` in `top`: proctitle.py), joins its
owner's run (the name prefix of its shared-memory segments: segments.py), sets its environment,
and then runs the spec's `serve` (`system.serve_child`): it binds its own ROUTER, constructs the
actor, runs `on_start`, registers the name with the run's directory and reports `ChildReady` to
the owner; a failure at any step is reported as `ChildDied` and the process exits with status 1.
It exits when told to shut down, when its actor is stopped, or when its parent process is gone.

The spec names `serve` rather than this module importing the system: the supervisor (owner.py),
below the system, builds the spec, and the system sits on top of the runtime's modules.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from miles_async.runtime import proctitle, segments
from miles_async.runtime.config import RuntimeConfig
from miles_async.runtime.loop import run


@dataclass(frozen=True)
class ChildSpec:
    name: str
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    owner: str
    owner_address: str
    directory: str
    bind: str
    config: RuntimeConfig
    key_dir: str | None
    sys_path: list[str]
    log_level: int
    serve: Callable[[ChildSpec], Coroutine[Any, Any, int]]  # the process's life; its exit status
    env: dict[str, str] | None = None  # e.g. CUDA_VISIBLE_DEVICES: set before the actor exists
    run_tag: str = ""  # the owner's run (segments.py); "" only for a spec built outside a run


def main(name: str, spec_bytes: bytes) -> None:
    # Named before the spec is unpickled: that imports the actor's module (torch, for an engine or a
    # trainer), seconds in which `ps` would show only multiprocessing's command line.
    proctitle.set_title(name)
    spec: ChildSpec = pickle.loads(spec_bytes)
    if spec.run_tag:
        segments.join_run(spec.run_tag)
    # Before anything touches a device: CUDA reads CUDA_VISIBLE_DEVICES when it first initialises.
    os.environ.update(spec.env or {})
    for entry in spec.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the owner decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run(spec.serve(spec)))

