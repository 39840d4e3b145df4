"""`miles-async bench weights`: time per weight update and GB/s of each transport, beside its floor.

The model: fp32 tensors shaped like a transformer (embedding, per-layer attention and MLP
projections, norms), `--mib` MiB in all (256 by default, the issue's minimum). In one run:

* `copy_`: a plain in-memory copy of the same bytes into preallocated tensors (the physical
  limit of a same-node write);
* colocated: `transport.colocated.handoff` of the same tensors to an engine in this process,
  whose weights (a double-buffered `WeightStore`, as an engine's) take each
  tensor as it is where dtype, shape and device match (a pointer swap, no bytes move; all of
  them here, fp32 into fp32) and copy it with a cast otherwise; its GB/s is the model's bytes
  over that time, beside `copy_`'s;
* shm: `SharedWeights.write` through a handle attached by segment name (the pusher's side);
* broadcast: `send_buckets` / `recv_buckets` between two spawned gloo ranks, beside one raw
  gloo `dist.broadcast` of a flat uint8 tensor of the same byte count (miles_async/bench/weights_peers.py):
  rounds interleave the two in the same pair, timed on the receiver, after a warm-up round;
  medians;
* disk-delta: one real `torch.optim.AdamW` step (lr 1e-6, a random N(0, 1e-3) gradient; Adam's
  first step moves every element by about lr * sign(g)) on a copy of the fp32 master, then
  `write_delta` from the bf16 engine copy of the old master and `apply_delta` to it: the payload
  as a fraction of the bf16 weights, the fraction of bf16 elements that changed, and whether the
  applied copy equals the new master cast to bf16 bit for bit (timed once: write and apply).

With `--formats` (e.g. `fp8_block,mxfp8,nvfp4,int4`), each format's update as a pusher makes it
for engines serving that format (`actors.weights.engine_weights`: the projections quantized from
the fp32 master, the rest bf16), before and after the same AdamW step: the full push's bytes and
the disk delta's payload, each as a fraction of the bf16 weights (the bf16 delta's reference),
the fraction of the format's bytes that changed, and whether the applied delta gives the new
quantized tensors bit for bit.

The other figures are the median of `--reps` timed updates after one warm-up (`reps_s` lists
them). Targets (the issue's), in `meets_targets`: shm >= 50% of copy_'s GB/s, broadcast >= 60%
of the raw gloo broadcast's, disk-delta payload <= 2%, each also bit-exact;
`meets_targets["all"]` is all three. Prints
one JSON object on stdout; progress goes to stderr.

    miles-async bench weights --json
    miles-async bench weights --json --mib 16 --reps 1
    miles-async bench weights --json --formats fp8_block,mxfp8,nvfp4,int4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from miles_async.bench._stats import median
from miles_async.bench.weights_peers import gloo_pair, model_weights
from miles_async.engine.weights import WeightStore
from miles_async.kernels.quant import FORMATS
from miles_async.transport import colocated
from miles_async.transport.disk_delta import apply_delta, write_delta
from miles_async.transport.shm import SharedWeights
from miles_async.transport.verify import checksums

TARGETS = {"shm_over_copy_min": 0.5, "broadcast_over_raw_min": 0.6, "delta_payload_fraction_max": 0.02}
LR = 1e-6
GRAD_STD = 1e-3  # any scale well above Adam's eps (1e-8) gives the same first step, lr * sign(g)


def transformer_shapes(mib: int) -> dict[str, tuple[int, ...]]:
    """Embedding + layers of a Llama-like block until the fp32 total reaches `mib` MiB."""
    if mib <= 0:
        raise ValueError(f"--mib must be > 0, got {mib}")
    hidden = 1024 if mib >= 128 else 256
    ffn, vocab = hidden * 11 // 4, hidden * 8
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    target_elems = mib * (1 << 20) // 4
    layer = 0
    while sum(torch.Size(s).numel() for s in shapes.values()) < target_elems:
        p = f"layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (hidden // 4, hidden),
                       p + "self_attn.v_proj.weight": (hidden // 4, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden), p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
        layer += 1
    shapes["norm.weight"] = (hidden,)
    return shapes


def _progress(line: str) -> None:
    print(f"[bench weights] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm-up: first touch of every page
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _figure(times_s: list[float], nbytes: int) -> dict:
    t = median(times_s)
    return {"s_per_update": round(t, 6), "gb_per_s": round(nbytes / t / 1e9, 3), "reps_s": [round(x, 6) for x in times_s]}


def _module_of(weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose parameters have `weights`' dotted names (e.g. layers.0.mlp.up_proj.weight),
    shapes and dtypes (empty values): the engine's model, as far as a weight update sees it."""
    root = torch.nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty_like(tensor), requires_grad=False))
    return root


