"""The node agent: on every node but the controller's, the actor that starts the run's processes there.

    node 0 (controller)                         node k (miles-async launch --node-rank k)
    Controller ──SpawnHere(EngineActor, ...)──► NodeAgent "node-k" ── spawns ──► engine-3 (a process)
        │                                                                          │ registers with
        └──────────────── the run's directory (on node 0) ◄────────────────────────┘ the directory

A `SpawnHere` carries the actor class and its arguments pickled (the same bytes a local
`spawn(process=True)` hands a child process; peers are authenticated by the run's CURVE key, so
only the run's own processes can send one). The agent spawns the actor as its own child, in a
fresh process on this node, and answers with its address; the actor then registers with the
run's directory like any other, so the controller reaches it by name. The agent owns these
processes: they exit with it, and it exits when told (`ShutdownNode`) or when the controller's
node stops answering (so a dead controller leaves no orphan behind on any node).

`RemoteSpawner(system, agent)` is the controller's `Spawner` (actors/controller.py) for a node:
the same `spawn(cls, name, args=..., kwargs=...)` as `LocalSpawner` is for its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
from typing import Any, ClassVar

import msgspec

from miles_async.runtime import (
    Actor,
    ActorAddress,
    ActorDeadError,
    ActorRef,
    ActorSystem,
    AskTimeoutError,
    handler,
)
from miles_async.runtime.messages import Lookup, Message
from miles_async.runtime.supervision import RestartPolicy
from miles_async.trainer.fsdp import free_port

log = logging.getLogger("miles_async.launch")


def agent_name(node_rank: int, pid: int) -> str:
    """The agent of one launcher: a node that comes back is a new launcher (pid), so a new name."""
    return f"node-{node_rank}-{pid}"


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    node_rank: int
    host: str
    hostname: str
    pid: int
    num_gpus: int
    children: list[str]


class SpawnHere(Message):
    """Start an actor in a new process on this node. `payload`: pickle of (cls, args, kwargs, restart, env)."""

    name: str
    payload: bytes
    Reply: ClassVar[Any] = ActorAddress


class GetNodeStatus(Message):
    Reply: ClassVar[Any] = NodeStatus


class FreePort(Message):
    """A TCP port free right now on this node's address (for a process group's MASTER_PORT)."""

    Reply: ClassVar[Any] = int


class StopChildren(Message):
    """Stop every process this agent started (their engines were declared lost while this node was
    cut off); the agent stays, ready to start new ones."""

    Reply: ClassVar[Any] = None


class ShutdownNode(Message):
    """Stop every process this agent started, then the agent's own process (the launcher exits)."""

    reason: str = "the run is over"
    Reply: ClassVar[Any] = None


class NodeAgent(Actor):
    """Starts processes on this node for the controller (module docstring)."""

    def __init__(self, node_rank: int, host: str, num_gpus: int = 0, controller_address: str = "",
                 watch_interval_s: float = 2.0, done: asyncio.Event | None = None,
                 outcome: dict[str, str] | None = None) -> None:
        """`done` is set when this node should exit; `outcome` then says why ("reason") and whether
        the run ended cleanly ("clean": "yes" or "no"). Both are shared with the launcher, which
        hosts the agent in its own process."""
        self.node_rank = node_rank
        self.host = host
        self.num_gpus = num_gpus
        self.controller_address = controller_address
        self.watch_interval_s = watch_interval_s
        self.children: list[str] = []
        self.done = done or asyncio.Event()
        self.outcome = outcome if outcome is not None else {}
        self._watch: asyncio.Task | None = None

    async def on_start(self) -> None:
        if self.controller_address:
            self._watch = asyncio.ensure_future(self._watch_controller())

    async def on_stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    @handler
    async def spawn_here(self, msg: SpawnHere) -> ActorAddress:
        cls, args, kwargs, restart, env = pickle.loads(msg.payload)  # the run's CURVE-authenticated peers only
        ref = await self.system.spawn(cls, msg.name, args=tuple(args), kwargs=dict(kwargs), process=True,
                                      restart=restart, env=env)
        self.children.append(msg.name)
        log.info("node %d: started %s", self.node_rank, msg.name)
        return ActorAddress(name=ref.name, address=ref.address, capacity=ref.capacity)

    @handler
    async def status(self, msg: GetNodeStatus) -> NodeStatus:
        return NodeStatus(node_rank=self.node_rank, host=self.host, hostname=socket.gethostname(), pid=os.getpid(),
                          num_gpus=self.num_gpus, children=list(self.children))

    @handler
    async def free_port(self, msg: FreePort) -> int:
        return free_port(self.host)

    @handler
    async def stop_children(self, msg: StopChildren) -> None:
        await self._stop_children()

    @handler
    async def shutdown(self, msg: ShutdownNode) -> None:
        await self._stop_children()
        self.outcome.update(reason=msg.reason, clean="yes")
        self.done.set()

    async def _stop_children(self) -> None:
        for name in reversed(self.children):
            try:
                await self.system.stop(name, timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - already gone: nothing to stop
                log.info("node %d: %s was already gone (%s)", self.node_rank, name, e)
        self.children.clear()

    async def _watch_controller(self) -> None:
        """Exit when the controller's node stops answering for good: a node must not outlive its run.
        A while of silence is not enough (this node may have been cut off, and be back): only
        silence for twice the heartbeat timeout, through several tries, ends it."""
        timeout_s = self.system.config.heartbeat_timeout_s
        silent_since: float | None = None
        while not self.done.is_set():
            await asyncio.sleep(self.watch_interval_s)
            try:
                await self.system.directory.ask(Lookup(name=self.name), timeout_s=timeout_s)
                silent_since = None
                continue
            except (ActorDeadError, AskTimeoutError) as e:
                now = asyncio.get_running_loop().time()
                silent_since = silent_since if silent_since is not None else now
                if now - silent_since < 2 * timeout_s:
                    continue
                log.error("node %d: the controller's node is gone (%s); stopping this node", self.node_rank, e)
                self.outcome.update(reason=f"the controller's node stopped answering ({type(e).__name__}: {e})",
                                    clean="no")
                await self._stop_children()
                self.done.set()
                return


class RemoteSpawner:
    """`spawn` on another node, through its agent; the same call as a local process spawn."""

    def __init__(self, system: ActorSystem, agent: ActorRef, timeout_s: float = 300.0) -> None:
        self.system = system
        self.agent = agent
        self.timeout_s = timeout_s

    async def spawn(self, cls: type, name: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                    restart: RestartPolicy | None = None, env: dict[str, str] | None = None) -> ActorRef:
        payload = pickle.dumps((cls, tuple(args), dict(kwargs or {}), restart or RestartPolicy(), env))
        address = await self.agent.ask(SpawnHere(name=name, payload=payload), timeout_s=self.timeout_s)
        return self.system.ref(address)

    async def free_port(self) -> int:
        return await self.agent.ask(FreePort(), timeout_s=self.timeout_s)
