"""The multi-node rendezvous: nodes meet at node 0's TCPStore, prove the run's secret, get its keys.

Nodes run in threads of this process (a TCPStore master and its clients share a process fine)
or, for the three-node case, in spawned processes. Every wait has a deadline; failure cases use
a timeout of 2 s so that each test takes a few seconds at most.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

import miles_async
from miles_async.launch.rendezvous import (
    JoinServer,
    NodeInfo,
    Rendezvous,
    RendezvousError,
    StoreHandle,
    load_secret,
    rendezvous,
)
from miles_async.launch.sealing import SealError, seal, unseal
from miles_async.runtime import security

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"
JOIN_S = 20.0  # no test comes near this; it only keeps a broken one from hanging

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq was built without CURVE")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def can_bind(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


class Node(threading.Thread):
    """One node's launcher in a thread: `result` or `error` once it is done."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.kwargs = kwargs
        self.result: Rendezvous | None = None
        self.handle: StoreHandle | None = None
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        start = time.monotonic()
        try:
            self.result, self.handle = rendezvous(**self.kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        self.elapsed = time.monotonic() - start


def node_kwargs(tmp_path: Path, port: int, nnodes: int, rank: int, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "nnodes": nnodes, "node_rank": rank, "master_addr": "127.0.0.1", "master_port": port,
        "secret": SECRET, "host": "127.0.0.1", "key_dir": str(tmp_path / f"keys{rank}"), "timeout_s": 5.0}
    kwargs.update(overrides)
    return kwargs


def run_nodes(*nodes: Node, stagger_s: float = 0.0) -> list[Node]:
    try:
        for node in nodes:
            node.start()
            time.sleep(stagger_s)
        for node in nodes:
            node.join(JOIN_S)
            assert not node.is_alive(), f"node {node.kwargs['node_rank']} still runs after {JOIN_S} s"
    finally:
        for node in reversed(nodes):  # node 0 (the store's server) last
            if node.handle is not None:
                node.handle.close()
    return list(nodes)


def assert_key_dir(key_dir: str) -> security.CurveKeys:
    folder = Path(key_dir)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["run.key", "run.key_secret"]
    for name in names:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    return security.load_run_keys(folder)


# ------------------------------------------------------------------------------------------------
# success


def _process_node(kwargs: dict[str, Any], out: Any) -> None:
    try:
        result, handle = rendezvous(**kwargs)
        keys = assert_key_dir(result.key_dir)
        out.put((kwargs["node_rank"], "ok", msgspec.json.encode(result), keys.public, keys.secret))
        handle.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((kwargs["node_rank"], "error", f"{type(e).__name__}: {e}", b"", b""))


def test_three_processes_get_the_same_keys_and_nodes(tmp_path: Path) -> None:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_node, args=(
        node_kwargs(tmp_path, port, 3, rank, timeout_s=30.0, num_gpus=rank), out), daemon=True)
        for rank in range(3)]
    try:
        for proc in procs:
            proc.start()
        reports = {}
        for _ in procs:
            rank, status, data, public, secret = out.get(timeout=JOIN_S)
            assert status == "ok", f"node {rank}: {data}"
            reports[rank] = (msgspec.json.decode(data, type=Rendezvous), public, secret)
        for proc in procs:
            proc.join(JOIN_S)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    results = [reports[r][0] for r in range(3)]
    assert len({r.run_id for r in results}) == 1
    assert len(results[0].run_id) == 32 and int(results[0].run_id, 16) >= 0
    assert all(r.nodes == results[0].nodes for r in results)
    assert [n.rank for n in results[0].nodes] == [0, 1, 2]
    assert [n.num_gpus for n in results[0].nodes] == [0, 1, 2]
    assert all(n.version == miles_async.__version__ for n in results[0].nodes)
    assert len({n.pid for n in results[0].nodes}) == 3
    assert len({(reports[r][1], reports[r][2]) for r in range(3)}) == 1  # one keypair everywhere
    assert [r.key_dir for r in results] == [str(tmp_path / f"keys{r}") for r in range(3)]


@pytest.mark.skipif(not (can_bind("127.0.0.2") and can_bind("127.0.0.3")),
                    reason="127.0.0.2 and 127.0.0.3 cannot be bound here")