class _ColocatedEngine:
    """The engine's side of the colocated handoff as `WeightStore.adopt_weights` does it (begin,
    adopt, commit), without a model to serve, so the bench times only the handoff."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = WeightStore(model, double_buffer=True)  # adoption without a copy needs the double buffer

    async def adopt_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int,
                            expected_checksums: Mapping[str, str] | None = None) -> int:
        self.weights.begin(version)
        try:
            taken = self.weights.adopt(named_tensors)
            self.weights.commit(expected_checksums)
        except BaseException as e:
            self.weights.abort(f"{type(e).__name__}: {e}")
            raise
        return taken


def _colocated(weights: dict[str, torch.Tensor], reps: int) -> tuple[list[float], int, bool]:
    """Time `colocated.handoff` of `weights` (warm-up, then `reps`); return the times, the tensors
    taken without a copy, and whether the engine's parameters then equal `weights` bit for bit."""
    model = _module_of(weights)
    name = f"bench-weights-{os.getpid()}"
    colocated.register(name, _ColocatedEngine(model))

    async def run() -> tuple[list[float], int]:
        taken = await colocated.handoff(name, weights, version=1)  # warm-up
        times = []
        for version in range(2, reps + 2):
            t0 = time.perf_counter()
            taken = await colocated.handoff(name, weights, version=version)
            times.append(time.perf_counter() - t0)
        return times, taken

    try:
        times, taken = asyncio.run(run())
    finally:
        colocated.unregister(name)
    params = dict(model.named_parameters())
    return times, taken, checksums({n: params[n] for n in weights}) == checksums(weights)


@torch.no_grad()
def _local(weights: dict[str, torch.Tensor], nbytes: int, reps: int) -> dict[str, dict]:
    """copy_, colocated and shm: the same-node transports, in this process."""
    dst = {name: torch.empty_like(t) for name, t in weights.items()}

    def plain_copy() -> None:
        for name, t in weights.items():
            dst[name].copy_(t)

    copy_s = _timed(plain_copy, reps)
    _progress(f"copy_: {median(copy_s):.4f} s per update")
    colocated_s, num_aliased, colocated_exact = _colocated(weights, reps)
    _progress(f"colocated: {median(colocated_s) * 1e3:.3f} ms per update, {num_aliased}/{len(weights)} tensors "
              f"aliased (bit-exact: {colocated_exact})")
    with SharedWeights.like(weights) as owner:
        writer = SharedWeights.attach(owner.name)
        shm_s = _timed(lambda: writer.write(weights), reps)
        shm_exact = checksums(owner.tensors) == checksums(weights)
        writer.close()
    _progress(f"shm write: {median(shm_s):.4f} s per update (bit-exact: {shm_exact})")
    return {"copy_": _figure(copy_s, nbytes),
            "colocated": {**_figure(colocated_s, nbytes), "num_aliased": num_aliased,
                          "num_copied": len(weights) - num_aliased, "bit_exact": colocated_exact,
                          "implementation": "transport.colocated.handoff -> WeightStore(double_buffer=True)"},
            "shm": {**_figure(shm_s, nbytes), "bit_exact": shm_exact}}


