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
4. when all N verify, node 0 writes `keys` = seal(JSON `{run_id, public, secret, nodes}`): the
   two key files' bytes and the node list, encrypted and authenticated (below), then `go`.
   Every node opens `keys`, checks that the run id in it is the run's, writes the key files
   into its `key_dir`, counts itself in `ack` and returns; node 0 returns once all have (or
   after 3 s, with a warning).

Encryption (`seal` / `unseal`, standard library only): a PRF in counter mode, then
encrypt-then-MAC. Per message a random 16-byte nonce; `enc_key = HMAC-SHA256(secret,
b"miles-async enc" + nonce)`, `mac_key = HMAC-SHA256(secret, b"miles-async mac" + nonce)`;
keystream block i = `HMAC-SHA256(enc_key, i as 8 bytes big-endian)`; ciphertext = plaintext
XOR keystream; `tag = HMAC-SHA256(mac_key, nonce + run_id + ciphertext)`, checked with
`hmac.compare_digest` before anything is decrypted. The sealed blob is `nonce + ciphertext +
tag`. HMAC-SHA256 is a PRF, so the keystream is indistinguishable from random for anyone
without the secret, and a fresh nonce per message means a keystream is never reused.

Security argument
-----------------
The TCPStore has no authentication (and its master listens on every interface of node 0, not
only on A): anyone who can reach A:P can read and write every key. So nothing in it is trusted
for what it says, only for what it proves:

* the run's CURVE keys travel only sealed under the shared secret: reading the store gives an
  attacker ciphertext, and a forged or altered `keys` fails its tag, so a node never installs
  keys that node 0 did not send (it fails: "the keys from node 0 do not verify");
* a launcher without the secret cannot produce a proof that verifies, so node 0 refuses it
  (and aborts the run rather than hand out keys); proofs bind the run id, so a proof seen in
  one run is worthless in another; the node list is inside the sealed payload, so the
  addresses the nodes go on to connect to are node 0's, not an attacker's;
* what such an attacker CAN still do is deny service: write `abort`, garbage in `node/R`,
  `claim/R` or `dup/R`, or `run_id` before node 0 does, and the rendezvous fails (bounded by
  `timeout_s`, with an error). An `abort` whose tag does not verify says so in the error
  ("this abort does not verify..."), so an operator can tell interference from a real abort,
  but the run stops either way. Keep P behind the cluster's firewall; the secret protects the
  keys, not the run's availability.

The secret comes from `MILES_ASYNC_SECRET` or a file (`load_secret`); make one with
`python -c "import secrets; print(secrets.token_hex(32))" > secret` and copy it to every node.

Try it on one machine (two shells, same secret):

    export MILES_ASYNC_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))")
    python -c "from miles_async.launch.rendezvous import *; r, s = rendezvous(nnodes=2, \
node_rank=0, master_addr='127.0.0.1', master_port=29500, secret=load_secret(), \
host='127.0.0.1', key_dir='/tmp/k0'); print(r)"
    # in the second shell: node_rank=1, key_dir='/tmp/k1'
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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

import miles_async
from miles_async.runtime import security

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

SECRET_ENV = "MILES_ASYNC_SECRET"
MIN_SECRET_BYTES = 16
MAKE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))" > secret'
PREFIX = "rdzv/"
NONCE_BYTES = 16
TAG_BYTES = 32
POLL_S = 0.02
# How much longer than timeout_s a non-zero node waits for node 0's verdict (node 0 may have
# started a little later, and verifying and sealing take a moment).
MARGIN_S = 5.0
# How long node 0 keeps the store up, after its verdict, for the others to read it and say so.
GRACE_S = 3.0


class RendezvousError(RuntimeError):
    """The rendezvous failed; the message names the node(s) and the cause."""


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


# ---------------------------------------------------------------------------------------------
# the cipher: a PRF (HMAC-SHA256) in counter mode, encrypt-then-MAC


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _keystream_xor(enc_key: bytes, data: bytes) -> bytes:
    stream = b"".join(_hmac(enc_key, i.to_bytes(8, "big")) for i in range((len(data) + 31) // 32))
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream[: len(data)], "big")).to_bytes(
        len(data), "big")