def test_nodes_on_other_loopback_addresses(tmp_path: Path) -> None:
    port = free_port("127.0.0.2")
    nodes = run_nodes(
        Node(**node_kwargs(tmp_path, port, 3, 0, master_addr="127.0.0.2", host="127.0.0.2")),
        Node(**node_kwargs(tmp_path, port, 3, 1, master_addr="127.0.0.2", host="127.0.0.3",
                           extra={"role": "rollout"})),
        Node(**node_kwargs(tmp_path, port, 3, 2, master_addr="127.0.0.2", host="127.0.0.3")))
    for node in nodes:
        assert node.error is None, node.error
    results = [node.result for node in nodes]
    assert [n.host for n in results[0].nodes] == ["127.0.0.2", "127.0.0.3", "127.0.0.3"]
    assert results[0].nodes[1].extra == {"role": "rollout"}
    assert all(r.nodes == results[0].nodes and r.run_id == results[0].run_id for r in results)
    assert all((r.master_addr, r.master_port) == ("127.0.0.2", port) for r in results)
    keys = {assert_key_dir(r.key_dir) for r in results}
    assert len(keys) == 1


def test_the_store_handle_outlives_the_rendezvous(tmp_path: Path) -> None:
    result, handle = rendezvous(**node_kwargs(tmp_path, free_port(), 1, 0, timeout_s=2.0))
    with handle:
        handle.set("heartbeat/0", "1")
        assert handle.get("heartbeat/0", 1.0) == b"1"
        assert handle.add("counter", 2) == 2
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            handle.wait(["nobody/writes/this"], 0.3)
        assert time.monotonic() - start < 2.0
        assert handle.wait_any(["nobody", "heartbeat/0"], 0.3) == "heartbeat/0"
    with pytest.raises(RendezvousError, match="closed"):
        handle.set("x", "y")
    assert handle.closed
    assert isinstance(handle, StoreHandle) and result.nodes[0].rank == 0


# ------------------------------------------------------------------------------------------------
# failures


def test_a_node_that_never_arrives(tmp_path: Path) -> None:
    port = free_port()
    node0, node1 = run_nodes(Node(**node_kwargs(tmp_path, port, 3, 0, timeout_s=2.0)),
                             Node(**node_kwargs(tmp_path, port, 3, 1, timeout_s=2.0)))
    assert isinstance(node0.error, RendezvousError)
    assert str(node0.error) == "node(s) 2 did not arrive within 2 s (arrived: 0, 1)"
    assert isinstance(node1.error, RendezvousError)
    assert str(node1.error) == f"node 1: the run was aborted by node 0: {node0.error}"
    assert node0.elapsed < 2.0 + 4.0 and node1.elapsed < 2.0 + 4.0
    assert not (tmp_path / "keys0").exists() and not (tmp_path / "keys1").exists()


def test_a_node_without_the_secret(tmp_path: Path) -> None:
    port = free_port()
    node0, node1 = run_nodes(Node(**node_kwargs(tmp_path, port, 2, 0)),
                             Node(**node_kwargs(tmp_path, port, 2, 1, secret=OTHER_SECRET)))
    assert isinstance(node0.error, RendezvousError)
    assert str(node0.error) == "node 1 does not hold this run's secret (its proof does not verify)"
    assert node0.elapsed < 4.0  # at once, not at the timeout
    assert isinstance(node1.error, RendezvousError)
    # node 1 cannot verify node 0's abort with its secret, and says so
    assert str(node1.error).startswith("node 1: the run was aborted: node 1 does not hold this run's secret")
    assert "does not verify with this node's secret" in str(node1.error)
    assert not (tmp_path / "keys1").exists()


def test_a_version_mismatch(tmp_path: Path) -> None:
    port = free_port()
    node0, node1 = run_nodes(Node(**node_kwargs(tmp_path, port, 2, 0)),
                             Node(**node_kwargs(tmp_path, port, 2, 1, version="9.9.9")))
    expected = f"node 1 runs miles-async 9.9.9 but node 0 runs {miles_async.__version__}"
    assert str(node0.error) == expected
    assert str(node1.error) == f"node 1: the run was aborted by node 0: {expected}"


def test_an_nnodes_mismatch(tmp_path: Path) -> None:
    port = free_port()
    node0, node1 = run_nodes(Node(**node_kwargs(tmp_path, port, 2, 0)),
                             Node(**node_kwargs(tmp_path, port, 3, 1)))
    assert str(node0.error) == "node 1 was launched with --nnodes 3 but node 0 with --nnodes 2"
    assert "aborted by node 0" in str(node1.error)


