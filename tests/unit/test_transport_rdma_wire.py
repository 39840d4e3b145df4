"""The RDMA wire (miles_async.transport.rdma).

Everything that decides runs here: the exchanged structs, GID/MTU/peer checks, the region
layout, the work-request schedule, and the pack/post/poll loop (`drive_writes`) against an
in-memory NIC that executes the posted writes lazily, in order, with memmove between real
tensors. The verbs themselves run only in `test_wire_*`, skipped with the reason where pyverbs
or an active RDMA device is missing (soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import sys
from collections import deque

import msgspec
import pytest
import torch

from miles_async.transport.buckets import split_buckets, tensor_nbytes
from miles_async.transport.errors import TransportError
from miles_async.transport.rdma import (
    EndpointInfo,
    RdmaEngineSide,
    RdmaPusherSide,
    RegionInfo,
    SendWindow,
    WorkRequest,
    check_peer,
    drive_writes,
    layout_regions,
    list_devices,
    mtu_bytes,
    mtu_enum,
    normalize_gid,
    pack_bucket,
    pick_gid_index,
    tensor_spans,
    wc_status_name,
    work_requests,
)
from miles_async.transport.rdma_plan import RdmaWrite, plan_writes
from miles_async.transport.verify import checksums, compare, random_fill

pytestmark = pytest.mark.timeout(30)

GID = "fe80:0000:0000:0000:0250:56ff:fe00:0001"


INFO = EndpointInfo(device="rxe0", port=1, gid=GID, gid_index=1, lid=0, qp_num=17, psn=0x123456, mtu=1024,
                    regions=(RegionInfo(name="w", addr=0x7F0000001000, rkey=0xABC, length=4096),))


def _info(**overrides: object) -> EndpointInfo:
    return msgspec.structs.replace(INFO, **overrides)


# ----- what the sides exchange -----


def test_endpoint_info_round_trips_through_json_and_msgpack() -> None:
    info = _info()
    assert msgspec.json.decode(msgspec.json.encode(info), type=EndpointInfo) == info
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=EndpointInfo) == info
    with pytest.raises(TypeError):
        EndpointInfo("rxe0", 1, GID, 1, 0, 17, 0, 1024)  # kw_only
    with pytest.raises(AttributeError):
        info.psn = 1  # frozen


def test_gid_forms_normalize_and_bad_ones_are_named() -> None:
    assert normalize_gid("FE80:0:0:0:250:56ff:fe00:1") == GID
    assert normalize_gid(GID.replace(":", "")) == GID
    for bad in ("fe80::1", "fe80:0:0:0:0:0:0", "zz80:0:0:0:0:0:0:1", "fe80" * 7, "12345:0:0:0:0:0:0:1"):
        with pytest.raises(ValueError, match="GID"):
            normalize_gid(bad)


def test_gid_pick_prefers_ipv4_mapped_then_first_nonzero() -> None:
    zero, v4 = "0" * 32, "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert pick_gid_index([GID, GID, v4]) == 2
    assert pick_gid_index([zero, GID]) == 1
    with pytest.raises(TransportError, match="GID table is empty"):
        pick_gid_index([zero, zero])


def test_mtu_enum_and_peer_checks() -> None:
    assert [mtu_enum(b) for b in (256, 4096)] == [1, 5]
    assert all(mtu_bytes(mtu_enum(b)) == b for b in (256, 512, 1024, 2048, 4096))
    with pytest.raises(ValueError, match="MTU 1500"):
        mtu_enum(1500)
    assert check_peer(_info(mtu=4096), _info(mtu=1024)) == 1024
    bad_peers = {
        "MTU 9000": _info(mtu=9000),
        "QP number 0": _info(qp_num=0),
        "PSN 16777216": _info(psn=1 << 24),
        "neither a GID nor a LID": _info(gid="0" * 32, lid=0),
        "non-hex": _info(gid="xx80:0:0:0:0:0:0:1"),
        "region 'w' has addr": _info(regions=(RegionInfo(name="w", addr=0, rkey=1 << 32, length=1),)),
    }
    for message, peer in bad_peers.items():
        with pytest.raises(ValueError, match=message):
            check_peer(_info(), peer)
    assert check_peer(_info(), _info(gid="0" * 32, lid=5)) == 1024  # IB: a LID alone routes


def test_wc_status_names() -> None:
    assert [wc_status_name(s) for s in (0, 5, 10, 12, 99)] == [
        "SUCCESS", "WR_FLUSH_ERR", "REM_ACCESS_ERR", "RETRY_EXC_ERR", "UNKNOWN(99)"]


# ----- regions -----


def _engine_tensors() -> dict[str, torch.Tensor]:
    """Two tensors viewing one buffer (one region), two separate ones (a region each), an empty one."""
    buf = torch.zeros(512, dtype=torch.uint8)
    return {"w.a": buf[0:256].view(torch.float32).view(8, 8), "w.b": buf[320:352].view(torch.int64),
            "w.c": torch.zeros(3, 5, dtype=torch.bfloat16), "w.d": torch.zeros(0),
            "w.e": torch.zeros(4, 4, dtype=torch.float16)}


def test_one_region_per_storage_in_the_planners_shape() -> None:
    tensors = _engine_tensors()
    regions, entries = layout_regions(tensor_spans(tensors))
    assert sorted((name, length) for name, _, length in regions) == [("w.a", 512), ("w.c", 30), ("w.e", 32)]
    ids = {name: i for i, (name, _, _) in enumerate(regions)}
    assert entries == {"w.a": (ids["w.a"], 0, 256), "w.b": (ids["w.a"], 320, 32), "w.c": (ids["w.c"], 0, 30),
                       "w.d": (0, 0, 0), "w.e": (ids["w.e"], 0, 32)}
    assert list(entries) == list(tensors)
    with pytest.raises(ValueError, match="contiguous CPU tensors only"):
        tensor_spans({"t": torch.zeros(4, 4).t()})
    with pytest.raises(ValueError, match="outside its storage"):
        layout_regions({"t": (0x1000, 64, 0x1030, 32)})
    with pytest.raises(ValueError, match="no tensor with at least one element"):
        layout_regions({"t": (0, 0, 0, 0)})


# ----- the work-request schedule -----


def _regions(*lengths: int) -> list[RegionInfo]:
    return [RegionInfo(name=f"r{i}", addr=(i + 1) << 20, rkey=100 + i, length=n) for i, n in enumerate(lengths)]


def test_requests_split_at_the_message_limit_and_signal_every_n_and_each_buckets_last() -> None:
    buckets = [[("a", 100), ("b", 50)], [("c", 30)]]
    plan = [RdmaWrite(0, 0, 0, 0, 150, ("a", "b")), RdmaWrite(1, 0, 1, 8, 30, ("c",))]
    wrs = work_requests(plan, buckets, _regions(256, 64), [0x5000, 0x9000], max_message_bytes=40, signal_every=3)
    assert [(w.bucket, w.local_addr - [0x5000, 0x9000][w.bucket], w.nbytes) for w in wrs] == [
        (0, 0, 40), (0, 40, 40), (0, 80, 40), (0, 120, 30), (1, 0, 30)]
    assert [w.remote_addr for w in wrs] == [(1 << 20) + o for o in (0, 40, 80, 120)] + [(2 << 20) + 8]
    assert [w.rkey for w in wrs] == [100] * 4 + [101]
    assert [w.signaled for w in wrs] == [False, False, True, True, True]  # 3rd; last of bucket 0 and 1
    assert [w.wr_id for w in wrs] == list(range(5))
    assert work_requests([RdmaWrite(0, 0, 0, 0, 0, ("e",))], [[("e", 0)]], _regions(8), [0]) == []


def test_requests_refuse_a_plan_that_does_not_match_buckets_or_regions() -> None:
    buckets = [[("a", 100), ("b", 50)], [("c", 30)]]
    ok = [RdmaWrite(0, 0, 0, 0, 150, ("a", "b")), RdmaWrite(1, 0, 1, 8, 30, ("c",))]
    cases = {
        "not at bucket 0 offset 100": [RdmaWrite(0, 100, 0, 0, 50, ("c",))],
        "is 149 bytes": [RdmaWrite(0, 0, 0, 0, 149, ("a", "b"))],
        "overruns region 1": [RdmaWrite(1, 0, 1, 40, 30, ("c",))],
        "targets region 2": [RdmaWrite(1, 0, 2, 0, 30, ("c",))],
        "reads bucket 2": [RdmaWrite(2, 0, 0, 0, 30, ("c",))],
        "goes back from bucket 1 to 0": ok[::-1],
    }
    for message, plan in cases.items():
        with pytest.raises(ValueError, match=message):
            work_requests(plan, buckets, _regions(256, 64), [0, 0])
    with pytest.raises(ValueError, match="1 bucket addresses for 2 buckets"):
        work_requests(ok, buckets, _regions(256, 64), [0])


def test_send_window_retires_everything_up_to_a_completion() -> None:
    window = SendWindow(3)
    for _ in range(3):
        window.on_post()
    assert window.room() == 0 and not window.done(0)
    window.on_completion(1)  # RC completes in order: 0 and 1 are done
    assert window.done(1) and not window.done(2) and window.room() == 2
    with pytest.raises(AssertionError):
        window.on_completion(5)


# ----- the pack/post/poll loop against an in-memory NIC -----


class LoopbackNic:
    """The verbs boundary in memory: runs posted RDMA writes in order, one per poll, with memmove.

    Like a real send queue, a request holds its slot until a completion at or after it is
    polled, so an unsignalled tail cannot be retired; posting past `depth` fails the test.
    """

    def __init__(self, depth: int, fail_wr: int | None = None, stall: bool = False) -> None:
        self.depth, self.fail_wr, self.stall = depth, fail_wr, stall
        self.queue: deque[WorkRequest] = deque()
        self.posted = self.retired = 0

    def post(self, wr: WorkRequest) -> None:
        assert self.posted - self.retired < self.depth, "send queue overflow"
        self.queue.append(wr)
        self.posted += 1

    def poll(self) -> list[tuple[int, int, int]]:
        if self.stall or not self.queue:
            return []
        wr = self.queue.popleft()
        if wr.wr_id == self.fail_wr:
            return [(wr.wr_id, 10, 0x88)]  # IBV_WC_REM_ACCESS_ERR
        ctypes.memmove(wr.remote_addr, wr.local_addr, wr.nbytes)
        if not wr.signaled:
            return []
        self.retired = wr.wr_id + 1
        return [(wr.wr_id, 0, 0)]


def _loopback_update(depth: int, signal_every: int, nic: LoopbackNic,
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One update through `drive_writes` and `nic`; four buckets, so both staging slots are reused.

    The clock ticks once per look, so a loop that stops making progress fails fast at the deadline.
    """
    engine = _engine_tensors()
    trainer = {name: torch.empty_like(t) for name, t in engine.items()}
    random_fill(engine, seed=0)
    random_fill(trainer, seed=1)
    buckets = split_buckets(trainer, 32)  # [w.a] (256 bytes), [w.b], [w.c, w.d], [w.e]
    assert len(buckets) == 4
    sizes = [[(name, tensor_nbytes(t)) for name, t in bucket] for bucket in buckets]
    layout, entries = layout_regions(tensor_spans(engine))
    regions = [RegionInfo(name=name, addr=addr, rkey=0, length=length) for name, addr, length in layout]
    slot_bytes = max(sum(n for _, n in bucket) for bucket in sizes)
    staging = torch.empty(2 * slot_bytes, dtype=torch.uint8)
    addrs = [staging.data_ptr() + (b % 2) * slot_bytes for b in range(len(buckets))]
    ticks = itertools.count()
    requests = work_requests(plan_writes(sizes, entries), sizes, regions, addrs, max_message_bytes=24,
                             signal_every=signal_every)
    drive_writes(requests, len(buckets), depth=depth,
                 pack=lambda b: pack_bucket(staging, (b % 2) * slot_bytes, buckets[b]), post=nic.post,
                 poll=nic.poll, deadline=10_000.0, clock=lambda: float(next(ticks)))
    return trainer, engine


