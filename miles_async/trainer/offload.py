"""`StreamingAdamW`: AdamW whose state lives on disk and passes through memory a bucket at a time.

What it is for: the optimizer state of a model trained in mixed precision is 12 bytes a
parameter (fp32 master weights, exp_avg and exp_avg_sq), six times its bf16 weights and most of
a trainer's memory. Here that state lives in
one file, and a step streams it: a reader thread loads bucket i+1 while the main thread steps
bucket i, and a writer thread writes bucket i back while bucket i+1 is stepped. Between steps no
state is in memory; during one, two bucket buffers are (the next bucket's read waits for the
write out of the buffer it reuses), so the state's peak is 2 x `bucket_bytes`, whatever the
model's size (`peak_state_bytes` records it), plus, for bf16 parameters, an fp32 copy of one
bucket's gradients (`peak_scratch_bytes`, a third of a bucket).

The update is torch's fused AdamW kernel (`torch._fused_adamw_`) run on each bucket's slices, so
float32 parameters come out bit for bit as `torch.optim.AdamW(fused=True)` leaves them (the
kernel is elementwise, and a parameter is cut only at multiples of `SPLIT_ALIGN` elements, where
it gives the same bits; tests/unit/test_optimizer_offload.py checks it). Parameters of another dtype (bf16) get an fp32 master copy in the file: the kernel
steps the master with the gradient in fp32, and the parameter is the master rounded to its dtype
(mixed precision without fp32 weights in memory; the in-memory `torch.optim.AdamW` would keep
bf16 moments instead). Parameters may be FSDP2 DTensors: each rank steps its local shards.

The file: one per optimizer, laid out by kind ([exp_avg | exp_avg_sq | master], each the
parameters' elements end to end, a bucket a range of each), created nameless in `folder`
(`tempfile.TemporaryFile`: O_TMPFILE, or unlinked at once), so that it vanishes when the optimizer is closed or collected or the process dies
however it dies (its space shows in `df`, not in `ls`). Its whole size is reserved up front
(`posix_fallocate`), so that a full disk fails at construction, not in the middle of a step.
Buffered I/O by default: the kernel's page cache, memory it may take back, absorbs what fits, and
the process's own memory stays at two buckets. `drop_page_cache=True` syncs each bucket written and
evicts what it read or wrote, so that the state really is on disk (its cost is the disk's
write rate; `miles_async/bench/optimizer.py` measures both).

Checkpoints (`trainer/checkpoint.py`, torch.distributed.checkpoint's `get_state_dict`): the state
dict holds, per parameter, torch AdamW's "step", "exp_avg" and "exp_avg_sq" (fp32), plus "master"
with a master copy, as tensors mapped onto the file (DTensors over the local shards for a
sharded parameter). Reading it is reading the file: `checkpoint.stage` copies it into memory (the
whole state, once, while the save lasts: the price of staging so that training can go on), and
`dcp.load` writes into the mapping, so a load puts the checkpoint into the file with no copy in
memory. A resume is exact (the master is restored, not re-derived from the bf16 weights).

Measured (`miles-async bench optimizer --json --threads 1`, and `--model random --params 1e9
--dtype bfloat16 --steps 2`; this repository's 2-core CPU VM, shared with other work, state in
/tmp on its virtual disk, 64 MiB buckets; "added" is the process's peak memory above its
weights and gradients):
- SmolLM2-135M, fp32 (1.0 GiB of state): torch in memory 0.072 s a step, 0.94 GB added; streamed
  0.35 s (4.9x), 0.135 GB added (the two buckets); with `drop_page_cache` 1.09 s (2.6x the
  disk's bound of 0.42 s at its measured rates; 0.92 s in another run).
- A random 1.01B-parameter model in bf16 (11.3 GiB of fp32 master and moments on disk): torch
  in memory (bf16 moments) 0.67 s, 3.96 GB added; streamed 4.70 s (7.1x; the page cache held the
  state, so 0.58x the disk's bound of 8.1 s), 0.136 GB added; with `drop_page_cache` 10.1 s
  (1.25x the bound). An in-memory fp32-master AdamW would add 12.1 GB (16 GB with the weights and
  gradients): not run.

Try it:

    opt = StreamingAdamW(model.parameters(), lr=1e-5, bucket_mib=64)  # state in a nameless file in /tmp
    loss.backward(); opt.step(); opt.zero_grad()
    opt.close()  # or let it be collected

Limits: CPU tensors only (a GPU trainer would stage each bucket through pinned memory: not done);
no amsgrad or maximize; the parameter groups are fixed at construction. A checkpoint saved with
one optimizer_offload setting loads with the other for float32 weights; for bf16 ones only from
"disk" to "none" (moments rounded to bf16, the master dropped): the other way has no master.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from miles_async.trainer.fsdp import is_dtensor

FLOAT_BYTES = 4  # the state is float32 whatever the parameters' dtype
IO_CHUNK_BYTES = 64 << 20  # one pread/pwrite call (Linux moves at most ~2 GiB per call)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch's CPU AdamW kernel runs whole SIMD vectors from a tensor's start (in tasks of 16 floats)
# and the last `numel % vector width` elements one by one, which rounds a little differently
# (seen: 1 ulp in exp_avg_sq). Cutting parameters at multiples of 64 elements keeps every
# element on the path it takes in torch's own whole-tensor call, hence the same bits.
SPLIT_ALIGN = 64
# The rest of torch AdamW's param group, as this update is: a checkpoint's param groups then have
# the same keys whichever optimizer saved it, so that one saved with optimizer_offload "disk"
# loads into the in-memory optimizer and back (torch.distributed.checkpoint wants every key).
TORCH_FLAGS: dict[str, Any] = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                               "differentiable": False, "fused": True, "decoupled_weight_decay": True}


@dataclass(frozen=True)
class _Segment:
    """Elements [start, stop) of parameter `param_index`'s flat local tensor, at `offset` in its bucket."""

    param_index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class _Bucket:
    """Elements [start, start + numel) of each kind's section of the file; one param group's."""

    group_index: int
    start: int
    numel: int
    segments: tuple[_Segment, ...]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) parameter or gradient."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` as the parameter is held: a DTensor with its sharding when the parameter is one."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def _open_state_file(folder: str | Path, num_bytes: int) -> IO[bytes]:
    """A nameless read-write file of `num_bytes` reserved in `folder`; ValueError naming the folder
    when it cannot be written or lacks the room."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # no context manager: the file lives as long as the optimizer, which closes it
        file = tempfile.TemporaryFile(dir=folder, prefix="adamw-state-")  # noqa: SIM115
    except OSError as e:
        raise ValueError(f"cannot keep the optimizer state in {str(folder)!r} ({e}); give a writable folder "
                         "(TrainerConfig.optimizer_dir)") from e
    try:
        os.posix_fallocate(file.fileno(), 0, max(num_bytes, 1))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            file.close()
            free = shutil.disk_usage(folder).free
            raise ValueError(f"the optimizer state needs {num_bytes / 2**30:.2f} GiB in {str(folder)!r}, which has "
                             f"{free / 2**30:.2f} GiB free; free some or choose another folder") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: sparse instead
            file.close()
            raise
        os.ftruncate(file.fileno(), num_bytes)
    return file


class StreamingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's update) with its state in a file, streamed per bucket.

    `folder`: where the state file goes (None: the system's temporary folder; it should be a real
    disk: on tmpfs the "disk" is memory). `bucket_mib`: the state bytes of one bucket (8 bytes an
    element, 12 with a master copy); two buckets are in memory during a step. Large parameters
    are split across buckets. The rest as `torch.optim.AdamW`.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 folder: str | Path | None = None, bucket_mib: float = 64.0, drop_page_cache: bool = False) -> None:
        if not (isinstance(bucket_mib, (int, float)) and math.isfinite(bucket_mib) and bucket_mib > 0):
            raise ValueError(f"bucket_mib must be a positive number of MiB, got {bucket_mib!r}")
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        self._laid_out = False
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **TORCH_FLAGS})
        self._params: list[torch.Tensor] = [p for group in self.param_groups for p in group["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError("a parameter appears twice in the optimizer's groups")
        for i, param in enumerate(self._params):
            local = _local(param.detach())
            if param.dtype not in PARAM_DTYPES:
                raise TypeError(f"parameter {i} is {param.dtype}; StreamingAdamW steps {PARAM_DTYPES}")
            if local.device.type != "cpu":
                raise ValueError(f"parameter {i} is on {local.device}; StreamingAdamW steps CPU tensors only")
            if not local.is_contiguous():
                raise ValueError(f"parameter {i}'s local tensor is not contiguous; StreamingAdamW slices it flat")
            # a defaultdict entry per parameter: torch.distributed.checkpoint then sees a started
            # optimizer and does not run its zero-gradient step to create the state
            self.state[param]["step"] = torch.tensor(0.0, dtype=torch.float32)  # as fused AdamW holds it
        self.drop_page_cache = drop_page_cache
        self.has_master = any(p.dtype != torch.float32 for p in self._params)
        self.kinds: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "master") if self.has_master else ("exp_avg",
                                                                                                    "exp_avg_sq")
        self._numels = [_local(p.detach()).numel() for p in self._params]
        self._offsets = [sum(self._numels[:i]) for i in range(len(self._numels))]
        self.total_numel = sum(self._numels)
        element_bytes = FLOAT_BYTES * len(self.kinds)
        self._bucket_numel = max(SPLIT_ALIGN, int(bucket_mib * 2**20) // element_bytes)
        self._buckets = self._lay_out()
        self.num_buckets = len(self._buckets)
        self.bucket_bytes = max((b.numel for b in self._buckets), default=0) * element_bytes  # the largest
        self.state_bytes = self.total_numel * element_bytes  # the file's size
        self._fresh = [True] * len(self._buckets)  # never written: zeros, and the master is the parameter
        self._file = _open_state_file(folder if folder else tempfile.gettempdir(), self.state_bytes)
        self._fd: int = self._file.fileno()
        self._closed = False
        self._lock = threading.Lock()  # guards the counters below (the I/O threads update them)
        self._resident_bytes = 0
        self.peak_state_bytes = 0  # high-water mark of bucket buffers in memory
        self.peak_scratch_bytes = 0  # fp32 gradients of one bucket (non-fp32 parameters only)
        self.bytes_read = 0
        self.bytes_written = 0
        self._laid_out = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_laid_out", False):
            raise RuntimeError("StreamingAdamW lays out its state file at construction: give every param "
                               "group to the constructor")
        super().add_param_group(param_group)

    def _lay_out(self) -> list[_Bucket]:
        """Cut each group's elements, parameter after parameter, into buckets of `_bucket_numel`."""
        buckets: list[_Bucket] = []
        index = 0
        for group_index, group in enumerate(self.param_groups):
            segments: list[_Segment] = []
            start = fill = 0
            for _ in group["params"]:
                numel, at = self._numels[index], 0
                if not segments and fill == 0:
                    start = self._offsets[index]
                while at < numel:
                    take = min(numel - at, self._bucket_numel - fill)
                    if at + take < numel:  # a cut inside the parameter: on the kernel's grid (SPLIT_ALIGN)
                        take -= take % SPLIT_ALIGN
                    if take:
                        segments.append(_Segment(index, at, at + take, fill))
                        at, fill = at + take, fill + take
                    if fill == self._bucket_numel or (at < numel and fill > self._bucket_numel - SPLIT_ALIGN):
                        buckets.append(_Bucket(group_index, start, fill, tuple(segments)))
                        segments, start, fill = [], start + fill, 0
                index += 1
            if segments:
                buckets.append(_Bucket(group_index, start, fill, tuple(segments)))
        return buckets

    # --- I/O (the reader and writer threads) ---

    def _ranges(self, bucket: _Bucket) -> list[tuple[int, int, int]]:
        """(byte offset in the buffer, byte offset in the file, bytes) of each kind's part of a bucket."""
        n = bucket.numel * FLOAT_BYTES
        return [(k * n, (k * self.total_numel + bucket.start) * FLOAT_BYTES, n) for k in range(len(self.kinds))]

    def _read(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        view = buffer.numpy().data.cast("B")
        for at, offset, size in self._ranges(bucket):
            done = 0
            while done < size:
                got = os.preadv(self._fd, [view[at + done:at + min(size, done + IO_CHUNK_BYTES)]], offset + done)
                if got <= 0:
                    raise OSError(f"the optimizer state file ended at byte {offset + done}")
                done += got
            if self.drop_page_cache:
                os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += bucket.numel * FLOAT_BYTES * len(self.kinds)

    def _write(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        view = buffer.numpy().data.cast("B")
        ranges = self._ranges(bucket)
        for at, offset, size in ranges:
            done = 0
            while done < size:
                done += os.pwrite(self._fd, view[at + done:at + min(size, done + IO_CHUNK_BYTES)], offset + done)
        if self.drop_page_cache:  # on the disk, then out of the page cache (only clean pages can go)
            os.fdatasync(self._fd)
            for _, offset, size in ranges:
                os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_written += bucket.numel * FLOAT_BYTES * len(self.kinds)

    def _load(self, index: int, buffer: torch.Tensor, after: Future[None] | None) -> None:
        """Bucket `index`'s state into `buffer`, once the write out of `buffer` (`after`) is done."""
        if after is not None:
            after.result()  # the buffer still holds the bucket before last until it is written
        bucket = self._buckets[index]
        if not self._fresh[index]:
            self._read(bucket, buffer)
            return
        n = bucket.numel
        buffer[:2 * n].zero_()
        if self.has_master:
            for seg in bucket.segments:
                flat = _local(self._params[seg.param_index].detach()).reshape(-1)
                buffer[2 * n + seg.offset:2 * n + seg.offset + seg.stop - seg.start].copy_(flat[seg.start:seg.stop])

    # --- the step ---

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient, streaming its buckets through memory."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [None if p.grad is None else _local(p.grad) for p in self._params]
        stepped = [i for i, g in enumerate(grads) if g is not None]
        if not stepped:
            return loss
        # as torch's fused AdamW: the step counts go up first, then the kernel reads them
        torch._foreach_add_([self.state[self._params[i]]["step"] for i in stepped], 1)
        todo = [i for i, b in enumerate(self._buckets) if any(grads[s.param_index] is not None for s in b.segments)]
        largest = max(self._buckets[i].numel for i in todo)
        buffers = [torch.empty(largest * len(self.kinds), dtype=torch.float32) for _ in range(min(2, len(todo)))]
        scratch = torch.empty(largest if self.has_master else 0, dtype=torch.float32)
        self._account(sum(b.numel() for b in buffers) * FLOAT_BYTES, scratch.numel() * FLOAT_BYTES)
        try:
            with ThreadPoolExecutor(1, "adamw-read") as reader, ThreadPoolExecutor(1, "adamw-write") as writer:
                writes: list[Future[None] | None] = [None, None]
                loading = reader.submit(self._load, todo[0], buffers[0], None)
                for k, index in enumerate(todo):
                    loading.result()
                    if k + 1 < len(todo):
                        nxt = (k + 1) % 2
                        loading = reader.submit(self._load, todo[k + 1], buffers[nxt], writes[nxt])
                    buffer = buffers[k % 2]
                    self._step_bucket(self._buckets[index], buffer, grads, scratch)
                    self._fresh[index] = False
                    writes[k % 2] = writer.submit(self._write, self._buckets[index], buffer)
                for write in writes:
                    if write is not None:
                        write.result()
        finally:
            self._account(-sum(b.numel() for b in buffers) * FLOAT_BYTES, -scratch.numel() * FLOAT_BYTES)
        return loss

    def _account(self, state_bytes: int, scratch_bytes: int) -> None:
        self._resident_bytes += state_bytes
        self.peak_state_bytes = max(self.peak_state_bytes, self._resident_bytes)
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, scratch_bytes)
        assert self._resident_bytes <= 2 * self.bucket_bytes, "more than two buckets of state in memory"

    def _step_bucket(self, bucket: _Bucket, buffer: torch.Tensor, grads: list[torch.Tensor | None],
                     scratch: torch.Tensor) -> None:
        n = bucket.numel
        group = self.param_groups[bucket.group_index]
        weights, grads_, exp_avgs, exp_avg_sqs, steps, params = [], [], [], [], [], []
        for seg in bucket.segments:
            grad = grads[seg.param_index]
            if grad is None:
                continue
            a, b = seg.offset, seg.offset + seg.stop - seg.start
            param = _local(self._params[seg.param_index].detach()).view(-1)[seg.start:seg.stop]
            grad_flat = grad.reshape(-1)[seg.start:seg.stop]
            exp_avgs.append(buffer[a:b])
            exp_avg_sqs.append(buffer[n + a:n + b])
            steps.append(self.state[self._params[seg.param_index]]["step"])
            if self.has_master:
                weights.append(buffer[2 * n + a:2 * n + b])
                params.append(param)
                if grad_flat.dtype != torch.float32:
                    grad_flat = scratch[a:b].copy_(grad_flat)
            else:
                weights.append(param)
            grads_.append(grad_flat)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(weights, grads_, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=float(group["lr"]),
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False, grad_scale=None, found_inf=None)
        for param, master in zip(params, weights):
            param.copy_(master)  # round to nearest even: the parameter is the master rounded

    # --- checkpoints ---

    def _mapped(self) -> torch.Tensor:
        """The whole state file as one float32 tensor, mapped (shared: writes go to the file)."""
        if self.total_numel == 0:
            return torch.empty(0, dtype=torch.float32)
        import mmap

        mapping = mmap.mmap(self._fd, self.state_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(mapping, dtype=torch.float32)  # keeps the mapping alive as long as it lives

    def _view(self, flat: torch.Tensor, kind: int, index: int) -> torch.Tensor:
        """Parameter `index`'s state of kind `kind` in the mapped file, shaped like its local tensor."""
        start = kind * self.total_numel + self._offsets[index]
        return flat[start:start + self._numels[index]].view(_local(self._params[index].detach()).shape)

    @torch.no_grad()
    def _write_fresh(self) -> None:
        """Put the initial state of every never-written bucket in the file (its master: the parameter)."""
        buffer = torch.empty(0, dtype=torch.float32)
        for index, bucket in enumerate(self._buckets):
            if self._fresh[index]:
                if buffer.numel() < bucket.numel * len(self.kinds):
                    buffer = torch.empty(bucket.numel * len(self.kinds), dtype=torch.float32)
                self._load(index, buffer, None)
                self._write(bucket, buffer)
                self._fresh[index] = False

    def state_dict(self) -> dict[str, Any]:
        """torch AdamW's layout (`state` by parameter index, `param_groups`), the moments and the
        master copy mapped onto the state file: reading them reads the file, no copy is made here."""
        self._check_open()
        self._write_fresh()
        flat = self._mapped()
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(self._params):
            entry: dict[str, Any] = {"step": self.state[param]["step"]}
            for kind, name in enumerate(self.kinds):
                entry[name] = _like(self._view(flat, kind, index), param)
            state[index] = entry
        groups, index = [], 0
        for group in self.param_groups:
            ids = list(range(index, index + len(group["params"])))
            index += len(ids)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the state of `state_dict` (this class's, or torch AdamW's: a missing master is
        taken from the parameter), matched to the parameters by order, as torch does."""
        self._check_open()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("the state dict's param groups do not match this optimizer's (their number or sizes)")
        for saved, group in zip(saved_groups, self.param_groups):
            if saved.get("amsgrad") or saved.get("maximize") or saved.get("decoupled_weight_decay") is False:
                raise ValueError("the state dict is of an AdamW with amsgrad, maximize or coupled weight decay, "
                                 "which StreamingAdamW does not run")
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = state_dict["state"]
        saved_ids = [i for saved in saved_groups for i in saved["params"]]
        flat = self._mapped()
        for index, (saved_id, param) in enumerate(zip(saved_ids, self._params)):
            entry = saved_state.get(saved_id, {})
            self.state[param]["step"].copy_(torch.as_tensor(_local(entry["step"]) if "step" in entry else 0.0))
            for kind, name in enumerate(self.kinds):
                target = self._view(flat, kind, index)
                source = entry.get(name)
                if source is None:  # a fresh state, or a master torch's AdamW never had
                    source = _local(param.detach()) if name == "master" else torch.zeros(())
                source = _local(source)
                if source.data_ptr() != target.data_ptr():  # dcp.load may have filled the mapping itself
                    target.copy_(source.expand_as(target) if source.dim() == 0 else source.view(target.shape))
        del flat  # unmapped once the caller's state dict lets go of its views too
        self._fresh = [False] * len(self._buckets)
        if self.drop_page_cache:
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # --- lifetime ---

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this StreamingAdamW is closed: its state file is gone")

    def close(self) -> None:
        """Delete the state file (the nameless file goes with its last descriptor and mapping)."""
        if not self._closed:
            self._closed = True
            self._file.close()