def test_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            rendezvous(**node_kwargs(tmp_path, port, 2, 0, timeout_s=2.0))
    assert str(info.value) == (f"node 0: cannot listen on 127.0.0.1:{port}: address already in use "
                               f"(another run, or pick another --master-port)")
    assert time.monotonic() - start < 2.0


def test_node_0_is_absent(tmp_path: Path) -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        rendezvous(**node_kwargs(tmp_path, port, 2, 1, timeout_s=2.0))
    elapsed = time.monotonic() - start
    assert str(info.value).startswith(f"node 1: node 0 did not answer at 127.0.0.1:{port} within 2 s")
    assert 2.0 <= elapsed < 3.5


def test_two_launchers_claim_one_rank(tmp_path: Path) -> None:
    port = free_port()
    node0, first, second = run_nodes(
        Node(**node_kwargs(tmp_path, port, 3, 0)),
        Node(**node_kwargs(tmp_path, port, 3, 1, host="hostA", key_dir=str(tmp_path / "a"))),
        Node(**node_kwargs(tmp_path, port, 3, 1, host="hostB", key_dir=str(tmp_path / "b"))),
        stagger_s=0.2)
    assert str(node0.error) == "two launchers claim node rank 1 (hosts hostA and hostB)"
    assert node0.elapsed < 4.0  # at once, not when node 2 is given up on
    assert str(second.error) == "two launchers claim node rank 1 (hosts hostA and hostB)"
    assert str(first.error) == f"node 1: the run was aborted by node 0: {node0.error}"


def _fake_node_0(port: int, run_id: str, write: dict[str, bytes], ready: threading.Event) -> None:
    """A store master that is not a miles-async node 0: it writes what it is told once node 1 arrives."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    store.set("rdzv/run_id", run_id)
    store.set("rdzv/meta", msgspec.json.encode({"nnodes": 2, "version": miles_async.__version__}))
    ready.set()
    store.wait(["rdzv/node/1"], datetime.timedelta(seconds=5))
    for key, value in write.items():
        store.set(key, value)
    with contextlib.suppress(Exception):
        store.wait(["rdzv/ack"], datetime.timedelta(seconds=3))


def _against_fake_node_0(tmp_path: Path, write: dict[str, bytes]) -> RendezvousError:
    port = free_port()
    ready = threading.Event()
    fake = threading.Thread(target=_fake_node_0, args=(port, "ab" * 16, write, ready), daemon=True)
    fake.start()
    assert ready.wait(JOIN_S)
    with pytest.raises(RendezvousError) as info:
        rendezvous(**node_kwargs(tmp_path, port, 2, 1, timeout_s=3.0))
    fake.join(JOIN_S)
    assert not (tmp_path / "keys1").exists()
    return info.value


FAKE_RUN = "ab" * 16
FAKE_PAYLOAD = msgspec.json.encode({"run_id": FAKE_RUN, "public": b"p", "secret": b"s", "nodes": []})


def relabel(blob: bytes, **fields: Any) -> bytes:
    """`blob` with fields it states in clear rewritten, as an attacker with write access may."""
    sealed = msgspec.msgpack.decode(blob)
    sealed.update(fields)
    return msgspec.msgpack.encode(sealed)


def flip(blob: bytes, field: str, index: int) -> bytes:
    """`blob` with one bit of its `nonce` or `box` (ciphertext, then tag) flipped."""
    value = bytearray(msgspec.msgpack.decode(blob)[field])
    value[index] ^= 0x01
    return relabel(blob, **{field: bytes(value)})


def test_keys_sealed_with_another_secret_are_refused(tmp_path: Path) -> None:
    error = _against_fake_node_0(tmp_path, {
        "rdzv/keys/1": seal(OTHER_SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=1, purpose="keys"),
        "rdzv/go": b"1"})
    assert str(error).startswith(
        "node 1: the keys from node 0 do not verify: this node's secret differs from node 0's "
        "(it was sealed under another secret")


@pytest.mark.parametrize(("blob", "why"), [
    (seal(SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=2, purpose="keys"),
     "it was sealed for node 2, not 1: a sealed message opens only for the run, node and purpose"),
    (seal(SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=1, purpose="join/1"),
     "it was sealed for purpose 'join/1', not 'keys'"),
    (seal(SECRET, FAKE_PAYLOAD, run_id="cd" * 16, rank=1, purpose="keys"),
     f"it was sealed for run {'cd' * 16!r}, not {FAKE_RUN!r}"),
    (relabel(seal(SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=2, purpose="keys"), rank=1),
     "its authentication tag does not verify: it was altered in the store"),
    (flip(seal(SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=1, purpose="keys"), "box", 5),
     "its authentication tag does not verify: it was altered in the store"),
    (seal(SECRET, FAKE_PAYLOAD, run_id=FAKE_RUN, rank=1, purpose="keys")[:-20],
     "it is not a sealed message"),
], ids=["for-another-node", "for-another-purpose", "for-another-run", "relabelled", "tampered", "cut-short"])
def test_keys_not_sealed_for_this_node_are_refused(tmp_path: Path, blob: bytes, why: str) -> None:
    error = _against_fake_node_0(tmp_path, {"rdzv/keys/1": blob, "rdzv/go": b"1"})
    assert str(error).startswith(f"node 1: the keys from node 0 do not verify: {why}")


def test_a_forged_abort_says_it_does_not_verify(tmp_path: Path) -> None:
    error = _against_fake_node_0(tmp_path, {
        "rdzv/abort": msgspec.json.encode({"reason": "go away", "tag": "00" * 32})})
    assert str(error).startswith("node 1: the run was aborted: go away (this abort does not verify")


# ------------------------------------------------------------------------------------------------
# late joins: a node that comes back, an elastic node


class Cluster:
    """Launchers in threads on one port; `close()` joins them and closes their handles, node 0 last."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.nodes: list[Node] = []

    def launch(self, rank: int, nnodes: int, **overrides: Any) -> Node:
        node = Node(**node_kwargs(self.tmp_path, self.port, nnodes, rank, **overrides))
        node.start()
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.join(JOIN_S)
        for node in reversed(self.nodes):
            if node.handle is not None:
                node.handle.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, Node, JoinServer]]:
    """A 2-node run that has started, and node 0's JoinServer."""
    c = Cluster(tmp_path)
    try:
        node0, node1 = c.launch(0, 2), c.launch(1, 2)
        for node in (node0, node1):
            node.join(JOIN_S)
            assert node.error is None, node.error
        assert node0.handle is not None and node0.result is not None
        yield c, node0, JoinServer(node0.handle, node0.result, SECRET)
    finally:
        c.close()


