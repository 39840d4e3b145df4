"""RDMA weight transport: one-sided RDMA WRITEs from the trainer into engine-registered memory.

The engine (`RdmaEngineSide`) registers the memory holding its weight tensors (contiguous CPU
tensors; each distinct storage becomes one memory region with remote-write access) and publishes
an `EndpointInfo`: its queue pair's address (GID, LID, QP number, PSN, MTU) and every region's
(addr, rkey, length). The pusher (`RdmaPusherSide`) owns a registered CPU staging buffer of two
bucket-sized slots. The two sides swap `EndpointInfo`s (plain msgspec Structs that ride in the
actors' messages), `connect()` moves each reliable-connected QP to RTR/RTS, and
`pusher.write(plan, buckets)` packs bucket k into slot k % 2 and posts the RDMA WRITEs that
`rdma_plan.plan_writes` scheduled for it while bucket k - 1 is still on the wire. The engine's
CPU is not involved: when `write` returns, every byte has been acknowledged by the engine's NIC.

Pure functions make every decision and are tested without a device: `work_requests` (which
bytes go where, split at the device's message limit, which requests ask for a completion),
`drive_writes` with its `SendWindow` (the pack/post/poll loop: send-queue depth, staging slot
reuse, failed completions, the deadline; it takes post and poll as functions), `layout_regions`
(one region per storage) and `check_peer` (whether two endpoints can talk). The verbs calls
around them are thin and run only where a device is.

Install: `pip install 'miles-async[rdma]'`. pyverbs (rdma-core's Python bindings) needs the
libibverbs and libnl development headers to build (Debian/Ubuntu: `apt install libibverbs-dev
libnl-3-dev libnl-route-3-dev`; docs/design.md, "Weight transports", notes the Cython pitfalls), and an
RDMA device. Without RDMA hardware, soft-RoCE over any Ethernet interface works (the `rdma_rxe`
kernel module and iproute2's `rdma` tool):

    sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev eth0
    ibv_devices        # rxe0 should be listed; its port 1 must be ACTIVE

Run the wire test (skipped, with the reason, where pyverbs or a device is missing):
    pytest tests/unit/test_transport_rdma_wire.py -rs
Try it: `python -c "from miles_async.transport.rdma import list_devices; print(list_devices())"`.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from miles_async.transport.buckets import tensor_nbytes
from miles_async.transport.errors import TransportError
from miles_async.transport.rdma_plan import RdmaWrite

if TYPE_CHECKING:
    from typing_extensions import Self

# ibv_sge.length is 32-bit and RC messages are capped at 2 GiB on common devices (port max_msg_sz).
MAX_MESSAGE_BYTES = 1 << 31
MTU_BYTES = (256, 512, 1024, 2048, 4096)  # enum ibv_mtu: IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5
_PSN_LIMIT = 1 << 24  # PSNs and QP numbers are 24-bit
# enum ibv_wc_status, in order (verbs.h; ibv_wc_status_str)
WC_STATUS_NAMES = (
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR",
    "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR",
    "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR",
)


def require_pyverbs() -> ModuleType:
    """Return the `pyverbs` module, or raise ImportError naming the `[rdma]` extra."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError as e:
        raise ImportError("the RDMA transport needs pyverbs: pip install 'miles-async[rdma]' "
                          "(needs libibverbs and libnl headers, and an RDMA device or soft-RoCE)") from e


def _verbs() -> SimpleNamespace:
    require_pyverbs()
    names = ("device", "pd", "mr", "cq", "qp", "addr", "wr", "enums", "pyverbs_error")
    return SimpleNamespace(**{n: importlib.import_module(f"pyverbs.{n}") for n in names})


# ----- what the two sides exchange (rides in actor messages) -----


class RegionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One registered engine memory region: the remote side writes [addr, addr + length) with rkey."""

    name: str
    addr: int
    rkey: int
    length: int


class EndpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A queue pair's address, and (engine side) the regions it accepts writes into; index = region id."""

    device: str
    port: int
    gid: str  # 'xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx', as pyverbs' GID.gid prints it
    gid_index: int
    lid: int
    qp_num: int
    psn: int
    mtu: int  # bytes: 256 ... 4096
    regions: tuple[RegionInfo, ...] = ()


# ----- pure decisions -----


def normalize_gid(gid: str) -> str:
    """`gid` (8 colon-separated groups of 1-4 hex digits, or 32 hex digits) as pyverbs' 8 x 4-digit form."""
    groups = gid.split(":") if ":" in gid else [gid[i:i + 4] for i in range(0, len(gid), 4)]
    if len(groups) != 8 or not all(1 <= len(g) <= 4 for g in groups) or (":" not in gid and len(gid) != 32):
        raise ValueError(f"GID {gid!r} is not 8 colon-separated hex groups or 32 hex digits")
    try:
        values = [int(g, 16) for g in groups]
    except ValueError:
        raise ValueError(f"GID {gid!r} has a non-hex group") from None
    return ":".join(f"{v:04x}" for v in values)


def pick_gid_index(gids: Sequence[str]) -> int:
    """The port's GID to use by default: the first IPv4-mapped one (routable RoCE), else the first non-zero."""
    normalized = [normalize_gid(g) for g in gids]
    for index, gid in enumerate(normalized):
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return index
    for index, gid in enumerate(normalized):
        if gid != "0000:0000:0000:0000:0000:0000:0000:0000":
            return index
    raise TransportError("the port's GID table is empty: is the link up (soft-RoCE: does its netdev have an address)?")


def mtu_enum(mtu_bytes: int) -> int:
    """Path MTU in bytes -> enum ibv_mtu value (256 -> 1 ... 4096 -> 5)."""
    if mtu_bytes not in MTU_BYTES:
        raise ValueError(f"MTU {mtu_bytes} is not one of {MTU_BYTES}")
    return MTU_BYTES.index(mtu_bytes) + 1


def mtu_bytes(mtu: int) -> int:
    """enum ibv_mtu value -> bytes."""
    if not 1 <= mtu <= len(MTU_BYTES):
        raise ValueError(f"ibv_mtu value {mtu} is not in 1..{len(MTU_BYTES)}")
    return MTU_BYTES[mtu - 1]


def wc_status_name(status: int) -> str:
    return WC_STATUS_NAMES[status] if 0 <= status < len(WC_STATUS_NAMES) else f"UNKNOWN({status})"


def check_peer(local: EndpointInfo, peer: EndpointInfo) -> int:
    """Raise ValueError naming what makes `peer` unusable from `local`; return the path MTU in bytes."""
    for side, info in (("local", local), ("peer", peer)):
        gid = normalize_gid(info.gid)
        if info.mtu not in MTU_BYTES:
            raise ValueError(f"{side} endpoint MTU {info.mtu} is not one of {MTU_BYTES}")
        if not 0 < info.qp_num < _PSN_LIMIT or not 0 <= info.psn < _PSN_LIMIT:
            raise ValueError(f"{side} endpoint QP number {info.qp_num} / PSN {info.psn} are not 24-bit")
        if not 0 <= info.lid < 1 << 16 or info.port < 1:
            raise ValueError(f"{side} endpoint LID {info.lid} / port {info.port} are out of range")
        if info.lid == 0 and gid == normalize_gid("0" * 32):
            raise ValueError(f"{side} endpoint has neither a GID nor a LID: it cannot be addressed")
        for region in info.regions:
            if region.addr < 0 or region.length < 0 or not 0 <= region.rkey < 1 << 32:
                raise ValueError(f"{side} region {region.name!r} has addr {region.addr}, "
                                 f"length {region.length}, rkey {region.rkey}: out of range")
    return min(local.mtu, peer.mtu)


