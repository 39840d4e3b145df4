"""The entry point of a child process that hosts one actor for its owner.

The owner's system starts it with multiprocessing's `forkserver` method
(`RuntimeConfig.start_method`): the first child an owner starts brings up a server process, a fresh
interpreter that imports the runtime and `RuntimeConfig.preload` (a run's: torch, its engine and
trainer actors; seconds of CPU), and every child is then a fork of that server, never of the owner,
so it inherits no thread, socket or CUDA context of the owner's and starts in a fraction of a
second. `spawn` starts a fresh interpreter per child instead. Either way the child names its
process for its actor (`miles-async: engine-0` in `ps`, `miles:engine-0` in `top`: proctitle.py),
joins its owner's run (the name prefix of its shared-memory segments: segments.py), takes the
owner's environment as it was when the child was started (a forked child would otherwise have the
server's, from when the server started) and the spec's additions, and then runs the spec's `serve`
(`system.serve_child`): it binds its own ROUTER, constructs the actor, runs `on_start`, registers
the name with the run's directory and reports `ChildReady` to the owner; a failure at any step is
reported as `ChildDied` and the process exits with status 1. It exits when told to shut down, when
its actor is stopped, or when its owner's process is gone.

A command can start the server before it imports its own heavy modules (`start_fork_server`), so
that the two imports overlap. The server's own exit, once its owner is gone, is an `os._exit`
(quickexit.py): seconds of module teardown saved, while it still holds the owner's stderr.

The spec names `serve` rather than this module importing the system: the supervisor (owner.py),
below the system, builds the spec, and the system sits on top of the runtime's modules.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
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


def context(config: RuntimeConfig) -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context children start from (`RuntimeConfig.start_method`). The fork
    server's preload list is the one of the owner's first child (it is read when the server starts)."""
    if config.start_method == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # quickexit last: the server's exit skips the teardown of what it preloaded (its docstring)
    ctx.set_forkserver_preload(["miles_async.runtime.system", *config.preload, "miles_async.runtime.quickexit"])
    return ctx


def start_fork_server(config: RuntimeConfig) -> None:
    """Start this process's fork server now, with `config`'s preload, rather than at its first
    child (nothing for `spawn`): a command that is about to import torch and its actors itself calls
    this first, so that the server's imports run beside its own (on another core) instead of after
    them. The server is started once per process; a later `context` call cannot change its preload."""
    if config.start_method == "forkserver":
        context(config)
        multiprocessing.forkserver.ensure_running()


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
    environ: dict[str, str] | None = None  # the owner's environment when it started the child
    owner_pid: int = 0  # the owner's process: the child exits when it does (not its parent's: a fork server's)
    run_tag: str = ""  # the owner's run (segments.py); "" only for a spec built outside a run


def main(name: str, spec_bytes: bytes) -> None:
    # Named before the spec is unpickled: that imports the actor's module (torch, for an engine or a
    # trainer), seconds in which `ps` would show only multiprocessing's command line.
    proctitle.set_title(name)
    spec: ChildSpec = pickle.loads(spec_bytes)
    if spec.run_tag:
        segments.join_run(spec.run_tag)
    # Before anything touches a device: CUDA reads CUDA_VISIBLE_DEVICES when it first initialises.
    if spec.environ is not None:
        os.environ.clear()
        os.environ.update(spec.environ)
    os.environ.update(spec.env or {})
    for entry in spec.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the owner decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run(spec.serve(spec)))