@pytest.mark.parametrize(("depth", "signal_every"), [(1, 1), (4, 3), (64, 16)])
def test_loop_delivers_every_tensor_through_a_lazy_in_order_nic(depth: int, signal_every: int) -> None:
    trainer, engine = _loopback_update(depth, signal_every, LoopbackNic(depth))
    assert compare(checksums(trainer), checksums(engine)) == []


def test_loop_reports_a_failed_completion_with_its_status_and_tensors() -> None:
    with pytest.raises(TransportError, match=r"RDMA write 2 of \('w.a',\) failed: REM_ACCESS_ERR .*vendor error 136"):
        _loopback_update(4, 2, LoopbackNic(4, fail_wr=2))


def test_loop_gives_up_at_the_deadline_when_nothing_completes() -> None:
    with pytest.raises(TransportError, match="not acknowledged in time: 0 of"):
        _loopback_update(4, 2, LoopbackNic(4, stall=True))


# ----- the import guard and the wire -----


def test_without_pyverbs_building_an_endpoint_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import fails even where pyverbs is installed
    for build in (lambda: RdmaEngineSide({"w": torch.zeros(4)}), lambda: RdmaPusherSide(1024), list_devices):
        with pytest.raises(ImportError, match=r"pip install 'miles-async\[rdma\]'"):
            build()


