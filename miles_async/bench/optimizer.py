"""`miles-async bench optimizer`: AdamW with its state streamed from disk, beside torch's in memory.

The step measured is the optimizer's alone (no forward or backward: the gradients are random
tensors set once), on every parameter of a model:
- `memory`: `torch.optim.AdamW(fused=True)`, what the trainer runs by default (its state in the
  parameters' dtype: bf16 moments for bf16 weights);
- `disk`: `trainer.offload.StreamingAdamW` (TrainerConfig.optimizer_offload = "disk"), its state
  (fp32 moments, and fp32 master weights for bf16 ones) in a file in `--dir`, streamed through two
  buckets of `--bucket-mib`, buffered I/O: the page cache keeps what memory allows;
- `disk_uncached`: the same with `drop_page_cache`, every bucket synced to the disk and evicted,
  so that every byte of state really crosses the disk each step.
The physical limit, measured in the same run and folder on a file the size of the streamed state,
in bucket-sized calls: the disk's write rate (first write, then rewrite, each fdatasync'd; the
timed steps rewrite) and its cold read rate (after evicting the file's pages). The streamed step
is given as a ratio to the I/O bound, `io_bound_s`: the larger of the bytes it read over the
read rate and the bytes it wrote over the write rate (the reader and the writer run at once; the
sum, `io_serial_s`, is beside it). The buffered side can beat the bound: its reads come from
the page cache when the state fits there, and its writes reach the disk after the step.

Each side runs in a fresh subprocess, so that its memory figures are its own: `rss_peak_bytes`
is VmHWM, reset once the parameters and gradients are built (`rss_before_bytes`), so their
difference is what the optimizer adds; `peak_state_bytes` is the state the optimizer holds in
memory at its peak (torch's: all of it; the streamed one: its bucket buffers). The streamed
state (`workload.streamed_state_bytes`) is also what an in-memory mixed-precision AdamW (fp32
master and moments) would hold: with bf16 weights, 3x torch's bf16 state. A side whose
estimated memory exceeds `--max-rss-gib` is not run, and the JSON says what it would need.

Workloads: `--model smollm2` (SmolLM2-135M-Instruct, `models/smollm2.py`), or `--model random
--params N`: a random-init llama-shaped model of about N parameters (hidden 2048, 16 heads, 8 KV
heads, MLP 5632, vocabulary 32000, tied embeddings; the layer count sets N), built with the
repository's ModelConfig, CausalLM and `random_init.init_weights`.

    miles-async bench optimizer --json
    miles-async bench optimizer --json --model random --params 1e9 --dtype bfloat16 --steps 2

Measured with the two commands above and `--threads 1` on this repository's 2-core CPU VM, shared
with other work (two torch threads there made even the in-memory step 10x slower and noisy),
state in /tmp on its virtual disk (first write ~350 MB/s, rewrite 2.2-2.6 GB/s, cold read
1.5-2.8 GB/s), 64 MiB buckets; step time, then the peak memory added above weights and gradients:

    workload                 memory (torch)     disk (buffered)          disk_uncached
    SmolLM2-135M fp32        0.072 s, 0.94 GB   0.35 s (4.9x), 0.135 GB  1.09 s (15x; 2.6x the I/O bound)
    random 1.01B bf16        0.67 s, 3.96 GB    4.70 s (7.1x), 0.136 GB  10.1 s (15x; 1.25x the I/O bound)

The streamed state's peak is 2.0 buckets in every run. The disk figures vary from run to run on
this VM (SmolLM2's uncached step took 0.92 s in another run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIDES = ("memory", "disk", "disk_uncached")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HIDDEN, INTERMEDIATE, VOCAB = 2048, 5632, 32000  # the random model's shape (TinyLlama-like)


def _progress(line: str) -> None:
    print(f"[bench optimizer] {line}", file=sys.stderr, flush=True)


def random_config(num_params: float) -> Any:
    """A llama-shaped ModelConfig of about `num_params` parameters (at least one layer)."""
    from miles_async.models import ModelConfig

    per_layer = HIDDEN * (2 * HIDDEN + 2 * 1024) + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    layers = max(1, round((num_params - VOCAB * HIDDEN) / per_layer))
    return ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True)


def build_params(model: str, num_params: float, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The workload's parameters, in `dtype`, with a random gradient each."""
    from miles_async.models import CausalLM, load_pretrained, smollm2_checkpoint
    from miles_async.models.random_init import init_weights

    if model == "smollm2":
        net = load_pretrained(smollm2_checkpoint(), dtype=dtype)
    else:
        with torch.device("meta"):
            net = CausalLM(random_config(num_params))
        net = net.to(dtype).to_empty(device="cpu")  # straight to `dtype`: no fp32 copy of the whole model
        net.lm_head.weight = net.model.embed_tokens.weight  # to_empty made two tensors of the tied one
        init_weights(net, seed=0)
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=dtype) * 1e-3).to(dtype)
    return params


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_side(side: str, model: str, num_params: float, dtype: torch.dtype, steps: int, bucket_mib: float,
             folder: str) -> dict[str, Any]:
    """One side, in this process: build, warm up one step, time `steps` steps."""
    from miles_async.trainer.offload import StreamingAdamW

    params = build_params(model, num_params, dtype)
    rss_before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    optimizer: torch.optim.Optimizer
    if side == "memory":
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    else:
        optimizer = StreamingAdamW(params, lr=1e-6, folder=folder, bucket_mib=bucket_mib,
                                   drop_page_cache=side == "disk_uncached")
    optimizer.step()  # warm-up: the state is created (the streamed one writes it)
    read0 = getattr(optimizer, "bytes_read", 0)
    written0 = getattr(optimizer, "bytes_written", 0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {"step_s": round(statistics.median(times), 3), "step_s_all": [round(t, 3) for t in times],
                           "rss_before_bytes": rss_before, "rss_peak_bytes": _status_bytes("VmHWM")}
    if isinstance(optimizer, StreamingAdamW):
        row.update(peak_state_bytes=optimizer.peak_state_bytes, peak_scratch_bytes=optimizer.peak_scratch_bytes,
                   bucket_bytes=optimizer.bucket_bytes, num_buckets=optimizer.num_buckets,
                   state_bytes=optimizer.state_bytes,
                   bytes_read_per_step=(optimizer.bytes_read - read0) // steps,
                   bytes_written_per_step=(optimizer.bytes_written - written0) // steps)
        optimizer.close()
    else:
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
        row.update(peak_state_bytes=state_bytes, state_bytes=state_bytes)
    row["rss_added_bytes"] = row["rss_peak_bytes"] - rss_before
    return row


def disk_rates(folder: str, num_bytes: int, chunk_bytes: int) -> dict[str, Any]:
    """The disk's rates on a file of `num_bytes` in `folder`, in `chunk_bytes` calls: writing it
    (fresh blocks, as the streamed optimizer's first step), rewriting it (as every later step; on
    this VM's virtual disk 7x faster), each then fdatasync'd, and reading it cold (its pages evicted)."""
    chunk = bytearray(os.urandom(1 << 20)) * max(1, chunk_bytes >> 20)
    view = memoryview(chunk)

    def timed(io: Any) -> float:
        t0 = time.perf_counter()
        done = 0
        while done < num_bytes:
            got = io(view[:min(len(view), num_bytes - done)], done)
            if got <= 0:
                raise OSError("the rate test's file ended early")
            done += got
        if io is not read:
            os.fdatasync(fd)
        seconds = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return seconds

    with tempfile.TemporaryFile(dir=folder) as file:
        fd = file.fileno()
        os.posix_fallocate(fd, 0, num_bytes)  # as StreamingAdamW reserves its file

        def write(data: memoryview, offset: int) -> int:
            return os.pwrite(fd, data, offset)

        def read(data: memoryview, offset: int) -> int:
            return os.preadv(fd, [data], offset)

        first_write_s, write_s, read_s = timed(write), timed(write), timed(read)
    return {"file_bytes": num_bytes, "chunk_bytes": len(view),
            "first_write_bytes_per_s": round(num_bytes / first_write_s),
            "write_bytes_per_s": round(num_bytes / write_s), "read_bytes_per_s": round(num_bytes / read_s)}


def _estimate_rss(side: str, numel: int, dtype: torch.dtype, bucket_bytes: int) -> int:
    """Bytes a side needs: weights and gradients, plus the state it keeps in memory."""
    element = torch.tensor([], dtype=dtype).element_size()
    base = 2 * numel * element
    return base + (2 * numel * element if side == "memory" else 2 * bucket_bytes + bucket_bytes // 2)


def _count_params(model: str, num_params: float) -> int:
    from miles_async.models import CausalLM, ModelConfig, smollm2_checkpoint

    config = ModelConfig.from_hf(smollm2_checkpoint()) if model == "smollm2" else random_config(num_params)
    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(config).parameters())


def measure(model: str, num_params: float, dtype_name: str, steps: int, bucket_mib: float, folder: str,
            sides: tuple[str, ...], threads: int, max_rss_gib: float) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    numel = _count_params(model, num_params)
    kinds = 2 if dtype == torch.float32 else 3
    state_bytes = numel * 4 * kinds
    bucket_bytes = int(bucket_mib * 2**20)
    _progress(f"{model}: {numel / 1e6:.0f}M parameters in {dtype_name}; streamed state {state_bytes / 2**30:.2f} GiB")
    rates = disk_rates(folder, state_bytes, bucket_bytes)
    _progress(f"disk in {folder}: first write {rates['first_write_bytes_per_s'] / 1e6:.0f} MB/s, rewrite "
              f"{rates['write_bytes_per_s'] / 1e6:.0f} MB/s, cold read {rates['read_bytes_per_s'] / 1e6:.0f} MB/s")
    rows: dict[str, Any] = {}
    for side in sides:
        need = _estimate_rss(side, numel, dtype, bucket_bytes)
        if need > max_rss_gib * 2**30:
            rows[side] = {"skipped": f"needs about {need / 2**30:.1f} GiB, over --max-rss-gib {max_rss_gib}"}
            _progress(f"{side}: skipped ({rows[side]['skipped']})")
            continue
        argv = [sys.executable, "-m", "miles_async.bench.optimizer", "--worker", side, "--model", model,
                "--params", str(num_params), "--dtype", dtype_name, "--steps", str(steps),
                "--bucket-mib", str(bucket_mib), "--dir", folder, "--threads", str(threads)]
        out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
        rows[side] = json.loads(out.strip().splitlines()[-1])
        _progress(f"{side}: {rows[side]['step_s']:.2f} s a step, RSS peak {rows[side]['rss_peak_bytes'] / 2**30:.2f} "
                  f"GiB, state in memory {rows[side]['peak_state_bytes'] / 2**20:.0f} MiB")
    memory = rows.get("memory", {})
    for side in sides:
        row = rows[side]
        if side == "memory" or "skipped" in row:
            continue
        read_s = row["bytes_read_per_step"] / rates["read_bytes_per_s"]
        write_s = row["bytes_written_per_step"] / rates["write_bytes_per_s"]
        row["io_bound_s"] = round(max(read_s, write_s), 3)  # reading and writing at once, each at its rate
        row["io_serial_s"] = round(read_s + write_s, 3)  # one after the other
        row["ratio_step_over_io_bound"] = round(row["step_s"] / max(read_s, write_s), 2)
        row["ratio_peak_state_over_bucket"] = round(row["peak_state_bytes"] / row["bucket_bytes"], 2)
        if "step_s" in memory:
            row["ratio_step_over_memory"] = round(row["step_s"] / memory["step_s"], 2)
            row["ratio_rss_added_over_memory"] = round(row["rss_added_bytes"] / memory["rss_added_bytes"], 3)
    return {
        "bench": "optimizer",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "workload": {"model": model, "num_params": numel, "dtype": dtype_name, "steps": steps, "threads": threads,
                     "bucket_mib": bucket_mib, "folder": folder, "streamed_state_bytes": state_bytes},
        "disk": rates,
        "sides": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON on one line")
    parser.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    parser.add_argument("--params", type=float, default=1e9, help="random: about this many parameters")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the weights' (and gradients') dtype")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    parser.add_argument("--bucket-mib", type=float, default=64.0, help="the streamed state's bucket")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the state file and the rate test go")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES}")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-rss-gib", type=float, default=18.0, help="skip a side estimated to need more")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a subprocess
    args = parser.parse_args(argv)
    sides = tuple(s for s in args.sides.split(",") if s)
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides takes {', '.join(SIDES)}, got {args.sides!r}")
    if min(args.steps, args.threads) < 1 or not args.bucket_mib > 0 or not args.params >= 1:
        parser.error("--steps, --threads, --bucket-mib and --params must be positive")
    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        from miles_async.models import smollm2

        if (reason := smollm2.unavailable()) is not None:
            raise SystemExit(f"bench optimizer --model smollm2 needs SmolLM2-135M-Instruct, which is not available: "
                             f"{reason}")
    if args.worker:
        print(json.dumps(run_side(args.worker, args.model, args.params, DTYPES[args.dtype], args.steps,
                                  args.bucket_mib, args.dir)))
        return 0
    result = measure(args.model, args.params, args.dtype, args.steps, args.bucket_mib, args.dir, sides,
                     args.threads, args.max_rss_gib)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
