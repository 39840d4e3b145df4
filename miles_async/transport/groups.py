"""A process group of its own for weight broadcasts: the pusher (rank 0) and the engines.

The pusher usually lives in a process that already has torch.distributed's default group (the
trainer's), and engines live in processes that have none; `torch.distributed.new_group` needs
every member of the default group, so neither fits. `WeightGroup` builds a standalone
`ProcessGroupGloo` (or `ProcessGroupNCCL`) over its own TCP store instead, and calls the group's
collectives directly (torch's module-level `dist.broadcast` only accepts groups registered with
the default one). The rendezvous: rank 0 opens the store (`WeightGroup.open_store`, any free
port), sends host and port to the others (actor messages), then every member calls `join`,
which blocks until all have joined, so the members call it concurrently.

Where things listen: torch's TCPStore server binds every interface (`::`) whatever host it is
given, and its sockets have no authentication, so `listening_store` binds the socket itself, on
the given host only, and hands it to the store (`master_listen_fd`); the trainer's process group
uses it too (`miles_async.trainer.fsdp`). A member's gloo pairs listen on `local_host`; a group
whose store is on loopback (one machine) keeps them on loopback.

SGLang's layout (`join(..., sglang=True)`): SGLang 0.5.23 builds its weight-update group with
`init_custom_process_group` (srt/utils/common.py): a TCP rendezvous whose rank 0 hosts the store,
`PrefixStore(group_name)`, then torch's `_new_process_group_helper`, which adds
`f"{group_name}/"` and the device's `"cpu/"` (gloo) or `"cuda/"` (NCCL) and sets the group's
sequence number through the store (rank 0 writes it, the others wait for it). A member that
skips either step leaves the others waiting for keys that never come, so the distributed weight
path joins with the same keys, and the embedded engine's server (engine/weights.py
`GroupReceiver`) does too: a trainer written for SGLang pushes to it unchanged.
tests/e2e/test_sglang_conformance.py runs SGLang's own function, read from its wheel, against it.

Try it: `pytest tests/unit/test_transport_groups.py -s`.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the C++ backend class (gloo's, NCCL's); `dist.Backend` is the enum of backend names
    from torch._C._distributed_c10d import Backend

BACKENDS = ("gloo", "nccl")
LISTEN_BACKLOG = 2048  # torch's own store server listens with this backlog

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) resolves to loopback addresses only."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    # str(): typeshed's sockaddr also allows the int of a non-IP family, which SOCK_STREAM lookups never give
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def bound_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` (the first of its addresses this machine holds) and `port`
    (0: any free port), and on nothing else. OSError when none of its addresses can be bound."""
    first_error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's server does
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
        except OSError as e:
            sock.close()
            first_error = first_error or e
            continue
        return sock
    raise first_error or OSError(errno.EADDRNOTAVAIL, f"{host!r} resolves to no address")


def listening_store(host: str, port: int, world_size: int | None, timeout_s: float, *,
                    wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on `host` only (torch's own listens on every interface).

    When `host` is not an address of this machine (other nodes reach it through a NAT or a
    forwarded port), the store can only listen on every interface, as torch's does; that is
    logged. Raises OSError when the port is taken.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        sock = bound_listener(host, port)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise OSError(e.errno, f"cannot listen on {host}:{port} for a TCPStore: {e.strerror or e}") from e
        log.warning("%s is not an address of this machine: its TCPStore (no authentication) listens on every "
                    "interface; give an address of this machine to keep it on one", host)
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    bound_port = sock.getsockname()[1]
    # The store owns the socket from here (it closes it with its server).
    return dist.TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


class WeightGroup:
    """A standalone process group; transport.broadcast calls `start_broadcast` on it."""

    def __init__(self, pg: Backend, rank: int, world_size: int, backend: str,
                 store: dist.Store | None = None) -> None:
        self.pg: Backend | None = pg  # None once closed
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._store = store  # rank 0 keeps the store's server alive as long as the group

    @staticmethod
    def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store server on a free port (`.port`) of `host` only, not waiting for the others
        to connect."""
        return listening_store(host, 0, world_size, timeout_s, wait_for_workers=False)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
             timeout_s: float = 300.0, name: str = "weights", store: dist.Store | None = None,
             local_host: str | None = None, sglang: bool = False) -> WeightGroup:
        """Join the group (blocks until every member has); rank 0 passes the store it opened.

        `sglang`: with SGLang's store keys and sequence-number step (module docstring), `name`
        being SGLang's `group_name`.

        `local_host`: the address this member's gloo connections use (its node's, in a multi-node
        run); without it, loopback when the store is on loopback (all members on this machine),
        else gloo picks by resolving the machine's hostname (GLOO_SOCKET_IFNAME).
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if not local_host and is_loopback(host):
            local_host = host
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(name, store)
        if sglang:
            device = "cuda" if backend == "nccl" else "cpu"
            prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", prefixed))
        pg: Backend
        # The type: ignores below: torch's stubs (torch/_C/_distributed_c10d.pyi) lack what its
        # pybind classes have: NCCL's default `options`, gloo's `_Options` and its constructor
        # overload that takes them.
        if backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)  # type: ignore[call-arg]
        elif local_host:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            options._timeout = timeout
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        if sglang:  # rank 0 writes a sequence number that the others wait for, as torch's own groups do
            pg._set_sequence_number_for_group()
        return cls(pg, rank, world_size, backend, store)

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start broadcasting `tensor` from group rank `src`; `.wait()` on the result."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        assert self.pg is not None, "broadcast on a closed WeightGroup"
        # torch's stubs declare `broadcast` on ProcessGroup only; its Backend pybind class has it too
        return self.pg.broadcast([tensor], opts)  # type: ignore[attr-defined]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def close(self) -> None:
        """Drop the group; a peer blocked in a collective with it then fails instead of hanging."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None
        self._store = None