def _device_or_skip() -> str:
    if importlib.util.find_spec("pyverbs") is None:
        pytest.skip("pyverbs is not installed (pip install 'miles-async[rdma]'; needs libibverbs/libnl headers)")
    devices = list_devices()
    if not devices:
        pytest.skip("no RDMA device with an ACTIVE port 1 (soft-RoCE: rdma link add rxe0 type rxe netdev eth0)")
    return devices[0]


def test_wire_writes_every_tensor_into_the_engines_registered_memory() -> None:
    device = _device_or_skip()
    engine_tensors = _engine_tensors()
    trainer = {name: torch.empty_like(t) for name, t in engine_tensors.items()}
    random_fill(engine_tensors, seed=0)
    random_fill(trainer, seed=1)
    buckets = split_buckets(trainer, 32)
    sizes = [[(name, tensor_nbytes(t)) for name, t in bucket] for bucket in buckets]
    with RdmaEngineSide(engine_tensors, device=device) as engine, \
            RdmaPusherSide(256, device=device, max_send_wr=4, signal_every=2) as pusher:
        engine.connect(pusher.info())
        pusher.connect(engine.info())
        pusher.write(plan_writes(sizes, engine.regions), buckets, timeout_s=10)
        assert compare(checksums(trainer), checksums(engine_tensors)) == []


def test_wire_write_with_a_wrong_rkey_fails_with_the_status() -> None:
    device = _device_or_skip()
    engine_tensors = _engine_tensors()
    buckets = split_buckets({name: torch.ones_like(t) for name, t in engine_tensors.items()}, 32)
    sizes = [[(name, tensor_nbytes(t)) for name, t in bucket] for bucket in buckets]
    with RdmaEngineSide(engine_tensors, device=device) as engine, RdmaPusherSide(256, device=device) as pusher:
        info = engine.info()
        forged = msgspec.structs.replace(info, regions=tuple(
            msgspec.structs.replace(r, rkey=r.rkey ^ 0xFF) for r in info.regions))
        engine.connect(pusher.info())
        pusher.connect(forged)
        with pytest.raises(TransportError, match="REM_ACCESS_ERR"):
            pusher.write(plan_writes(sizes, engine.regions), buckets, timeout_s=10)
        with pytest.raises(TransportError, match="an earlier write failed"):
            pusher.write(plan_writes(sizes, engine.regions), buckets, timeout_s=10)
