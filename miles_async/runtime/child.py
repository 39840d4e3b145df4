"""The entry point of a child process that hosts one actor for its owner.

The owner's system starts it with multiprocessing's `spawn` method (a fresh interpreter, never
a fork of a process that already has threads and sockets). The child names its process for its
actor (`miles-async: engine-0` in `ps`, `miles:engine-0` in `top`: proctitle.py), joins its
owner's run (the name prefix of its shared-memory segments: segments.py), binds its own ROUTER,
constructs the actor, runs `on_start`, registers the name with the run's directory and reports
`ChildReady` to the owner; a failure at any step is reported as `ChildDied` and the process exits
with status 1. It exits when told to shut down, when its actor is stopped, or when its parent
process is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from typing import Any

from miles_async.runtime import proctitle, segments
from miles_async.runtime.config import RuntimeConfig
from miles_async.runtime.errors import ActorError, Failure, SpawnError
from miles_async.runtime.loop import run
from miles_async.runtime.messages import ActorAddress, ChildDied, ChildReady

log = logging.getLogger("miles_async.runtime")


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
    sys.exit(run(_serve(spec)))


async def _serve(spec: ChildSpec) -> int:
    from miles_async.runtime.system import SYSTEM_ACTOR, ActorSystem

    system = ActorSystem(spec.name, config=spec.config, directory=spec.directory, bind=spec.bind, key_dir=spec.key_dir)
    await system.start()
    system.watch_parent = True
    gc.freeze()  # this process lives on: keep its start-up objects out of every later collection
    owner = system.ref(ActorAddress(name=SYSTEM_ACTOR, address=spec.owner_address, capacity=1 << 16))
    h = system._host(spec.name, spec.cls, spec.args, spec.kwargs, spec.owner, spec.owner_address)
    h.main = True
    try:
        await system._start_hosted(h)
        entry = ActorAddress(name=spec.name, address=system.address, capacity=h.capacity)
        await system._register(entry)
        await owner.ask(ChildReady(name=spec.name, address=system.address, capacity=h.capacity),
                        timeout_s=spec.config.spawn_timeout_s)
    except (ActorError, ValueError) as exc:  # SpawnError, a taken name, an owner that is gone
        cause = exc.cause if isinstance(exc, SpawnError) else Failure.from_exception(exc)
        log.error("actor %r failed to start: %s", spec.name, exc)
        try:
            await owner.ask(ChildDied(name=spec.name, cause=cause), timeout_s=5.0)
        except ActorError as report_exc:  # the owner is gone; the exit status still tells
            log.error("could not report the failure to the owner: %s", report_exc)
        await system.close()
        return 1
    await system.wait_closed()
    return 0
