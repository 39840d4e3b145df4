"""A process group of its own for weight broadcasts: the pusher (rank 0) and the engines.

The pusher usually lives in a process that already has torch.distributed's default group (the
trainer's), and engines live in processes that have none; `torch.distributed.new_group` needs
every member of the default group, so neither fits. `WeightGroup` builds a standalone
`ProcessGroupGloo` (or `ProcessGroupNCCL`) over its own TCP store instead, and calls the group's
collectives directly (torch's module-level `dist.broadcast` only accepts groups registered with
the default one). The rendezvous: rank 0 opens the store (`WeightGroup.open_store`, any free
port), sends host and port to the others (actor messages), then every member calls `join`,
which blocks until all have joined, so the members call it concurrently.

Try it: `pytest tests/unit/test_transport_groups.py -s`.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class WeightGroup:
    """A standalone process group; transport.broadcast calls `start_broadcast` on it."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, world_size: int, backend: str,
                 store: dist.Store | None = None) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._store = store  # rank 0 keeps the store's server alive as long as the group

    @staticmethod
    def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store server on a free port (`.port`), not waiting for the others to connect."""
        return dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
             timeout_s: float = 300.0, name: str = "weights", store: dist.Store | None = None,
             local_host: str | None = None) -> WeightGroup:
        """Join the group (blocks until every member has); rank 0 passes the store it opened.

        `local_host`: the address this member's gloo connections use (its node's, in a multi-node
        run); without it gloo picks by resolving the machine's hostname, which may be loopback.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(name, store)
        if backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        elif local_host:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            options._timeout = timeout
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        return cls(pg, rank, world_size, backend, store)

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start broadcasting `tensor` from group rank `src`; `.wait()` on the result."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def close(self) -> None:
        """Drop the group; a peer blocked in a collective with it then fails instead of hanging."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None  # type: ignore[assignment]
        self._store = None
