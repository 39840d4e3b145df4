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

`RemoteSpawner(system, agent)` is the controller's `Spawner` (miles_async/actors/controller.py) for a node:
the same `spawn(cls, name, args=..., kwargs=...)` as `LocalSpawner` is for its own.

Nodes need not share a filesystem for their engines: before starting one, the controller has the
agent check the model folder (`ensure_folder`: each file's size and modification time, rsync's
quick check), and sends the files the node lacks or holds otherwise, in chunks over the same
authenticated mailboxes, each checked by its SHA-256 on arrival and given its source's time,
written to the same path there (a folder on a shared filesystem, or copied before, passes the
check without a byte read, and nothing is sent).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
import socket
from pathlib import Path
from typing import Any

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


class SpawnHere(Message[ActorAddress]):
    """Start an actor in a new process on this node. `payload`: pickle of (cls, args, kwargs, restart, env)."""

    name: str
    payload: bytes


class GetNodeStatus(Message[NodeStatus]):
    """This node's agent: its host, GPUs and children."""


class FreePort(Message[int]):
    """A TCP port free right now on this node's address (for a process group's MASTER_PORT)."""



class StopChildren(Message[None]):
    """Stop every process this agent started (their engines were declared lost while this node was
    cut off); the agent stays, ready to start new ones."""



class ShutdownNode(Message[None]):
    """Stop every process this agent started, then the agent's own process (the launcher exits)."""

    reason: str = "the run is over"


CHUNK_BYTES = 8 << 20  # a file travels in pieces of this size (well under the runtime's message limit)


class FileStat(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # relative to the folder, "/"-separated
    size: int
    mtime_ns: int
    sha256: str = ""  # set on a file being sent (checked on arrival), or to compare contents too


class MissingFiles(Message[list[str]]):
    """Which of these files this node lacks in `folder`: absent, or of another size or modification
    time (rsync's quick check: a shared filesystem or an earlier copy passes it without reading a
    byte), or of another SHA-256 where one is given."""

    folder: str
    files: list[FileStat]


class PutFile(Message[None]):
    """A piece of a file for `folder` on this node; the last piece checks the SHA-256, gives the file
    its source's modification time and puts it in place (until then it is a hidden partial file)."""

    folder: str
    file: FileStat
    offset: int
    data: bytes


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def _stat(path: Path, name: str, sha256: bool = False) -> FileStat:
    st = path.stat()
    return FileStat(name=name, size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=_sha256(path) if sha256 else "")


def list_folder(folder: str | Path) -> list[FileStat]:
    """Every file under `folder` (hidden ones left out), with its size and modification time."""
    root = Path(folder)
    return [_stat(path, path.relative_to(root).as_posix()) for path in sorted(root.rglob("*"))
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts)]


def _local_path(folder: str, name: str) -> Path:
    if not Path(folder).is_absolute() or not name or name.startswith("/") or ".." in name.split("/"):
        raise ValueError(f"refusing file {name!r} for folder {folder!r}: an absolute folder and a relative name "
                         "inside it are expected")
    return Path(folder) / name


def _read_at(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(CHUNK_BYTES)


def _holds(path: Path, file: FileStat) -> bool:
    if not path.is_file():
        return False
    st = path.stat()
    if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
        return False
    return not file.sha256 or _sha256(path) == file.sha256


def _put(folder: str, file: FileStat, offset: int, data: bytes) -> None:
    path = _local_path(folder, file.name)
    part = path.with_name(f".part-{path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(part, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)
    if offset + len(data) < file.size:
        return
    if part.stat().st_size != file.size or _sha256(part) != file.sha256:
        part.unlink(missing_ok=True)
        raise ValueError(f"{path}: the received file does not match its size or SHA-256 (sent again, it may pass)")
    os.utime(part, ns=(file.mtime_ns, file.mtime_ns))
    part.replace(path)


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
    async def missing_files(self, msg: MissingFiles) -> list[str]:
        def lacking() -> list[str]:
            return [f.name for f in msg.files if not _holds(_local_path(msg.folder, f.name), f)]

        return await asyncio.to_thread(lacking)

    @handler
    async def put_file(self, msg: PutFile) -> None:
        await asyncio.to_thread(_put, msg.folder, msg.file, msg.offset, msg.data)

    @handler(concurrent=True)  # the launcher's liveness probe: never queued behind a spawn (seconds)
    async def status(self, msg: GetNodeStatus) -> NodeStatus:
        return NodeStatus(node_rank=self.node_rank, host=self.host, hostname=socket.gethostname(), pid=os.getpid(),
                          num_gpus=self.num_gpus, children=list(self.children))

    @handler(concurrent=True)
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

    async def shares(self, path: str | Path) -> bool:
        """Whether the node sees the file at `path` as this one does (a shared filesystem)."""
        path = Path(path).resolve()
        file = await asyncio.to_thread(_stat, path, path.name, True)
        missing = await self.agent.ask(MissingFiles(folder=str(path.parent), files=[file]), timeout_s=self.timeout_s)
        return not missing

    async def ensure_folder(self, folder: str | Path, dest: str | Path | None = None) -> int:
        """Make the node hold `folder` as this one does, at the same path or at `dest` there (module
        docstring); returns the bytes sent. Only the files sent are read whole (to hash them)."""
        folder = str(Path(folder).resolve())
        there = str(dest or folder)
        files = await asyncio.to_thread(list_folder, folder)
        lacking = set(await self.agent.ask(MissingFiles(folder=there, files=files), timeout_s=self.timeout_s))
        sent = 0
        for file in (f for f in files if f.name in lacking):
            file = msgspec.structs.replace(file, sha256=await asyncio.to_thread(_sha256, Path(folder) / file.name))
            offset = 0
            while True:
                data = await asyncio.to_thread(_read_at, Path(folder) / file.name, offset)
                if not data and offset < file.size:
                    raise RuntimeError(f"{folder}/{file.name} shrank while being sent to a node")
                await self.agent.ask(PutFile(folder=there, file=file, offset=offset, data=data),
                                     timeout_s=self.timeout_s)
                offset += len(data)
                if offset >= file.size:
                    break
            sent += file.size
        if lacking:
            log.warning("sent %d file(s) of %s (%.1f MiB) to a node that lacked them, to %s", len(lacking), folder,
                        sent / 2**20, there)
        return sent