def _keys(secret: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    return _hmac(secret, b"miles-async enc" + nonce), _hmac(secret, b"miles-async mac" + nonce)


def seal(secret: bytes, run_id: str, plaintext: bytes) -> bytes:
    """Encrypt and authenticate `plaintext` for `run_id`: returns nonce + ciphertext + tag."""
    nonce = _secrets.token_bytes(NONCE_BYTES)
    enc_key, mac_key = _keys(secret, nonce)
    ciphertext = _keystream_xor(enc_key, plaintext)
    tag = _hmac(mac_key, nonce + run_id.encode() + ciphertext)
    return nonce + ciphertext + tag


def unseal(secret: bytes, run_id: str, blob: bytes) -> bytes:
    """The plaintext of a `seal`ed blob; ValueError if it was not sealed with `secret` for `run_id`."""
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise ValueError(f"a sealed message is at least {NONCE_BYTES + TAG_BYTES} bytes, got {len(blob)}")
    nonce, ciphertext, tag = blob[:NONCE_BYTES], blob[NONCE_BYTES:-TAG_BYTES], blob[-TAG_BYTES:]
    enc_key, mac_key = _keys(secret, nonce)
    if not hmac.compare_digest(tag, _hmac(mac_key, nonce + run_id.encode() + ciphertext)):
        raise ValueError("the message does not verify (another secret, another run, or altered)")
    return _keystream_xor(enc_key, ciphertext)


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
    text = str(e)
    if "EADDRINUSE" in text or "address already in use" in text:
        return "address already in use (another run, or pick another --master-port)"
    if "EADDRNOTAVAIL" in text:
        return "the address is not one of this host's"
    if "EACCES" in text:
        return "permission denied (ports below 1024 need root)"
    return _first_line(e)


def _start_master(addr: str, port: int, timeout_s: float) -> object:
    from torch.distributed import DistError, TCPStore

    try:
        return TCPStore(addr, port, None, True, datetime.timedelta(seconds=max(timeout_s, 1.0)),
                        wait_for_workers=False)
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
            result = _follow(handle, info, nnodes, secret, key_dir, timeout_s, deadline + MARGIN_S)
    except BaseException:
        handle.close()
        raise
    return result, handle


def _check_master_addr(addr: str) -> None:
    # TCPStore's master listens on every interface whatever `addr` says; a node 0 on a host that
    # does not own `addr` would wait alone while the others meet nobody (or another node 0).
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
        raise RendezvousError(f"two launchers claim node rank {rank} (hosts {first} and {info.host})")
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
    handle.set(f"{PREFIX}keys", seal(secret, run_id, payload))
    handle.set(f"{PREFIX}go", b"1")
    _write_keys(key_dir, public, key_secret)
    if not _await_acks(handle, nnodes - 1):
        log.warning("node 0: not every node confirmed it read the keys within %g s", GRACE_S)
    return Rendezvous(run_id=run_id, nodes=ordered, key_dir=str(key_dir),
                      master_addr=handle.master_addr, master_port=handle.master_port)


def _follow(handle: StoreHandle, info: NodeInfo, nnodes: int, secret: bytes, key_dir: str,
            timeout_s: float, deadline: float) -> Rendezvous:
    rank = info.rank
    where = f"{handle.master_addr}:{handle.master_port}"

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    try:
        run_id = handle.get(f"{PREFIX}run_id", left()).decode()
        meta = msgspec.json.decode(handle.get(f"{PREFIX}meta", left()), type=_Meta)
    except (TimeoutError, msgspec.DecodeError, UnicodeDecodeError) as e:
        raise RendezvousError(f"node {rank}: the store at {where} holds no run from node 0 ({e})") from e
    if rank >= meta.nnodes:
        raise RendezvousError(f"node {rank}: node 0 was launched with --nnodes {meta.nnodes} "
                              f"(ranks 0..{meta.nnodes - 1}) but this node with --nnodes {nnodes}")
    _arrive(handle, info, nnodes, secret, run_id)

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
    try:
        payload = msgspec.json.decode(unseal(secret, run_id, handle.get(f"{PREFIX}keys", 1.0)), type=_Payload)
    except (ValueError, TimeoutError) as e:  # msgspec.DecodeError is a ValueError
        raise RendezvousError(f"node {rank}: the keys from node 0 do not verify: this node's secret "
                              f"differs from node 0's ({e})") from e
    if payload.run_id != run_id:
        raise RendezvousError(f"node {rank}: the keys from node 0 are for run {payload.run_id}, not {run_id}")
    if len(payload.nodes) != nnodes or payload.nodes[rank] != info:
        raise RendezvousError(f"node {rank}: node 0's list of nodes does not hold this node as it arrived")
    _write_keys(key_dir, payload.public, payload.secret)
    return Rendezvous(run_id=run_id, nodes=payload.nodes, key_dir=str(key_dir),
                      master_addr=handle.master_addr, master_port=handle.master_port)


def _abort_message(raw: bytes, rank: int, secret: bytes, run_id: str, where: str) -> str:
    try:
        abort = msgspec.json.decode(raw, type=_Abort)
    except msgspec.DecodeError:
        return (f"node {rank}: the run was aborted: the store at {where} holds an `abort` that does "
                f"not parse (not node 0's: someone else who can reach the port wrote it)")
    if hmac.compare_digest(abort.tag, _abort_tag(secret, run_id, abort.reason)):
        return f"node {rank}: the run was aborted by node 0: {abort.reason}"
    return (f"node {rank}: the run was aborted: {abort.reason} (this abort does not verify with this "
            f"node's secret: either it differs from node 0's, or someone else who can reach {where} "
            f"wrote it)")