def adamw_step(master: dict[str, torch.Tensor], lr: float, seed: int) -> float:
    """One `torch.optim.AdamW` step (lr `lr`, torch's other defaults) on `master` in place, with a
    seeded N(0, GRAD_STD) gradient; returns the seconds the step took."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(t) for t in master.values()]  # share storage with master's tensors
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * GRAD_STD
    optimizer = torch.optim.AdamW(params, lr=lr)
    t0 = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - t0


@torch.no_grad()
def _disk_delta(weights: dict[str, torch.Tensor], folder: str) -> dict:
    engine = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    master = {name: t.clone() for name, t in weights.items()}
    step_s = adamw_step(master, LR, seed=1)
    t0 = time.perf_counter()
    stats = write_delta(folder, engine, master, old_version=0, new_version=1)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    apply_delta(stats.folder, engine, engine_version=0)
    apply_s = time.perf_counter() - t0
    exact = checksums(engine) == checksums({n: t.to(torch.bfloat16) for n, t in master.items()})
    _progress(f"disk-delta: AdamW step {step_s:.2f} s, write {write_s:.2f} s, apply {apply_s:.2f} s, payload "
              f"{stats.payload_fraction:.4f} of the bf16 weights, {stats.changed_fraction:.4f} of elements "
              f"changed (exact: {exact})")
    return {"write_s": round(write_s, 3), "apply_s": round(apply_s, 3), "s_per_update": round(write_s + apply_s, 3),
            "gb_per_s": round(stats.full_bytes / (write_s + apply_s) / 1e9, 3), "payload_bytes": stats.payload_bytes,
            "full_bytes": stats.full_bytes, "payload_fraction": round(stats.payload_fraction, 5),
            "changed_fraction": round(stats.changed_fraction, 5), "bit_exact": exact,
            "step": f"torch.optim.AdamW(lr={LR:g}) first step, N(0, {GRAD_STD:g}) gradient, fp32 master",
            "engine_dtype": "bfloat16", "lr": LR, "step_s": round(step_s, 3)}


@torch.no_grad()
def _format_deltas(weights: dict[str, torch.Tensor], formats: list[str], folder: str) -> dict:
    """Per format: the quantized push and its disk delta across one AdamW step (module docstring)."""
    from miles_async.actors.weights import engine_weights

    bf16_bytes = sum(t.numel() * 2 for t in weights.values())
    master = {name: t.clone() for name, t in weights.items()}
    adamw_step(master, LR, seed=1)
    out = {}
    for fmt in formats:
        old = engine_weights(weights, torch.bfloat16, fmt)
        new = engine_weights(master, torch.bfloat16, fmt)
        push_bytes = sum(t.numel() * t.element_size() for t in new.values())
        t0 = time.perf_counter()
        stats = write_delta(os.path.join(folder, fmt), old, new, old_version=0, new_version=1)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        apply_delta(stats.folder, old, engine_version=0)
        apply_s = time.perf_counter() - t0
        changed = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                      for a, b in zip(engine_weights(weights, torch.bfloat16, fmt).values(), new.values()))
        exact = checksums(old) == checksums(new)
        out[fmt] = {"push_bytes": push_bytes, "push_fraction": round(push_bytes / bf16_bytes, 5),
                    "delta_payload_bytes": stats.payload_bytes,
                    "delta_payload_fraction": round(stats.payload_bytes / bf16_bytes, 5),
                    "changed_byte_fraction": round(changed / push_bytes, 5), "write_s": round(write_s, 3),
                    "apply_s": round(apply_s, 3), "bit_exact": exact}
        _progress(f"{fmt}: push {push_bytes / bf16_bytes:.4f} of the bf16 weights, delta "
                  f"{stats.payload_bytes / bf16_bytes:.5f}, {changed / push_bytes:.4f} of its bytes changed "
                  f"(exact: {exact})")
    return out


def measure(mib: int, bucket_mib: int, reps: int, formats: list[str] | None = None) -> dict:
    shapes = transformer_shapes(mib)
    weights = model_weights(shapes, seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    result: dict[str, Any] = {
        "bench": "weights", "bytes": nbytes, "num_tensors": len(weights), "bucket_bytes": bucket_mib << 20,
        "reps": reps, "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                   "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}}
    _progress(f"{nbytes / 2**20:.0f} MiB of fp32 weights in {len(weights)} tensors, {reps} timed reps each")
    result.update(_local(weights, nbytes, reps))
    _progress("broadcast: two gloo ranks, ours and one raw broadcast of the same bytes, interleaved...")
    pair = gloo_pair(shapes, bucket_mib << 20, reps)
    result["broadcast"] = {**_figure(pair["ours_s"], nbytes), "num_buckets": pair["num_buckets"],
                           "bytes_sent": pair["bytes_sent"], "bit_exact": pair["bit_exact"]}
    result["raw_gloo_broadcast"] = {**_figure(pair["raw_s"], nbytes), "bytes_sent": pair["bytes"]}
    _progress(f"broadcast: {median(pair['ours_s']):.4f} s, raw {median(pair['raw_s']):.4f} s per update")
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as folder:
        result["disk_delta"] = _disk_delta(weights, folder)
        if formats:
            result["formats"] = _format_deltas(weights, formats, folder)
    result["ratios"] = _ratios(result)
    result["meets_targets"] = _meets_targets(result)
    return result


def _ratios(result: dict) -> dict:
    return {"shm_over_copy": round(result["shm"]["gb_per_s"] / result["copy_"]["gb_per_s"], 3),
            "colocated_over_copy": round(result["colocated"]["gb_per_s"] / result["copy_"]["gb_per_s"], 1),
            "broadcast_over_raw": round(result["broadcast"]["gb_per_s"] / result["raw_gloo_broadcast"]["gb_per_s"], 3),
            "delta_payload_fraction": result["disk_delta"]["payload_fraction"], "targets": TARGETS}


def _meets_targets(result: dict) -> dict[str, bool]:
    ratios = result["ratios"]
    meets = {"shm": ratios["shm_over_copy"] >= TARGETS["shm_over_copy_min"] and result["shm"]["bit_exact"],
             "broadcast": (ratios["broadcast_over_raw"] >= TARGETS["broadcast_over_raw_min"]
                           and result["broadcast"]["bit_exact"]),
             "disk_delta": (ratios["delta_payload_fraction"] <= TARGETS["delta_payload_fraction_max"]
                            and result["disk_delta"]["bit_exact"])}
    return {**meets, "all": all(meets.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    parser.add_argument("--mib", type=int, default=256, help="fp32 weight MiB (the issue asks for >= 256)")
    parser.add_argument("--bucket-mib", type=int, default=64, help="broadcast bucket size")
    parser.add_argument("--reps", type=int, default=9, help="timed updates per transport (after one warm-up)")
    parser.add_argument("--formats", default="", help="comma-separated quantized formats whose pushes and deltas "
                        "to measure too (fp8_block, mxfp8, nvfp4, int4)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.bucket_mib < 1:
        parser.error("--reps and --bucket-mib must be >= 1")
    formats = [f for f in args.formats.split(",") if f]
    if unknown := [f for f in formats if f not in FORMATS]:
        parser.error(f"--formats: unknown {', '.join(unknown)}; give any of {', '.join(FORMATS)}")
    result = measure(args.mib, args.bucket_mib, args.reps, formats)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
