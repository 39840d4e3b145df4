"""The actors every system hosts: `$system` (control), `$dataplane` (its data plane's reads and
frees for other processes) and, on a run's first system, `$directory`.

`$system` works on its system through `ControlHost`, public methods that `ActorSystem`
implements, so that this module stays below system.py."""

from __future__ import annotations

from typing import Protocol

from miles_async.runtime.actor import Actor, handler
from miles_async.runtime.dataplane import DATAPLANE_CAPACITY
from miles_async.runtime.errors import UnknownActorError
from miles_async.runtime.messages import (
    ActorAddress,
    ChildDied,
    ChildReady,
    FreeBlobs,
    ListNames,
    Lookup,
    ReadBlob,
    Register,
    RestartActor,
    ShutdownSystem,
    StopActor,
    Unregister,
)
from miles_async.runtime.owner import Supervisor, SupervisorHost


class ControlHost(SupervisorHost, Protocol):
    """What `$system` needs of its `ActorSystem` beyond its supervisor's view (see their docstrings)."""

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def main_actor(self) -> str | None: ...

    def hosts(self, name: str) -> bool: ...

    async def close(self) -> None: ...


class SystemActor(Actor):
    """Each system's control endpoint: children report here, owners send orders here."""

    mailbox_capacity = 1 << 16
    system: ControlHost

    @handler(concurrent=True)
    async def child_ready(self, msg: ChildReady) -> None:
        self.system.supervisor.on_child_ready(msg)

    @handler(concurrent=True)
    async def child_died(self, msg: ChildDied) -> None:
        self.system.supervisor.on_child_died(msg.name, msg.cause)

    @handler(concurrent=True)
    async def stop_actor(self, msg: StopActor) -> None:
        system = self.system
        if msg.name.startswith("$") or not system.hosts(msg.name):
            raise UnknownActorError(f"no actor named {msg.name!r} is hosted at {system.address}")
        if msg.name == system.main_actor:  # a child process exists for this actor alone
            system.run_background(system.close())
            return
        await system.stop(msg.name)  # hosted here: stopped by its supervisor's record, or directly

    @handler(concurrent=True)
    async def restart_actor(self, msg: RestartActor) -> None:
        await self.system.start_hosted(msg.name)  # UnknownActorError if it is not hosted here

    @handler(concurrent=True)
    async def shutdown(self, msg: ShutdownSystem) -> None:
        self.system.run_background(self.system.close())


class DataPlaneActor(Actor):
    """Serves this process's data plane to processes that cannot map its segments (another node,
    another folder), and takes frees from any process. Handlers are synchronous: each is a few
    dict operations or a view of one piece, which the reply copies (a piece fits one frame)."""

    mailbox_capacity = DATAPLANE_CAPACITY

    @handler
    def read_blob(self, msg: ReadBlob) -> memoryview:
        return self.system.dataplane.serve_read(msg.ref, msg.offset, msg.length)

    @handler
    def free_blobs(self, msg: FreeBlobs) -> None:
        self.system.dataplane.serve_free(msg.refs)


class Directory(Actor):
    """Names to addresses for one run; hosted as `$directory` by the run's first system."""

    mailbox_capacity = 1 << 16

    def __init__(self) -> None:
        self.entries: dict[str, ActorAddress] = {}

    @handler
    def register(self, msg: Register) -> None:
        old = self.entries.get(msg.entry.name)
        if old is not None and old.address != msg.entry.address:
            raise ValueError(f"an actor named {msg.entry.name!r} is already registered at {old.address}")
        self.entries[msg.entry.name] = msg.entry

    @handler
    def unregister(self, msg: Unregister) -> None:
        self.entries.pop(msg.name, None)

    @handler
    def lookup(self, msg: Lookup) -> ActorAddress | None:
        return self.entries.get(msg.name)

    @handler
    def list_names(self, msg: ListNames) -> list[str]:
        return sorted(self.entries)