def layout_regions(spans: Mapping[str, tuple[int, int, int, int]]
                   ) -> tuple[list[tuple[str, int, int]], dict[str, tuple[int, int, int]]]:
    """Memory regions for tensors given as name -> (storage addr, storage nbytes, tensor addr, nbytes).

    One region per distinct storage (so one big buffer holding every tensor is one registration),
    named after its first tensor. Returns the regions as (name, addr, length) and name ->
    (region id, offset, nbytes), the shape `rdma_plan.plan_writes` takes. Empty tensors map to
    (0, 0, 0): nothing is written for them.
    """
    region_of: dict[tuple[int, int], int] = {}
    regions: list[tuple[str, int, int]] = []
    entries: dict[str, tuple[int, int, int]] = {}
    for name, (base, length, addr, nbytes) in sorted(spans.items(), key=lambda kv: (kv[1][0], kv[1][2])):
        if nbytes == 0:
            continue
        if not base <= addr or addr + nbytes > base + length:
            raise ValueError(f"tensor {name!r} [{addr:#x}, +{nbytes}) lies outside its storage "
                             f"[{base:#x}, +{length})")
        key = (base, length)
        if key not in region_of:
            region_of[key] = len(regions)
            regions.append((name, base, length))
        entries[name] = (region_of[key], addr - base, nbytes)
    if not regions:
        raise ValueError("no tensor with at least one element to register")
    for name, (_, _, _, nbytes) in spans.items():
        if nbytes == 0:
            entries[name] = (0, 0, 0)
    return regions, {name: entries[name] for name in spans}


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA_WRITE work request: `nbytes` from local `local_addr` to remote `remote_addr` (rkey)."""

    wr_id: int
    bucket: int
    local_addr: int
    remote_addr: int
    rkey: int
    nbytes: int
    signaled: bool
    names: tuple[str, ...]


def work_requests(plan: Sequence[RdmaWrite], buckets: Sequence[Sequence[tuple[str, int]]],
                  regions: Sequence[RegionInfo], bucket_addrs: Sequence[int], *,
                  max_message_bytes: int = MAX_MESSAGE_BYTES, signal_every: int = 16) -> list[WorkRequest]:
    """The plan as work requests, in order, with wr_id = index.

    `buckets` are the (name, nbytes) buckets the plan was made from, packed at `bucket_addrs`;
    `regions` are the engine's, indexed by the plan's region ids. A write larger than
    `max_message_bytes` is split; empty writes are dropped. Every `signal_every`-th request and
    the last request of each bucket ask for a completion: RC completes in order, so one
    completion retires every earlier request, and a bucket's staging slot is free once its last
    request completed. Raises ValueError if the plan does not match the buckets or the regions.
    """
    if signal_every < 1 or max_message_bytes < 1:
        raise ValueError(f"signal_every ({signal_every}) and max_message_bytes ({max_message_bytes}) must be >= 1")
    if len(bucket_addrs) != len(buckets):
        raise ValueError(f"{len(bucket_addrs)} bucket addresses for {len(buckets)} buckets")
    layout: dict[str, tuple[int, int, int]] = {}
    for b, bucket in enumerate(buckets):
        offset = 0
        for name, nbytes in bucket:
            layout[name] = (b, offset, nbytes)
            offset += nbytes
    out: list[WorkRequest] = []
    last_bucket = 0
    for w in plan:
        _check_write(w, layout, regions, len(buckets))
        if w.src_bucket < last_bucket:
            raise ValueError(f"the plan goes back from bucket {last_bucket} to {w.src_bucket}: "
                             "writes must be in bucket order")
        last_bucket = w.src_bucket
        region = regions[w.dst_region]
        for start in range(0, w.nbytes, max_message_bytes):
            nbytes = min(max_message_bytes, w.nbytes - start)
            out.append(WorkRequest(len(out), w.src_bucket, bucket_addrs[w.src_bucket] + w.src_offset + start,
                                   region.addr + w.dst_offset + start, region.rkey, nbytes,
                                   (len(out) + 1) % signal_every == 0, w.names))
    for i, wr in enumerate(out):
        if i + 1 == len(out) or out[i + 1].bucket != wr.bucket:
            out[i] = WorkRequest(wr.wr_id, wr.bucket, wr.local_addr, wr.remote_addr, wr.rkey, wr.nbytes,
                                 True, wr.names)
    return out


def _check_write(w: RdmaWrite, layout: Mapping[str, tuple[int, int, int]], regions: Sequence[RegionInfo],
                 num_buckets: int) -> None:
    if not 0 <= w.src_bucket < num_buckets:
        raise ValueError(f"write of {w.names} reads bucket {w.src_bucket}; there are {num_buckets}")
    if not 0 <= w.dst_region < len(regions):
        raise ValueError(f"write of {w.names} targets region {w.dst_region}; the engine has {len(regions)}")
    offset = w.src_offset
    for name in w.names:
        if name not in layout or layout[name][:2] != (w.src_bucket, offset):
            raise ValueError(f"write of {w.names}: tensor {name!r} is not at bucket {w.src_bucket} "
                             f"offset {offset} in the buckets given (plan made from other buckets?)")
        offset += layout[name][2]
    if offset - w.src_offset != w.nbytes:
        raise ValueError(f"write of {w.names} is {w.nbytes} bytes; its tensors are {offset - w.src_offset}")
    region = regions[w.dst_region]
    if w.dst_offset < 0 or w.dst_offset + w.nbytes > region.length:
        raise ValueError(f"write of {w.names} to [{w.dst_offset}, {w.dst_offset + w.nbytes}) overruns "
                         f"region {w.dst_region} ({region.name!r}, {region.length} bytes)")


class SendWindow:
    """Send-queue occupancy: a request holds its slot until a completion at or after it is polled.

    RC completes requests in order, so polling the completion of signalled request k retires
    every request <= k, signalled or not. At most `depth` (the QP's max_send_wr) may be in flight.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"send queue depth must be >= 1, got {depth}")
        self.depth = depth
        self.posted = 0
        self.completed = 0

    def room(self) -> int:
        return self.depth - (self.posted - self.completed)

    def on_post(self) -> None:
        assert self.room() > 0, "posted past the send queue's depth"
        self.posted += 1

    def on_completion(self, wr_id: int) -> None:
        assert self.completed <= wr_id < self.posted, f"completion {wr_id} outside [{self.completed}, {self.posted})"
        self.completed = wr_id + 1

    def done(self, wr_id: int) -> bool:
        return wr_id < self.completed


def drive_writes(requests: Sequence[WorkRequest], num_buckets: int, *, depth: int, pack: Callable[[int], None],
                 post: Callable[[WorkRequest], None], poll: Callable[[], list[tuple[int, int, int]]],
                 deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Pack and post bucket after bucket through a send queue of `depth`; return when all completed.

    `pack(b)` fills bucket b's staging slot (two slots, alternating), `post` hands one request to
    the QP, `poll()` returns completions as (wr_id, status, vendor error), status 0 being
    IBV_WC_SUCCESS. Bucket b is packed only after every request of buckets <= b - 2 (the last
    users of its slot) completed. Raises TransportError on a failed completion or once `clock()`
    passes `deadline` with nothing completing.
    """
    window = SendWindow(depth)
    bucket_of = [wr.bucket for wr in requests]

    def wait(ready: Callable[[], bool]) -> None:
        while not ready():
            completions = poll()
            for wr_id, status, vendor_err in completions:
                if status != 0:
                    names = requests[wr_id].names if 0 <= wr_id < len(requests) else ()
                    raise TransportError(f"RDMA write {wr_id} of {names} failed: {wc_status_name(status)} "
                                         f"(status {status}, vendor error {vendor_err})")
                window.on_completion(wr_id)
            if not completions and clock() > deadline:
                raise TransportError(f"RDMA writes not acknowledged in time: {window.completed} of "
                                     f"{len(requests)} done, {window.posted} posted")

    next_wr = 0
    for b in range(num_buckets):
        last_old = bisect.bisect_right(bucket_of, b - 2) - 1  # requests are in bucket order
        if last_old >= 0:
            wait(functools.partial(window.done, last_old))
        pack(b)
        while next_wr < len(requests) and requests[next_wr].bucket == b:
            wait(lambda: window.room() > 0)
            post(requests[next_wr])
            window.on_post()
            next_wr += 1
    if requests:
        wait(lambda: window.done(len(requests) - 1))


def pack_bucket(staging: torch.Tensor, offset: int, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy the bucket's tensors back to back into the uint8 `staging` from `offset` (the planner's layout)."""
    for _, tensor in bucket:
        nbytes = tensor_nbytes(tensor)
        staging[offset:offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        offset += nbytes


def tensor_spans(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int, int, int]]:
    """name -> (storage addr, storage nbytes, tensor addr, nbytes) of contiguous CPU tensors, for `layout_regions`."""
    spans = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"engine tensor {name!r} is on {t.device}, contiguous={t.is_contiguous()}: the RDMA "
                             "engine side registers contiguous CPU tensors only (GPU needs GPUDirect RDMA)")
        storage = t.untyped_storage()
        spans[name] = (storage.data_ptr(), storage.nbytes(), t.data_ptr(), tensor_nbytes(t))
    return spans


# ----- the verbs -----


def list_devices(port: int = 1) -> list[str]:
    """Names of the RDMA devices whose `port` is ACTIVE (imports pyverbs)."""
    pv = _verbs()
    active = []
    for dev in pv.device.get_device_list():
        name = dev.name.decode()
        ctx = pv.device.Context(name=name)
        try:
            if ctx.query_port(port).state == pv.enums.IBV_PORT_ACTIVE:
                active.append(name)
        finally:
            ctx.close()
    return active


class _Endpoint:
    """Context, PD, CQ and one RC QP on a device port, plus the memory regions registered on it."""

    def __init__(self, pv: SimpleNamespace, device: str | None, port: int, gid_index: int | None,
                 max_send_wr: int, qp_access: int) -> None:
        self.pv = pv
        self.qp: Any = None
        self.cq: Any = None
        self.pd: Any = None
        self.mrs: list[Any] = []
        names = [d.name.decode() for d in pv.device.get_device_list()]
        if not names:
            raise TransportError("no RDMA device found (soft-RoCE: rdma link add rxe0 type rxe netdev eth0)")
        if device is not None and device not in names:
            raise ValueError(f"RDMA device {device!r} not found; devices: {names}")
        self.device = device or names[0]
        self.port = port
        self.ctx: Any = pv.device.Context(name=self.device)
        try:
            self._open(gid_index, max_send_wr, qp_access)
        except BaseException:
            self.close()
            raise

    def _open(self, gid_index: int | None, max_send_wr: int, qp_access: int) -> None:
        pv, e = self.pv, self.pv.enums
        port_attr = self.ctx.query_port(self.port)
        if port_attr.state != e.IBV_PORT_ACTIVE:
            raise TransportError(f"port {self.port} of {self.device} is not ACTIVE (state {port_attr.state})")
        if gid_index is None:
            gid_index = pick_gid_index(list(self._gids(port_attr.gid_tbl_len)))
        self.gid_index = gid_index
        self.gid = normalize_gid(self.ctx.query_gid(self.port, gid_index).gid)
        self.lid = port_attr.lid
        self.mtu = mtu_bytes(port_attr.active_mtu)
        self.max_message_bytes = min(MAX_MESSAGE_BYTES, port_attr.max_msg_sz)
        self.max_send_wr = min(max_send_wr, self.ctx.query_device().max_qp_wr)
        self.pd = pv.pd.PD(self.ctx)
        self.cq = pv.cq.CQ(self.ctx, self.max_send_wr, None, None, 0)
        cap = pv.qp.QPCap(max_send_wr=self.max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = qp_access
        self.qp = pv.qp.QP(self.pd, init, attr)  # pyverbs leaves an RC QP given a QPAttr in INIT
        self.psn = random.getrandbits(24)

    def _gids(self, table_len: int) -> Iterator[str]:
        for index in range(table_len):
            try:
                yield self.ctx.query_gid(self.port, index).gid
            except self.pv.pyverbs_error.PyverbsRDMAError:  # an unpopulated entry on newer kernels
                yield "0" * 32

    def register(self, addr: int, length: int, access: int) -> Any:
        mr = self.pv.mr.MR(self.pd, length, access, address=addr)
        self.mrs.append(mr)
        return mr

    def info(self, regions: tuple[RegionInfo, ...] = ()) -> EndpointInfo:
        return EndpointInfo(device=self.device, port=self.port, gid=self.gid, gid_index=self.gid_index,
                            lid=self.lid, qp_num=self.qp.qp_num, psn=self.psn, mtu=self.mtu, regions=regions)

    def connect(self, local: EndpointInfo, peer: EndpointInfo) -> None:
        pv = self.pv
        path_mtu = check_peer(local, peer)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.path_mtu = mtu_enum(path_mtu)
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn  # the peer sends from its PSN; we send from ours
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 ~ 67 ms per transport retry
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        route = pv.addr.GlobalRoute(dgid=pv.addr.GID(normalize_gid(peer.gid)), sgid_index=self.gid_index,
                                    hop_limit=64)
        attr.ah_attr = pv.addr.AHAttr(port_num=self.port, is_global=1, gr=route, dlid=peer.lid)
        self.qp.to_rts(attr)  # INIT -> RTR -> RTS

    def close(self) -> None:
        for obj in (self.qp, *self.mrs, self.cq, self.pd, self.ctx):
            if obj is not None:
                obj.close()
        self.qp = self.cq = self.pd = self.ctx = None
        self.mrs = []


class _Side:
    """What both sides share: the endpoint's device name and closing it (also on leaving a `with`)."""

    _ep: _Endpoint

    @property
    def device(self) -> str:
        return self._ep.device

    def close(self) -> None:
        self._ep.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RdmaEngineSide(_Side):
    """The receiver: registers the engine's weight tensors for remote writes and publishes where they are.

    `tensors` must be contiguous CPU tensors (GPU memory would need GPUDirect RDMA); they stay
    registered, and must stay allocated, until `close()`. `regions` is name -> (region id,
    offset, nbytes) for `rdma_plan.plan_writes`.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, device: str | None = None, port: int = 1,
                 gid_index: int | None = None) -> None:
        pv = _verbs()
        layout, self.regions = layout_regions(tensor_spans(tensors))
        self._tensors = dict(tensors)  # registered memory must outlive the registration
        e = pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE  # verbs: remote write needs local write
        self._ep = _Endpoint(pv, device, port, gid_index, max_send_wr=1, qp_access=access)
        try:
            mrs = [self._ep.register(addr, length, access) for _, addr, length in layout]
        except BaseException:
            self._ep.close()
            raise
        self._region_infos = tuple(RegionInfo(name=name, addr=addr, rkey=mr.rkey, length=length)
                                   for (name, addr, length), mr in zip(layout, mrs, strict=True))


    def info(self) -> EndpointInfo:
        return self._ep.info(self._region_infos)

    def connect(self, peer: EndpointInfo) -> None:
        self._ep.connect(self.info(), peer)



class RdmaPusherSide(_Side):
    """The sender: a registered two-slot staging buffer and an RC QP that writes into the engine's regions.

    `slot_bytes` bounds a bucket (use the transport's bucket size); `max_send_wr` bounds the
    requests in flight and `signal_every` how often one asks for a completion.
    """

    def __init__(self, slot_bytes: int, *, device: str | None = None, port: int = 1,
                 gid_index: int | None = None, max_send_wr: int = 256, signal_every: int = 16) -> None:
        pv = _verbs()
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        if not 1 <= signal_every <= max_send_wr:
            raise ValueError(f"signal_every ({signal_every}) must be in 1..max_send_wr ({max_send_wr}), "
                             "or a full send queue would hold no request that completes")
        self.slot_bytes = slot_bytes
        self._staging = torch.empty(2 * slot_bytes, dtype=torch.uint8)
        e = pv.enums
        self._ep = _Endpoint(pv, device, port, gid_index, max_send_wr=max_send_wr,
                             qp_access=e.IBV_ACCESS_LOCAL_WRITE)
        self._signal_every = min(signal_every, self._ep.max_send_wr)
        try:
            self._mr = self._ep.register(self._staging.data_ptr(), self._staging.numel(), e.IBV_ACCESS_LOCAL_WRITE)
        except BaseException:
            self._ep.close()
            raise
        self._peer: EndpointInfo | None = None
        self._broken: str | None = None


    def info(self) -> EndpointInfo:
        return self._ep.info()

    def connect(self, peer: EndpointInfo) -> None:
        self._ep.connect(self.info(), peer)
        self._peer = peer

    def write(self, plan: Sequence[RdmaWrite], buckets: Sequence[Sequence[tuple[str, torch.Tensor]]], *,
              timeout_s: float = 60.0) -> None:
        """Write `buckets` (those `plan` was made from) into the engine; return once all are acknowledged.

        Raises TransportError on a failed completion (naming its status and tensors) or when
        `timeout_s` passes; the QP is then unusable and this pusher refuses further writes.
        """
        if self._peer is None:
            raise TransportError("connect() to the engine's EndpointInfo before write()")
        if self._broken is not None:
            raise TransportError(f"an earlier write failed ({self._broken}); make a new pusher and reconnect")
        sizes = [[(name, tensor_nbytes(t)) for name, t in bucket] for bucket in buckets]
        for b, bucket in enumerate(sizes):
            if sum(n for _, n in bucket) > self.slot_bytes:
                raise ValueError(f"bucket {b} is {sum(n for _, n in bucket)} bytes; slot_bytes is {self.slot_bytes}")
        base = self._staging.data_ptr()
        addrs = [base + (b % 2) * self.slot_bytes for b in range(len(buckets))]
        requests = work_requests(plan, sizes, self._peer.regions, addrs,
                                 max_message_bytes=self._ep.max_message_bytes, signal_every=self._signal_every)
        try:
            drive_writes(requests, len(buckets), depth=self._ep.max_send_wr,
                         pack=lambda b: pack_bucket(self._staging, (b % 2) * self.slot_bytes, buckets[b]),
                         post=self._post, poll=self._poll, deadline=time.monotonic() + timeout_s)
        except TransportError as err:
            self._broken = str(err)
            raise

    def _post(self, wr: WorkRequest) -> None:
        pv, e = self._ep.pv, self._ep.pv.enums
        sge = pv.wr.SGE(wr.local_addr, wr.nbytes, self._mr.lkey)
        send = pv.wr.SendWR(wr_id=wr.wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                            send_flags=e.IBV_SEND_SIGNALED if wr.signaled else 0)
        send.set_wr_rdma(wr.rkey, wr.remote_addr)
        self._ep.qp.post_send(send)

    def _poll(self) -> list[tuple[int, int, int]]:
        _, completions = self._ep.cq.poll(num_entries=16)
        return [(wc.wr_id, wc.status, wc.vendor_err) for wc in completions]