def wait_for_request(handle: StoreHandle, seq: int) -> None:
    handle.wait([f"rdzv/join/{seq}"], JOIN_S)


def test_a_new_node_joins_a_running_run(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, node0, server = cluster
    seen: list[NodeInfo] = []
    joined: list[NodeInfo] = []
    stop = threading.Event()

    def serve() -> None:  # as node 0's launcher does: poll from a background thread
        while not stop.is_set():
            info = server.poll(lambda info: seen.append(info), 0.1)  # append returns None: admit
            if info is not None:
                joined.append(info)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        node2 = c.launch(2, 3, num_gpus=8, extra={"role": "rollout"})
        node2.join(JOIN_S)
    finally:
        stop.set()
        thread.join(JOIN_S)
    assert node2.error is None, node2.error
    assert node2.result is not None and node0.result is not None
    assert [i.rank for i in seen] == [2] and joined == seen
    assert node2.result.run_id == node0.result.run_id
    assert [n.rank for n in server.nodes] == [0, 1, 2]
    assert node2.result.nodes == server.nodes == server.rendezvous.nodes
    assert server.nodes[:2] == node0.result.nodes
    assert server.nodes[2].num_gpus == 8 and server.nodes[2].extra == {"role": "rollout"}
    assert assert_key_dir(node2.result.key_dir) == security.load_run_keys(node0.result.key_dir)
    assert node2.elapsed < 2.0


def test_a_node_rejoins_with_its_rank(cluster: tuple[Cluster, Node, JoinServer], tmp_path: Path) -> None:
    c, node0, server = cluster
    old = server.nodes[1]
    ctx = multiprocessing.get_context("spawn")  # a new launcher: another pid
    out = ctx.Queue()
    proc = ctx.Process(target=_process_node, args=(node_kwargs(
        tmp_path, c.port, 2, 1, host="127.0.0.7", key_dir=str(tmp_path / "rejoined1")), out), daemon=True)
    proc.start()
    try:
        info = server.poll(lambda info: None, JOIN_S)
        _, status, data, public, secret = out.get(timeout=JOIN_S)
        proc.join(JOIN_S)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert status == "ok", data
    assert info is not None and info.rank == 1 and info.pid == proc.pid
    assert [n.rank for n in server.nodes] == [0, 1]  # one entry for rank 1: the new one
    assert server.nodes[1] == info != old
    assert (server.nodes[1].host, old.host) == ("127.0.0.7", "127.0.0.1")
    assert msgspec.json.decode(data, type=Rendezvous).nodes == server.nodes
    assert node0.result is not None
    keys = security.load_run_keys(node0.result.key_dir)
    assert (public, secret) == (keys.public, keys.secret)


def test_a_refused_join(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, node0, server = cluster
    assert node0.handle is not None
    before = server.nodes
    joiner = c.launch(1, 2, key_dir=str(c.tmp_path / "again1"), timeout_s=3.0)
    wait_for_request(node0.handle, 1)
    assert server.poll(lambda info: f"node {info.rank} is still in the run", 0.3) is None
    joiner.join(JOIN_S)
    assert isinstance(joiner.error, RendezvousError)
    assert str(joiner.error) == "node 0 refused node 1's join: node 1 is still in the run"
    assert joiner.elapsed < 3.0
    assert server.nodes == before
    assert not (c.tmp_path / "again1").exists()


def test_a_join_without_the_secret_is_refused_and_the_next_is_served(
        cluster: tuple[Cluster, Node, JoinServer], caplog: pytest.LogCaptureFixture) -> None:
    c, node0, server = cluster
    assert node0.handle is not None
    bad = c.launch(2, 3, secret=OTHER_SECRET, key_dir=str(c.tmp_path / "bad"), timeout_s=3.0)
    wait_for_request(node0.handle, 1)
    good = c.launch(2, 3, host="127.0.0.8", timeout_s=3.0)
    wait_for_request(node0.handle, 2)
    asked: list[NodeInfo] = []
    with caplog.at_level(logging.WARNING):
        info = server.poll(lambda info: asked.append(info), 3.0)
    assert info is not None and info.host == "127.0.0.8" and asked == [info]
    bad.join(JOIN_S)
    good.join(JOIN_S)
    assert good.error is None, good.error
    assert str(bad.error).startswith(
        "node 2's join was refused: node 2 does not hold this run's secret (its join's proof does not verify)")
    assert "this refusal does not verify with this node's secret" in str(bad.error)
    assert any("refused a join (request 1)" in r.getMessage() for r in caplog.records)
    assert not (c.tmp_path / "bad").exists()
    assert [n.host for n in server.nodes] == ["127.0.0.1", "127.0.0.1", "127.0.0.8"]


def test_a_join_with_another_version_is_refused(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, node0, server = cluster
    assert node0.handle is not None
    joiner = c.launch(2, 3, version="9.9.9", timeout_s=3.0)
    wait_for_request(node0.handle, 1)
    assert server.poll(lambda info: pytest.fail("accept was asked"), 0.2) is None
    joiner.join(JOIN_S)
    assert str(joiner.error) == (f"node 0 refused node 2's join: node 2 runs miles-async 9.9.9 but node 0 "
                                 f"runs {miles_async.__version__}")


def test_poll_with_nothing_pending(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    _, _, server = cluster
    start = time.monotonic()
    assert server.poll(lambda info: pytest.fail("accept was asked"), 0.3) is None
    assert 0.3 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    assert server.poll(lambda info: pytest.fail("accept was asked"), 0.0) is None
    assert time.monotonic() - start < 0.5


def test_a_join_node_0_does_not_answer(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, _, server = cluster
    joiner = c.launch(2, 3, timeout_s=1.5)
    joiner.join(JOIN_S)
    assert isinstance(joiner.error, RendezvousError)
    assert str(joiner.error) == (
        f"node 2: the run at 127.0.0.1:{c.port} is going, but node 0 did not answer this node's join "
        f"(request 1) within 1.5 s: is node 0's launcher serving joins?")
    assert 1.5 <= joiner.elapsed < 2.5
    # the joiner gave its request up: node 0 skips it rather than admit a node that is gone
    assert server.poll(lambda info: pytest.fail("accept was asked"), 0.2) is None
    assert [n.rank for n in server.nodes] == [0, 1]


def test_an_elastic_node_early_waits_for_the_run_then_joins(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    try:
        node2 = c.launch(2, 3)  # before the run starts: it cannot take part in the 2-node rendezvous
        time.sleep(0.3)
        node0, node1 = c.launch(0, 2), c.launch(1, 2)
        for node in (node0, node1):
            node.join(JOIN_S)
            assert node.error is None, node.error
        assert node0.handle is not None and node0.result is not None
        assert [n.rank for n in node0.result.nodes] == [0, 1]
        server = JoinServer(node0.handle, node0.result, SECRET)
        info = server.poll(lambda info: None, 5.0)
        node2.join(JOIN_S)
        assert node2.error is None, node2.error
        assert info is not None and info.rank == 2
        assert node2.result is not None and node2.result.nodes == server.nodes
    finally:
        c.close()


def test_a_number_taken_without_an_arrival_holds_up_nobody(
        cluster: tuple[Cluster, Node, JoinServer], monkeypatch: pytest.MonkeyPatch) -> None:
    c, node0, server = cluster
    assert node0.handle is not None
    monkeypatch.setattr("miles_async.launch.rendezvous.GAP_S", 0.3)
    assert node0.handle.add("rdzv/join/seq", 1) == 1  # a launcher that died between its two writes
    joiner = c.launch(2, 3)
    info = server.poll(lambda info: None, 3.0)  # request 2 is served at once
    joiner.join(JOIN_S)
    assert joiner.error is None and info is not None and info.rank == 2
    assert not node0.handle.check(["rdzv/join/1/abort"])
    assert server.poll(lambda info: pytest.fail("accept was asked"), 0.5) is None
    assert node0.handle.check(["rdzv/join/1/abort"])  # refused after GAP_S


def test_keys_replayed_for_another_node_and_purpose_are_refused(
        cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, node0, server = cluster
    assert node0.handle is not None and node0.result is not None
    node1_keys = node0.handle.get("rdzv/keys/1", 1.0)  # node 0's real answer to node 1's arrival
    assert security.load_run_keys(node0.result.key_dir).secret not in node1_keys
    joiner = c.launch(2, 3, key_dir=str(c.tmp_path / "replayed"), timeout_s=3.0)
    wait_for_request(node0.handle, 1)
    node0.handle.set("rdzv/join/1/keys", node1_keys)  # an attacker answers node 2's join with it
    joiner.join(JOIN_S)
    assert isinstance(joiner.error, RendezvousError)
    assert str(joiner.error).startswith(
        "node 2: the keys from node 0 do not verify: it was sealed for node 1, not 2, purpose 'keys', "
        "not 'join/1'")
    assert not (c.tmp_path / "replayed").exists()
    # and relabelled to look like the answer node 2 expects, it fails its tag
    joiner = c.launch(2, 3, key_dir=str(c.tmp_path / "relabelled"), timeout_s=3.0)
    wait_for_request(node0.handle, 2)
    node0.handle.set("rdzv/join/2/keys", relabel(node1_keys, rank=2, purpose="join/2"))
    joiner.join(JOIN_S)
    assert str(joiner.error) == ("node 2: the keys from node 0 do not verify: its authentication tag does "
                                 "not verify: it was altered in the store (or forged by someone without "
                                 "the secret)")
    assert not (c.tmp_path / "relabelled").exists()
    assert [n.rank for n in server.nodes] == [0, 1]


def test_only_node_0_serves_joins(cluster: tuple[Cluster, Node, JoinServer]) -> None:
    c, _, _ = cluster
    node1 = c.nodes[1]
    assert node1.handle is not None and node1.result is not None
    with pytest.raises(ValueError, match="only node 0"):
        JoinServer(node1.handle, node1.result, SECRET)


# ------------------------------------------------------------------------------------------------
# the cipher


CONTEXT: dict[str, Any] = {"run_id": "run1", "rank": 1, "purpose": "keys"}


@pytest.mark.parametrize("size", [0, 1, 31, 32, 33, 1000])
def test_seal_round_trip(size: int) -> None:
    plaintext = bytes(range(256)) * 4
    plaintext = plaintext[:size]
    blob = seal(SECRET, plaintext, **CONTEXT)
    sealed = msgspec.msgpack.decode(blob)
    assert len(sealed["nonce"]) == 12 and len(sealed["box"]) == size + 16  # ChaCha20-Poly1305
    assert unseal(SECRET, blob, **CONTEXT) == plaintext
    assert seal(SECRET, plaintext, **CONTEXT) != blob  # a fresh nonce each time
    if size >= 16:
        assert plaintext not in blob


def test_a_tampered_sealed_blob_is_refused() -> None:
    blob = seal(SECRET, b"the run's CURVE secret key, say" * 3, **CONTEXT)
    box_bytes = len(msgspec.msgpack.decode(blob)["box"])
    for field, index in (("nonce", 0), ("nonce", 11), ("box", 0), ("box", box_bytes // 2),
                         ("box", box_bytes - 17), ("box", box_bytes - 16), ("box", box_bytes - 1)):
        with pytest.raises(SealError, match="its authentication tag does not verify: it was altered") as info:
            unseal(SECRET, flip(blob, field, index), **CONTEXT)
        assert info.value.cause == "altered"
    for cut in (blob[:40], blob[:-1], b"", blob + b"x"):
        with pytest.raises(SealError, match="it is not a sealed message") as info:
            unseal(SECRET, cut, **CONTEXT)
        assert info.value.cause == "malformed"
    with pytest.raises(SealError, match="nonce is 11 bytes"):
        unseal(SECRET, relabel(blob, nonce=b"x" * 11), **CONTEXT)
    with pytest.raises(SealError, match="format 2, and this node reads format 1"):
        unseal(SECRET, relabel(blob, format=2), **CONTEXT)


def test_a_blob_sealed_for_node_1_opens_for_no_other_node_purpose_or_run() -> None:
    blob = seal(SECRET, b"keys for node 1", **CONTEXT)
    for other, why in (({"rank": 2}, "node 1, not 2"), ({"purpose": "join/1"}, "purpose 'keys', not 'join/1'"),
                       ({"run_id": "run2"}, "run 'run1', not 'run2'"),
                       ({"rank": 2, "purpose": "join/3"}, "node 1, not 2, purpose 'keys', not 'join/3'")):
        with pytest.raises(SealError) as info:
            unseal(SECRET, blob, **{**CONTEXT, **other})
        assert info.value.cause == "context"
        assert str(info.value) == (f"it was sealed for {why}: a sealed message opens only for the run, "
                                   f"node and purpose it was sealed for")
        # relabelled in clear to match, it still fails: the box is bound to what it was sealed for
        with pytest.raises(SealError, match="it was altered") as info:
            unseal(SECRET, relabel(blob, **other), **{**CONTEXT, **other})
        assert info.value.cause == "altered"


def test_a_wrong_secret_is_refused() -> None:
    blob = seal(SECRET, b"keys for node 1", **CONTEXT)
    with pytest.raises(SealError, match=r"^it was sealed under another secret \(key id [0-9a-f]{16}; this "
                                        r"node's is [0-9a-f]{16}\)$") as info:
        unseal(OTHER_SECRET, blob, **CONTEXT)
    assert info.value.cause == "secret"
    assert isinstance(info.value, ValueError)
    # with the key id relabelled to the other secret's, the tag still fails
    other_id = msgspec.msgpack.decode(seal(OTHER_SECRET, b"", **CONTEXT))["key_id"]
    with pytest.raises(SealError, match="it was altered"):
        unseal(OTHER_SECRET, relabel(blob, key_id=other_id), **CONTEXT)


def test_node_info_is_frozen() -> None:
    info = NodeInfo(rank=0, host="h", hostname="h", pid=1, version="0", num_gpus=0)
    assert info.extra == {}
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# the secret


def test_load_secret_from_env() -> None:
    assert load_secret(env={"MILES_ASYNC_SECRET": "  " + SECRET.decode() + "\n"}) == SECRET


def test_load_secret_from_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert load_secret(str(path), env={"MILES_ASYNC_SECRET": OTHER_SECRET.decode()}) == SECRET
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_secret(str(path), env={}) == SECRET  # still used, with a warning
    assert any("readable by group or others" in r.getMessage() for r in caplog.records)


def test_load_secret_missing_or_short(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MILES_ASYNC_SECRET.*token_hex"):
        load_secret(env={})
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(env={"MILES_ASYNC_SECRET": "short"})
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(str(short), env={})
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "nothing"), env={})


def test_bad_arguments_fail_before_any_network() -> None:
    with pytest.raises(ValueError, match="node-rank"):
        rendezvous(nnodes=2, node_rank=2, master_addr="127.0.0.1", master_port=1, secret=SECRET,
                   host="127.0.0.1", key_dir="/nonexistent")
    with pytest.raises(ValueError, match="at least 16"):
        rendezvous(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=1, secret=b"x",
                   host="127.0.0.1", key_dir="/nonexistent")
