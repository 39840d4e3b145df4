"""The runtime's configuration (one frozen struct; recipes fill it from TOML)."""

from __future__ import annotations

from typing import Literal

import msgspec


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a process hosts actors and talks to other processes.

    transport: `ipc` (Unix sockets, one node) or `tcp` (across nodes).
    host: the interface tcp binds to; loopback unless you mean to be reached from other hosts.
    advertise_host: the host name others use to reach a tcp system (needed when `host` is a
        wildcard such as 0.0.0.0).
    curve: ZeroMQ CURVE authentication; None means on for tcp on a non-loopback host.
    run_dir: where ipc sockets and the run's keys live (a fresh temporary folder by default).
    heartbeat_interval_s / heartbeat_timeout_s: a peer silent for the timeout is declared lost
        (its pending asks fail with `ActorDeadError`). Handlers must not block the event loop for
        that long (run heavy work with `asyncio.to_thread`).
    ask_timeout_s: the default timeout of `ask`.
    spawn_timeout_s: how long a child process may take to start its actor.
    start_method: how child processes start (multiprocessing's names). `forkserver` (the
        default): a server process, started once per owner, imports `preload`, and each child
        is a fork of it: a process with no threads, sockets or CUDA state of the owner's, started
        in a fraction of a second rather than the seconds an interpreter takes to import torch.
        `spawn`: a fresh interpreter per child.
    preload: the modules the fork server imports besides the runtime (a run's: torch and the
        engine and trainer actors; none by default, as an actor that needs no torch should not
        wait for it). Their import must not depend on the environment a
        child is given (it is set after the fork), start threads or touch a device; a module
        that fails to import is skipped (the child imports it, or fails, itself).
    stop_grace_s: how long a stopping actor's running handlers may take before they are cancelled.
    max_message_bytes: larger frames are refused by the socket (tensors go through transports).
    dataplane_dir: the folder of the data plane's shared-memory segments (see `dataplane.py`);
        None means /dev/shm where it exists and is writable, else the system's temporary folder.
        Every process of a node must use the same one to read each other's blobs in place: a
        reader whose folder differs (a real setting, and how tests force the remote path) reads
        through the owner's `$dataplane` actor instead, as across nodes.
    dataplane_segment_bytes: the size of one shared-memory segment (header included); blobs are
        packed into segments, and a blob larger than one gets a segment of its own. tmpfs
        allocates pages as they are written, so an idle segment costs next to nothing.
    dataplane_max_bytes: the most shared memory (segment sizes summed) one process's data plane
        may hold; past it `put` raises `DataPlaneFullError`. 8 GiB is tens of batches of a large
        run's trajectory arrays (100s of MB each, freed once trained on), yet a small part of a
        training node's /dev/shm (half its RAM by default): a consumer that forgets to free fails
        with a named error long before tmpfs fills up, where writers die of SIGBUS instead.
    dataplane_max_peer_mappings: how many segments of other processes of this node a process
        keeps mapped (least recently read first out); a mapping costs address space, not memory.
    """

    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    curve: bool | None = None
    run_dir: str | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    ask_timeout_s: float = 60.0
    spawn_timeout_s: float = 60.0
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    preload: tuple[str, ...] = ()
    stop_grace_s: float = 5.0
    max_message_bytes: int = 64 * 1024 * 1024
    dataplane_dir: str | None = None
    dataplane_segment_bytes: int = 64 * 1024 * 1024
    dataplane_max_bytes: int = 8 * 1024**3
    dataplane_max_peer_mappings: int = 256

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"RuntimeConfig.transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(f"RuntimeConfig.start_method must be 'forkserver' or 'spawn', got {self.start_method!r}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("RuntimeConfig needs 0 < heartbeat_interval_s < heartbeat_timeout_s, got "
                             f"{self.heartbeat_interval_s} and {self.heartbeat_timeout_s}")
        for field in ("ask_timeout_s", "spawn_timeout_s", "stop_grace_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"RuntimeConfig.{field} must be > 0, got {getattr(self, field)}")
        if not 4096 <= self.dataplane_segment_bytes <= self.dataplane_max_bytes:
            raise ValueError("RuntimeConfig needs 4096 <= dataplane_segment_bytes <= dataplane_max_bytes, got "
                             f"{self.dataplane_segment_bytes} and {self.dataplane_max_bytes}")
        if self.dataplane_max_peer_mappings < 1:
            raise ValueError(f"RuntimeConfig.dataplane_max_peer_mappings must be >= 1, got "
                             f"{self.dataplane_max_peer_mappings}")

    @property
    def use_curve(self) -> bool:
        if self.curve is not None:
            return self.curve
        return self.transport == "tcp" and self.host not in ("127.0.0.1", "localhost", "::1")
