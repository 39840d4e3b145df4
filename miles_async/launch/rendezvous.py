"""Multi-node rendezvous: every node's launcher meets node 0, proves it holds the run's secret
and gets the run's CURVE keys and the list of nodes.

`miles-async launch --nnodes N --node-rank R --master-addr A --master-port P RECIPE.toml` runs
on every node, torchrun style. Each launcher calls `rendezvous(...)`; it returns the same
`Rendezvous` on every node (run id, the nodes by rank) once all N have arrived, and writes this
node's copy of the run's CURVE keypair into `key_dir`, laid out exactly as
`miles_async.runtime.security.generate_run_keys` lays it out (folder 0700, `run.key` and
`run.key_secret` 0600), so `security.load_run_keys(key_dir)` works on every node.

Protocol (keys of torch.distributed's TCPStore, all under the prefix `rdzv/`)
-------------------------------------------------------------------------------
Node 0 hosts the store (`TCPStore(A, P, is_master=True)`, as torchrun does), then:

1. node 0 writes `run_id` (`secrets.token_hex(16)`, fresh per run) and `meta` (JSON: its
   nnodes and version, for early, local error messages);
2. every node (node 0 included) waits for `run_id`, claims its rank with `add("claim/R", 1)`
   (a result above 1 means a second launcher holds the same rank: it writes `dup/R` and node 0
   aborts), then writes `node/R` = JSON `{info: NodeInfo, nnodes, proof}` where
   `proof = HMAC-SHA256(secret, "run_id|R|nnodes|version|host")` in hex;
3. node 0 reads each `node/R` as it arrives and checks the rank, the proof, the version and
   nnodes; at the first problem (or when `timeout_s` passes with nodes missing, or on a
   duplicate rank) it writes `abort` = JSON `{reason, tag}` (tag: HMAC of the reason under the
   secret and run id) and raises; every other node raises "node R: the run was aborted by
   node 0: <reason>" (and counts itself in `ack`: node 0 keeps the store up for at most 3 s
   after its verdict, until all that arrived have read it);
4. when all N verify, node 0 writes, for each node R > 0, `keys/R` = seal(JSON `{run_id,
   public, secret, nodes}`) for (run id, R, "keys"): the two key files' bytes and the node
   list, encrypted and authenticated for that node (below), then `go`. Every node opens its
   `keys/R`, checks that the run id in it is the run's, writes the key files into its
   `key_dir`, counts itself in `ack` and returns; node 0 returns once all have (or after 3 s,
   with a warning).

Late joins (after `go`)
-----------------------
A node can also arrive once the run is going: a node whose processes died comes back (a new
launcher with the same --node-rank), or an elastic rollout node whose rank was not part of the
initial rendezvous (e.g. `--nnodes 3 --node-rank 2` when the run started with 2 nodes). Both
take the same path: `rendezvous(...)` on a node other than 0 reads `run_id` and `meta`, and if
`go` is set it joins instead of arriving (a launcher whose rank is beyond node 0's initial
nnodes first waits for `go`, or `abort`, within `timeout_s` + 5 s: it cannot take part in the
initial rendezvous). Joining:

1. the joiner takes a sequence number `S = add("join/seq", 1)` and writes `join/S` = JSON
   `{info: NodeInfo, nnodes, proof}` with `proof = HMAC-SHA256(secret, "join|run_id/join/S|
   nnodes|" + JSON(info))`: bound to the run, to S and to the whole NodeInfo (host, pid,
   extra...), so a proof cannot be replayed in another run or under another number, nor an
   arrival altered;
2. node 0's launcher, while the run goes on, serves joins with `JoinServer.poll(accept,
   timeout_s)` (from a background thread, say), in sequence order. It checks the proof and
   that the version equals node 0's, then asks `accept(info)`: the launcher's policy (None
   admits the node; a string refuses it, with that reason: "node 1 is still in the run").
   Admitted: node 0 writes `join/S/keys` = seal(JSON `{run_id, public, secret, nodes}`), the
   same payload as `keys/R`, with the current node list, the joiner included (a rank that
   rejoins replaces its old entry), sealed for (run id, R, "join/S") so that an answer cannot be
   moved to another request or node. Refused or not verified: `join/S/abort` = `{reason, tag}`, the
   tag an HMAC of the reason for "run_id/join/S"; the joiner raises "node 0 refused node R's
   join: <reason>";
3. the joiner waits for its answer within `timeout_s`; without one it writes `join/S/gone`
   (node 0 then skips the request) and raises. With keys, it checks them as at `go` (and that
   the list holds it as it arrived), writes its `key_dir` and returns like any other node.

Why node 0 decides, and why a rejoin reuses a rank: a rank names a place in the run (its
engines, its share of the work), not a process; a node that comes back takes its old place.
Two launchers with one rank are an error during the initial rendezvous (`claim/R`), but after
`go` the joiner's own view cannot tell a restart from a mistake: only node 0's launcher knows
whether the old node 1 is gone (its heartbeats stopped) or still in the run, so the duplicate
check does not apply to joins and `accept` decides. Likewise a joiner's --nnodes need not equal
node 0's (an elastic fleet grows past the initial count); it only has to cover its own rank.
A join request is never an abort of the run: a refusal or a bad proof refuses that request and
node 0 serves the next. Sequence numbers that never get an arrival (a launcher that died
between the two writes) are refused after 5 s, so they do not hold up the requests behind them.

Encryption: `seal` / `unseal` (`miles_async/launch/sealing.py`, which says why the construction is sound):
ChaCha20-Poly1305 from `cryptography` under a key HKDF derives from the secret and the run id,
each sealed blob bound to the run, the node and the purpose it is for.

Security argument
-----------------
The TCPStore has no authentication (its master listens on node 0's address A only, but the
network between nodes is not trusted): anyone who can reach A:P can read and write every key. So nothing in it is trusted
for what it says, only for what it proves:

* the run's CURVE keys travel only sealed under the shared secret: reading the store gives an
  attacker ciphertext, and a forged, altered or moved `keys/R` fails its tag, so a node never
  installs keys that node 0 did not send it (it fails: "the keys from node 0 do not verify:
  <why>");
* a launcher without the secret cannot produce a proof that verifies, so node 0 refuses it
  (and aborts the run rather than hand out keys); proofs bind the run id, so a proof seen in
  one run is worthless in another; the node list is inside the sealed payload, so the
  addresses the nodes go on to connect to are node 0's, not an attacker's;
* joins get the same treatment: the keys for a join are sealed for that request and node, the
  refusals are tagged, and a join proof binds the run, the request and the whole NodeInfo;
* what such an attacker CAN still do is deny service: write `abort`, garbage in `node/R`,
  `claim/R` or `dup/R`, or `run_id` before node 0 does, and the rendezvous fails (bounded by
  `timeout_s`, with an error); after `go`, garbage, `abort` or `gone` under `join/S`, or a
  bump of `join/seq`, refuses or delays joins (node 0 refuses what does not verify). An
  `abort` whose tag does not verify says so in the error ("this abort does not verify..."; a
  refusal: "this refusal does not verify..."), so an operator can tell interference from a
  real abort, but the run stops either way. Keep P behind the cluster's firewall; the secret protects the
  keys, not the run's availability.

The secret comes from `MILES_ASYNC_SECRET` or a file (`load_secret`); make one with
`python -c "import secrets; print(secrets.token_hex(32))" > secret` and copy it to every node.

Try it on one machine (two shells, same secret):

    export MILES_ASYNC_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))")
    python -c "from miles_async.launch.rendezvous import *; r, s = rendezvous(nnodes=2, \
node_rank=0, master_addr='127.0.0.1', master_port=29500, secret=load_secret(), \
host='127.0.0.1', key_dir='/tmp/k0'); print(r)"
    # in the second shell: node_rank=1, key_dir='/tmp/k1'

and to try a join, end node 0's command with `j = JoinServer(s, r, load_secret()); \
print(j.poll(lambda info: None, 60))` and, once both have met, run node_rank=2 with nnodes=3.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import hmac
import logging
import os
import secrets as _secrets
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

import miles_async
from miles_async.launch.sealing import SealError, seal, unseal
from miles_async.runtime import security

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

SECRET_ENV = "MILES_ASYNC_SECRET"
MIN_SECRET_BYTES = 16
MAKE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))" > secret'
PREFIX = "rdzv/"
POLL_S = 0.02
# How much longer than timeout_s a non-zero node waits for node 0's verdict (node 0 may have
# started a little later, and verifying and sealing take a moment).
MARGIN_S = 5.0
# How long node 0 keeps the store up, after its verdict, for the others to read it and say so.
GRACE_S = 3.0
# How often JoinServer.poll looks for join requests while it waits.
JOIN_POLL_S = 0.05
# A join sequence number taken but whose arrival is not written within this long is refused
# (its launcher died between the two writes), so it does not hold up the requests behind it.
GAP_S = 5.0
# How many sequence numbers past its cursor JoinServer looks at in one pass.
JOIN_WINDOW = 64


class RendezvousError(RuntimeError):
    """The rendezvous failed; the message names the node(s) and the cause."""


class _DuplicateClaim(RendezvousError):
    """A second launcher claimed a rank during the initial rendezvous."""


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    host: str  # the address other nodes reach this node at
    hostname: str
    pid: int
    version: str
    num_gpus: int
    extra: dict[str, str] = {}


class Rendezvous(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    nodes: list[NodeInfo]  # by rank
    key_dir: str  # this node's copy of the run's CURVE keys (0700 folder, 0600 files)
    master_addr: str
    master_port: int


class _Arrival(msgspec.Struct, frozen=True, kw_only=True):
    info: NodeInfo
    nnodes: int
    proof: str


class _Meta(msgspec.Struct, frozen=True, kw_only=True):
    nnodes: int
    version: str


class _Abort(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    tag: str


class _Payload(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    public: bytes  # the bytes of run.key
    secret: bytes  # the bytes of run.key_secret
    nodes: list[NodeInfo]


# ---------------------------------------------------------------------------------------------
# the secret


def load_secret(secret_file: str | None = None, env: Mapping[str, str] = os.environ) -> bytes:
    """The run's shared secret: the contents of `secret_file` (stripped), else `$MILES_ASYNC_SECRET`.

    A file that group or others may read is used, with a warning. Raises ValueError when
    neither is set or the secret is shorter than 16 bytes.
    """
    if secret_file is not None:
        path = Path(secret_file)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            value = path.read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {secret_file}: {e.strerror or e}") from e
        if mode & 0o077:
            log.warning("the secret file %s is readable by group or others (mode %o): chmod 600 %s",
                        secret_file, mode, secret_file)
        where = f"the secret file {secret_file}"
    else:
        text = env.get(SECRET_ENV)
        if not text or not text.strip():
            raise ValueError(
                f"no secret for this run: set {SECRET_ENV} or pass a secret file; make one with "
                f"`{MAKE_SECRET}` and copy it to every node")
        value = text.strip().encode()
        where = f"${SECRET_ENV}"
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the secret in {where} is {len(value)} bytes; it needs at least {MIN_SECRET_BYTES}: "
            f"make one with `{MAKE_SECRET}`")
    return value


def _proof(secret: bytes, run_id: str, info: NodeInfo, nnodes: int) -> str:
    data = f"{run_id}|{info.rank}|{nnodes}|{info.version}|{info.host}".encode()
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _abort_tag(secret: bytes, run_id: str, reason: str) -> str:
    return hmac.new(secret, f"abort|{run_id}|{reason}".encode(), hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------------------------
# the store


class StoreHandle:
    """This node's connection to the run's TCPStore; on node 0 it also keeps the store alive.

    Hold it for the run (heartbeats, a rejoin); `close()` releases it (on node 0 that stops
    the store's server). Waits poll `check` with a deadline, so none outlives its timeout.
    """

    def __init__(self, store: object, *, is_master: bool, master_addr: str, master_port: int,
                 node_rank: int) -> None:
        self._store = store
        self.is_master = is_master
        self.master_addr = master_addr
        self.master_port = master_port
        self.node_rank = node_rank

    @property
    def store(self):  # the torch.distributed.TCPStore itself
        if self._store is None:
            raise RendezvousError(f"node {self.node_rank}: the store handle is closed")
        return self._store

    @property
    def closed(self) -> bool:
        return self._store is None

    def _call(self, what: str, fn, *args):
        from torch.distributed import DistError

        try:
            return fn(*args)
        except DistError as e:
            raise RendezvousError(
                f"node {self.node_rank}: lost the store at {self.master_addr}:{self.master_port} "
                f"({what}): {_first_line(e)}") from e

    def set(self, key: str, value: bytes | str) -> None:
        self._call(f"set {key}", self.store.set, key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key}", self.store.add, key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", self.store.check, list(keys)))

    def wait_any(self, keys: Sequence[str], timeout_s: float) -> str | None:
        """The first of `keys` (in order) that is set within `timeout_s`, or None."""
        deadline = time.monotonic() + timeout_s
        while True:
            for key in keys:
                if self.check([key]):
                    return key
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Return once all `keys` are set; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{', '.join(keys)} not set within {timeout_s:g} s")
            time.sleep(POLL_S)

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key` once set; TimeoutError after `timeout_s`."""
        self.wait([key], timeout_s)
        return bytes(self._call(f"get {key}", self.store.get, key))

    def close(self) -> None:
        self._store = None  # the TCPStore (and, on node 0, its server) goes with its last reference

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _listen_cause(e: BaseException) -> str:
    text = str(e).lower()  # torch's DistError says EADDRINUSE; an OSError, "Address already in use"
    if "eaddrinuse" in text or "address already in use" in text:
        return "address already in use (another run, or pick another --master-port)"
    if "eaddrnotavail" in text:
        return "the address is not one of this host's"
    if "eacces" in text:
        return "permission denied (ports below 1024 need root)"
    return _first_line(e)


def _start_master(addr: str, port: int, timeout_s: float) -> object:
    from torch.distributed import DistError

    from miles_async.transport.groups import listening_store

    try:  # on `addr` only (torch's own master would listen on every interface)
        return listening_store(addr, port, None, max(timeout_s, 1.0), wait_for_workers=False)
    except (DistError, OSError) as e:
        raise RendezvousError(f"node 0: cannot listen on {addr}:{port}: {_listen_cause(e)}") from e


def _connect(addr: str, port: int, rank: int, timeout_s: float, deadline: float) -> object:
    """A client TCPStore, retried until `deadline`.

    TCPStore's own connect retries with a randomized backoff that can overshoot its timeout by
    seconds, so a plain TCP connect probes first and TCPStore only connects to a live port.
    """
    from torch.distributed import DistError, TCPStore

    last = "nothing listens there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"node {rank}: node 0 did not answer at {addr}:{port} within {timeout_s:g} s ({last})")
        try:
            with socket.create_connection((addr, port), timeout=min(left, 1.0)):
                pass
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
            continue
        try:
            return TCPStore(addr, port, None, False, datetime.timedelta(seconds=max(left, 1.0)))
        except DistError as e:
            last = _first_line(e)
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


# ---------------------------------------------------------------------------------------------
# key files


def _write_keys(key_dir: str | Path, public: bytes, secret: bytes) -> Path:
    """Lay the keypair out as security.generate_run_keys does: folder 0700, files 0600."""
    key_dir = Path(key_dir)
    key_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(key_dir, 0o700)
    for old in key_dir.glob(f"{security.KEY_NAME}.key*"):
        old.unlink()
    for name, data in ((f"{security.KEY_NAME}.key", public), (f"{security.KEY_NAME}.key_secret", secret)):
        fd = os.open(key_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(key_dir / name, 0o600)
    return key_dir


def _fresh_keys() -> tuple[bytes, bytes]:
    with tempfile.TemporaryDirectory(prefix="miles-async-keys-") as tmp:
        folder = security.generate_run_keys(Path(tmp) / "keys")
        public = (folder / f"{security.KEY_NAME}.key").read_bytes()
        secret = (folder / f"{security.KEY_NAME}.key_secret").read_bytes()
    return public, secret


# ---------------------------------------------------------------------------------------------
# the rendezvous


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "none"


def rendezvous(*, nnodes: int, node_rank: int, master_addr: str, master_port: int, secret: bytes,
               host: str, key_dir: str, timeout_s: float = 60.0, num_gpus: int = 0,
               version: str | None = None, extra: Mapping[str, str] | None = None,
               ) -> tuple[Rendezvous, StoreHandle]:
    """Meet the run's other nodes at `master_addr:master_port` (see the module docstring).

    Returns the run's `Rendezvous` (the same on every node, but for `key_dir`) and the handle
    of the store, which the caller holds for the run (on node 0 it keeps the store alive).
    Raises RendezvousError naming the node(s) and the cause; never takes much over `timeout_s`
    + 3 s (node 0: the grace for the others to read its verdict) or `timeout_s` + 5 s (the
    others: node 0 may have started later). `extra` lands in this node's `NodeInfo.extra`.

    On a node other than 0, when the run is already going (node 0 wrote `go`) this joins it
    instead (see "Late joins"): node 0's launcher admits or refuses the node, and a refusal
    raises RendezvousError("node 0 refused node R's join: <reason>"). A joiner's `nnodes`
    need not equal node 0's; it only has to cover `node_rank`. A joiner whose rank is beyond
    node 0's nnodes waits for the run to start (up to `timeout_s` + 5 s), then joins; the join
    itself waits up to `timeout_s` for node 0's answer.
    """
    if nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
    start = time.monotonic()
    deadline = start + timeout_s
    info = NodeInfo(rank=node_rank, host=host, hostname=socket.gethostname(), pid=os.getpid(),
                    version=version if version is not None else miles_async.__version__,
                    num_gpus=num_gpus, extra=dict(extra or {}))

    if node_rank == 0:
        _check_master_addr(master_addr)
        store = _start_master(master_addr, master_port, timeout_s)
    else:
        store = _connect(master_addr, master_port, node_rank, timeout_s, deadline)
    handle = StoreHandle(store, is_master=node_rank == 0, master_addr=master_addr,
                         master_port=master_port, node_rank=node_rank)
    try:
        if node_rank == 0:
            result = _lead(handle, info, nnodes, secret, key_dir, timeout_s, deadline)
        else:
            result = _follow(handle, info, nnodes, secret, key_dir, timeout_s, deadline + MARGIN_S,
                             deadline)
    except BaseException:
        handle.close()
        raise
    return result, handle


def _check_master_addr(addr: str) -> None:
    # Node 0 must own `addr`: its store listens there, and a node 0 on a host that does not would
    # wait alone while the others meet nobody (or another node 0).
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            log.warning("node 0: --master-addr %s is not an address of this host (%s); the other "
                        "nodes will look for node 0 there", addr, socket.gethostname())


def _arrive(handle: StoreHandle, info: NodeInfo, nnodes: int, secret: bytes, run_id: str) -> None:
    rank = info.rank
    arrival = msgspec.json.encode(
        _Arrival(info=info, nnodes=nnodes, proof=_proof(secret, run_id, info, nnodes)))
    if handle.add(f"{PREFIX}claim/{rank}", 1) > 1:
        handle.set(f"{PREFIX}dup/{rank}", arrival)
        first = "?"
        with contextlib.suppress(TimeoutError, msgspec.DecodeError, RendezvousError):
            first = msgspec.json.decode(handle.get(f"{PREFIX}node/{rank}", 1.0), type=_Arrival).info.host
        raise _DuplicateClaim(f"two launchers claim node rank {rank} (hosts {first} and {info.host})")
    handle.set(f"{PREFIX}node/{rank}", arrival)


def _verify(arrival: bytes, rank: int, nnodes: int, secret: bytes, run_id: str, version: str) -> NodeInfo:
    try:
        a = msgspec.json.decode(arrival, type=_Arrival)
    except msgspec.DecodeError as e:
        raise RendezvousError(f"node {rank} sent an arrival that does not parse: {e}") from e
    if a.info.rank != rank:
        raise RendezvousError(f"node {rank}: its arrival says rank {a.info.rank}")
    if not hmac.compare_digest(a.proof, _proof(secret, run_id, a.info, a.nnodes)):
        raise RendezvousError(f"node {rank} does not hold this run's secret (its proof does not verify)")
    if a.info.version != version:
        raise RendezvousError(f"node {rank} runs miles-async {a.info.version} but node 0 runs {version}")
    if a.nnodes != nnodes:
        raise RendezvousError(f"node {rank} was launched with --nnodes {a.nnodes} but node 0 with --nnodes {nnodes}")
    return a.info


def _abort(handle: StoreHandle, secret: bytes, run_id: str, reason: str, nnodes: int) -> None:
    """Write the verdict, then keep the store up until every node that arrived has read it."""
    with contextlib.suppress(RendezvousError):
        handle.set(f"{PREFIX}abort", msgspec.json.encode(
            _Abort(reason=reason, tag=_abort_tag(secret, run_id, reason))))
        arrived = sum(handle.check([f"{PREFIX}node/{r}"]) for r in range(1, nnodes))
        _await_acks(handle, arrived)


def _await_acks(handle: StoreHandle, expected: int) -> bool:
    """Wait (up to GRACE_S) until `expected` other nodes have read node 0's verdict."""
    deadline = time.monotonic() + GRACE_S
    while handle.add(f"{PREFIX}ack", 0) < expected:
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _lead(handle: StoreHandle, info: NodeInfo, nnodes: int, secret: bytes, key_dir: str,
          timeout_s: float, deadline: float) -> Rendezvous:
    run_id = _secrets.token_hex(16)
    handle.set(f"{PREFIX}meta", msgspec.json.encode(_Meta(nnodes=nnodes, version=info.version)))
    handle.set(f"{PREFIX}run_id", run_id)
    try:
        _arrive(handle, info, nnodes, secret, run_id)
        nodes: dict[int, NodeInfo] = {}
        while len(nodes) < nnodes:
            for rank in range(nnodes):
                if handle.check([f"{PREFIX}dup/{rank}"]):
                    first = nodes[rank].host if rank in nodes else "?"
                    try:
                        second = msgspec.json.decode(
                            handle.get(f"{PREFIX}dup/{rank}", 1.0), type=_Arrival).info.host
                    except (msgspec.DecodeError, TimeoutError):
                        second = "?"
                    raise RendezvousError(f"two launchers claim node rank {rank} (hosts {first} and {second})")
                if rank not in nodes and handle.check([f"{PREFIX}node/{rank}"]):
                    nodes[rank] = _verify(handle.get(f"{PREFIX}node/{rank}", 1.0), rank, nnodes, secret,
                                          run_id, info.version)
            if len(nodes) == nnodes:
                break
            if time.monotonic() >= deadline:
                missing = [r for r in range(nnodes) if r not in nodes]
                raise RendezvousError(f"node(s) {_ranks(missing)} did not arrive within {timeout_s:g} s "
                                      f"(arrived: {_ranks(sorted(nodes))})")
            time.sleep(POLL_S)
    except RendezvousError as e:
        _abort(handle, secret, run_id, str(e), nnodes)
        raise
    except TimeoutError as e:  # a key seen by check() then not readable: should not happen
        reason = f"node 0: the store lost a key: {e}"
        _abort(handle, secret, run_id, reason, nnodes)
        raise RendezvousError(reason) from e

    public, key_secret = _fresh_keys()
    ordered = [nodes[r] for r in range(nnodes)]
    payload = msgspec.json.encode(_Payload(run_id=run_id, public=public, secret=key_secret, nodes=ordered))
    for rank in range(1, nnodes):  # one blob per node, sealed for it: none opens for another
        handle.set(f"{PREFIX}keys/{rank}", seal(secret, payload, run_id=run_id, rank=rank, purpose="keys"))
    handle.set(f"{PREFIX}go", b"1")
    _write_keys(key_dir, public, key_secret)
    if not _await_acks(handle, nnodes - 1):
        log.warning("node 0: not every node confirmed it read the keys within %g s", GRACE_S)
    return Rendezvous(run_id=run_id, nodes=ordered, key_dir=str(key_dir),
                      master_addr=handle.master_addr, master_port=handle.master_port)


def _follow(handle: StoreHandle, info: NodeInfo, nnodes: int, secret: bytes, key_dir: str,
            timeout_s: float, deadline: float, join_deadline: float) -> Rendezvous:
    """The initial rendezvous for a node other than 0, or a join when the run is already going."""
    rank = info.rank
    where = f"{handle.master_addr}:{handle.master_port}"

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    try:
        run_id = handle.get(f"{PREFIX}run_id", left()).decode()
        meta = msgspec.json.decode(handle.get(f"{PREFIX}meta", left()), type=_Meta)
    except (TimeoutError, msgspec.DecodeError, UnicodeDecodeError) as e:
        raise RendezvousError(f"node {rank}: the store at {where} holds no run from node 0 ({e})") from e
    go, abort = f"{PREFIX}go", f"{PREFIX}abort"
    if handle.check([go]):  # the run is going: join it
        return _join(handle, info, nnodes, secret, run_id, key_dir, timeout_s, join_deadline)
    if rank >= meta.nnodes:
        # Not a place of the initial rendezvous (an elastic node): wait for the run, then join.
        got = handle.wait_any([abort, go], left())
        if got is None:
            raise RendezvousError(
                f"node {rank}: node 0 was launched with --nnodes {meta.nnodes} (ranks "
                f"0..{meta.nnodes - 1}), so this node can only join the run once it has started, "
                f"and it did not start within {timeout_s:g} s (+{MARGIN_S:g} s)")
        if got == abort:
            raise RendezvousError(_abort_message(handle.get(abort, 1.0), rank, secret, run_id, where))
        return _join(handle, info, nnodes, secret, run_id, key_dir, timeout_s,
                     time.monotonic() + timeout_s)
    try:
        _arrive(handle, info, nnodes, secret, run_id)
    except _DuplicateClaim:
        if not handle.check([go]):
            raise
        # `go` came between the check above and the claim: this is a rejoin, node 0 decides.
        return _join(handle, info, nnodes, secret, run_id, key_dir, timeout_s, join_deadline)

    got = handle.wait_any([f"{PREFIX}abort", f"{PREFIX}go"], left())
    if got is None:
        raise RendezvousError(f"node {rank}: node 0 at {where} did not finish the rendezvous within "
                              f"{timeout_s:g} s (+{MARGIN_S:g} s)")
    try:
        return _verdict(handle, got, info, nnodes, secret, run_id, key_dir, where)
    finally:
        with contextlib.suppress(RendezvousError):
            handle.add(f"{PREFIX}ack", 1)  # node 0 keeps the store up until all have read it


def _verdict(handle: StoreHandle, got: str, info: NodeInfo, nnodes: int, secret: bytes, run_id: str,
             key_dir: str, where: str) -> Rendezvous:
    rank = info.rank
    if got.endswith("abort"):
        raise RendezvousError(_abort_message(handle.get(got, 1.0), rank, secret, run_id, where))
    return _take_keys(handle, f"{PREFIX}keys/{rank}", secret, "keys", run_id, info, key_dir, nnodes=nnodes)


def _take_keys(handle: StoreHandle, key: str, secret: bytes, purpose: str, run_id: str, info: NodeInfo,
               key_dir: str, *, nnodes: int | None = None) -> Rendezvous:
    """Unseal node 0's answer at `key` (sealed for this node and `purpose`), check it names this
    node as it arrived (and, for the initial rendezvous, holds `nnodes` nodes), and write the
    run's keys."""
    rank = info.rank
    try:
        plaintext = unseal(secret, handle.get(key, 1.0), run_id=run_id, rank=rank, purpose=purpose)
    except TimeoutError as e:
        raise RendezvousError(f"node {rank}: node 0 answered, but the store holds no keys for this node "
                              f"({e}): someone else who can reach the port removed them?") from e
    except SealError as e:
        why = f"this node's secret differs from node 0's ({e})" if e.cause == "secret" else str(e)
        raise RendezvousError(f"node {rank}: the keys from node 0 do not verify: {why}") from e
    try:
        payload = msgspec.json.decode(plaintext, type=_Payload)
    except msgspec.DecodeError as e:  # it verified: node 0 wrote it, in a layout this node does not read
        raise RendezvousError(f"node {rank}: the keys from node 0 verify but do not parse ({e}): does "
                              f"node 0 run another version?") from e
    if payload.run_id != run_id:
        raise RendezvousError(f"node {rank}: the keys from node 0 are for run {payload.run_id}, not {run_id}")
    if (nnodes is not None and len(payload.nodes) != nnodes) or [n for n in payload.nodes if n.rank == rank] != [info]:
        raise RendezvousError(f"node {rank}: node 0's list of nodes does not hold this node as it arrived")
    _write_keys(key_dir, payload.public, payload.secret)
    return Rendezvous(run_id=run_id, nodes=payload.nodes, key_dir=str(key_dir),
                      master_addr=handle.master_addr, master_port=handle.master_port)


def _read_abort(raw: bytes, secret: bytes, ad: str) -> tuple[str | None, bool]:
    """An abort or refusal from the store: (its reason, None when it does not parse; whether its tag
    verifies with this node's secret, i.e. node 0 wrote it)."""
    try:
        abort = msgspec.json.decode(raw, type=_Abort)
    except msgspec.DecodeError:
        return None, False
    return abort.reason, hmac.compare_digest(abort.tag, _abort_tag(secret, ad, abort.reason))


def _abort_message(raw: bytes, rank: int, secret: bytes, run_id: str, where: str) -> str:
    reason, verified = _read_abort(raw, secret, run_id)
    if reason is None:
        return (f"node {rank}: the run was aborted: the store at {where} holds an `abort` that does "
                f"not parse (not node 0's: someone else who can reach the port wrote it)")
    if verified:
        return f"node {rank}: the run was aborted by node 0: {reason}"
    return (f"node {rank}: the run was aborted: {reason} (this abort does not verify with this "
            f"node's secret: either it differs from node 0's, or someone else who can reach {where} "
            f"wrote it)")


# ---------------------------------------------------------------------------------------------
# late joins


def _join_ad(run_id: str, seq: int) -> str:
    """What a join's proof, keys and refusal are bound to: the run and the request."""
    return f"{run_id}/join/{seq}"


def _join_purpose(seq: int) -> str:
    """What the sealed answer to join request `seq` is for (the run and the node are bound too)."""
    return f"join/{seq}"


def _join_proof(secret: bytes, ad: str, info: NodeInfo, nnodes: int) -> str:
    data = f"join|{ad}|{nnodes}|".encode() + msgspec.json.encode(info)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _join(handle: StoreHandle, info: NodeInfo, nnodes: int, secret: bytes, run_id: str, key_dir: str,
          timeout_s: float, deadline: float) -> Rendezvous:
    """Ask node 0 to let this node into the running run; its keys and the node list, or raise."""
    rank = info.rank
    where = f"{handle.master_addr}:{handle.master_port}"
    seq = handle.add(f"{PREFIX}join/seq", 1)
    base, ad = f"{PREFIX}join/{seq}", _join_ad(run_id, seq)
    handle.set(base, msgspec.json.encode(
        _Arrival(info=info, nnodes=nnodes, proof=_join_proof(secret, ad, info, nnodes))))
    got = handle.wait_any([f"{base}/abort", f"{base}/keys"], max(deadline - time.monotonic(), 0.0))
    if got is None:
        with contextlib.suppress(RendezvousError):
            handle.set(f"{base}/gone", b"1")  # node 0 skips it, should it get to it later
        raise RendezvousError(
            f"node {rank}: the run at {where} is going, but node 0 did not answer this node's join "
            f"(request {seq}) within {timeout_s:g} s: is node 0's launcher serving joins?")
    if got.endswith("abort"):
        raise RendezvousError(_refusal_message(handle.get(got, 1.0), rank, secret, ad, where))
    return _take_keys(handle, got, secret, _join_purpose(seq), run_id, info, key_dir)


def _refusal_message(raw: bytes, rank: int, secret: bytes, ad: str, where: str) -> str:
    reason, verified = _read_abort(raw, secret, ad)
    if reason is None:
        return (f"node {rank}'s join was refused: the store at {where} holds a refusal that does not "
                f"parse (not node 0's: someone else who can reach the port wrote it)")
    if verified:
        return f"node 0 refused node {rank}'s join: {reason}"
    return (f"node {rank}'s join was refused: {reason} (this refusal does not verify with this "
            f"node's secret: either it differs from node 0's, or someone else who can reach {where} "
            f"wrote it)")


class JoinServer:
    """Node 0's side of late joins: admits or refuses the nodes that join the running run.

    Node 0's launcher makes one after its `rendezvous(...)` and calls `poll` from one thread
    (a background thread, say) for as long as the run goes on. It keeps the current node list
    (`nodes`): the initial nodes, plus each node it admits, a rank that rejoins replacing its
    old entry. The run's keys are `public` and `secret_key` (the bytes of `run.key` and
    `run.key_secret`), by default read from `rdzv.key_dir`.
    """

    def __init__(self, handle: StoreHandle, rdzv: Rendezvous, secret: bytes, public: bytes | None = None,
                 secret_key: bytes | None = None, *, version: str | None = None) -> None:
        if not handle.is_master:
            raise ValueError(f"node {handle.node_rank}: only node 0 serves joins")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the secret is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
        if (public is None) != (secret_key is None):
            raise ValueError("pass both public and secret_key, or neither (they are read from rdzv.key_dir)")
        if public is None or secret_key is None:
            folder = Path(rdzv.key_dir)
            public = (folder / f"{security.KEY_NAME}.key").read_bytes()
            secret_key = (folder / f"{security.KEY_NAME}.key_secret").read_bytes()
        self._handle = handle
        self._rdzv = rdzv
        self._secret = secret
        self._public = public
        self._secret_key = secret_key
        self._nodes = {n.rank: n for n in rdzv.nodes}
        if version is None:  # node 0's, as it arrived
            version = self._nodes[0].version if 0 in self._nodes else miles_async.__version__
        self._version = version
        self._next = 1  # the lowest sequence number not yet handled
        self._done: set[int] = set()  # handled, above _next
        self._gap_since: dict[int, float] = {}  # numbers taken, arrival not yet written: since when
        self._lock = threading.Lock()

    @property
    def nodes(self) -> list[NodeInfo]:
        """The run's nodes now, by rank (ranks may have holes: an elastic node that never came)."""
        nodes = self._nodes
        return [nodes[r] for r in sorted(nodes)]

    @property
    def rendezvous(self) -> Rendezvous:
        """Node 0's `Rendezvous` with the current node list."""
        return Rendezvous(run_id=self._rdzv.run_id, nodes=self.nodes, key_dir=self._rdzv.key_dir,
                          master_addr=self._rdzv.master_addr, master_port=self._rdzv.master_port)

    def poll(self, accept: Callable[[NodeInfo], str | None], timeout_s: float) -> NodeInfo | None:
        """Serve the join requests that have arrived, in order, until one is admitted.

        Each request is verified (its proof, its version equal to node 0's); one that fails is
        refused with the cause, logged, and the next is served. A verified one goes to
        `accept(info)`: None admits it (node 0 writes the sealed keys and the node list, with it,
        and returns its NodeInfo), a string refuses it with that reason. Returns None when no
        request was admitted within `timeout_s` (also when another call holds the server for
        that long). Never waits longer than `timeout_s` on its own, plus the time of `accept`.
        If `accept` raises, the request is refused ("node 0 failed to decide") and the error
        propagates. RendezvousError when the store is gone.
        """
        timeout_s = max(timeout_s, 0.0)
        deadline = time.monotonic() + timeout_s
        if not (self._lock.acquire(timeout=timeout_s) if timeout_s > 0 else self._lock.acquire(blocking=False)):
            return None
        try:
            while True:
                info = self._pass(accept)
                left = deadline - time.monotonic()
                if info is not None or left <= 0:
                    return info
                time.sleep(min(JOIN_POLL_S, left))
        finally:
            self._lock.release()

    def _pass(self, accept: Callable[[NodeInfo], str | None]) -> NodeInfo | None:
        handle = self._handle
        top = handle.add(f"{PREFIX}join/seq", 0)
        for seq in range(self._next, min(top, self._next + JOIN_WINDOW - 1) + 1):
            if seq < self._next or seq in self._done:  # handled (the cursor may move during a pass)
                continue
            base = f"{PREFIX}join/{seq}"
            if not handle.check([base]):
                since = self._gap_since.setdefault(seq, time.monotonic())
                if time.monotonic() - since >= GAP_S:
                    self._refuse(seq, None, f"join request {seq} did not arrive within {GAP_S:g} s "
                                            f"of taking its number")
                continue
            if handle.check([f"{base}/gone"]):
                log.info("node 0: join request %d was given up by its node before node 0 got to it", seq)
                self._finish(seq)
                continue
            info = self._serve(seq, base, accept)
            if info is not None:
                return info
        return None

    def _serve(self, seq: int, base: str, accept: Callable[[NodeInfo], str | None]) -> NodeInfo | None:
        ad = _join_ad(self._rdzv.run_id, seq)
        try:
            raw = self._handle.get(base, 1.0)  # a lost store raises RendezvousError: not a refusal
        except TimeoutError as e:  # seen by check(), then not readable: should not happen
            self._refuse(seq, None, f"join request {seq}: the store lost it: {e}")
            return None
        try:
            info = self._verify(seq, ad, raw)
        except RendezvousError as e:
            self._refuse(seq, None, str(e))
            return None
        try:
            reason = accept(info)
        except BaseException as e:
            self._refuse(seq, info, f"node 0 failed to decide: {type(e).__name__}: {e}")
            raise
        if reason is not None:
            self._refuse(seq, info, reason)
            return None
        nodes = {**self._nodes, info.rank: info}
        payload = _Payload(run_id=self._rdzv.run_id, public=self._public, secret=self._secret_key,
                           nodes=[nodes[r] for r in sorted(nodes)])
        self._handle.set(f"{base}/keys", seal(self._secret, msgspec.json.encode(payload), run_id=self._rdzv.run_id,
                                              rank=info.rank, purpose=_join_purpose(seq)))
        rejoined = info.rank in self._nodes
        self._nodes = nodes
        self._finish(seq)
        log.info("node 0: node %d (%s, %s, pid %d) %s the run (join request %d)", info.rank, info.host,
                 info.hostname, info.pid, "rejoined" if rejoined else "joined", seq)
        return info

    def _verify(self, seq: int, ad: str, raw: bytes) -> NodeInfo:
        try:
            a = msgspec.json.decode(raw, type=_Arrival)
        except msgspec.DecodeError as e:
            raise RendezvousError(f"join request {seq} does not parse: {e}") from e
        rank = a.info.rank
        if not hmac.compare_digest(a.proof, _join_proof(self._secret, ad, a.info, a.nnodes)):
            raise RendezvousError(f"node {rank} does not hold this run's secret (its join's proof does not verify)")
        if rank < 1:
            raise RendezvousError(f"join request {seq} is for rank {rank}: node 0 does not join its own run")
        if not rank < a.nnodes:
            raise RendezvousError(f"node {rank} was launched with --nnodes {a.nnodes}, which does not hold its rank")
        if a.info.version != self._version:
            raise RendezvousError(f"node {rank} runs miles-async {a.info.version} but node 0 runs {self._version}")
        return a.info

    def _refuse(self, seq: int, info: NodeInfo | None, reason: str) -> None:
        ad = _join_ad(self._rdzv.run_id, seq)
        who = f"node {info.rank}'s join" if info is not None else "a join"
        log.warning("node 0: refused %s (request %d): %s", who, seq, reason)
        self._handle.set(f"{PREFIX}join/{seq}/abort", msgspec.json.encode(
            _Abort(reason=reason, tag=_abort_tag(self._secret, ad, reason))))
        self._finish(seq)

    def _finish(self, seq: int) -> None:
        if seq < self._next:
            return
        self._done.add(seq)
        self._gap_since.pop(seq, None)
        while self._next in self._done:
            self._done.remove(self._next)
            self._next += 1
