"""Fused CPU kernels for the embedded engine's decode steps (cpu_kernels.cpp), built on first use.

A decode step at a small batch spends more time dispatching small torch ops than computing:
SmolLM2-135M at batch 1 ran ~2,100 ops per step, 18 ms where its weights stream in 6.5 ms. These
kernels each replace a chain of them, per layer: RMSNorm (8 ops), rotary embedding (6 ops per
tensor), and attention (`paged_attention`), which reads keys and values straight from the paged
cache through each request's block table instead of gathering them into a padded copy first (the
gather was 31% of the bench model's step time at 256 requests), one query row at a time, so a
prompt chunk is causal without a mask. Where the CPU has AVX-512 BF16 (the build is
-march=native) and the head dim is 64 or 128, attention runs an AVX-512 version: key rows dotted
with the query by vdpbf16ps (bf16) or FMAs (fp32), sixteen positions' partial sums reduced
together; 3x faster than the portable loops on warm caches (SmolLM2's heads, 64 requests x 80
positions, one thread: 170 against 510 us; 400 against 1,050 us with the caches flushed).
Measured here, one thread, bf16: RMSNorm over 4 x 576, 16 -> 3.7 us; rotary of 4 x 9 x 64,
12 -> 3.5 us; attention against the gathered path, engine/attention.py's docstring. And greedy
sampling: argmax and its log-prob in one pass over the logits, where the sampler made a float32
copy, a log_softmax and an argmax (11.5 ms of SmolLM2's 78 ms bf16 decode step at batch 64).
Two smaller ones: `silu_mul`, the MLP's silu(gate) * up read in place from the gate/up matmul's
output (an earlier version that took gate and up as separate tensors needed copies first and was
slower than torch's two ops), and the step's KV write, folded into the attention call in place
of two `index_copy_`s; together 2-6% of SmolLM2's bf16 decode step at batch 1 to 64 here.

Numerics: the elementwise kernels round every intermediate to the tensor's dtype where the eager
code does, so they match it up to the order of a sum (tests/unit/test_cpu_kernels.py states the
tolerances); attention keeps scores, softmax and the weighted sum in float32 (in bf16 the
products of q and k are exact, vdpbf16ps or not).

Build: the C++ file is compiled once per machine with the system's `c++` (g++ or clang, OpenMP),
into `$MILES_ASYNC_CACHE/kernels` (default ~/.cache/miles-async/kernels), named by a hash of the
source, the compiler flags and the CPU's flags (it is built with -march=native, so a copy from
another CPU model is never loaded). About 2 s; concurrent processes build under a lock and load
the same file. Where there is no compiler or the build fails, `library()` returns None, says why
once in the log, and the engine runs its torch ops instead (`supports()` is False); set
`MILES_ASYNC_CPU_KERNELS=0` to force that.

The library links OpenMP by its soname, which resolves to the runtime torch already loaded, so
the kernels run on the calling thread's OpenMP team with `torch.set_num_threads`'s count.

Try it: `python -m miles_async.kernels.cpu_kernels` builds the library and prints its path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -ffp-contract=off: no fused multiply-adds where the eager code rounds a product before a sum
# (the attention loops ask for theirs with std::fma); -fno-trapping-math lets float-to-int
# conversions (exp_approx) vectorise: nothing here reads floating-point exception flags.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ABI_VERSION = 3
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def cache_dir() -> Path:
    root = os.environ.get("MILES_ASYNC_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "miles-async") / "kernels"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine; the others wait, then load it
        if target.exists():
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staged = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(staged)], check=False, capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            staged.rename(target)


def _load() -> ctypes.CDLL:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + compiler.encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if not target.exists():
        _build(compiler, target)
    lib = ctypes.CDLL(str(target))  # releases the GIL during a call, as torch ops do
    if lib.miles_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{target} has ABI version {lib.miles_abi_version()}, expected {ABI_VERSION}")
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.miles_rms_norm.argtypes = [i32, ptr, ptr, ptr, i64, i64, f32]
    lib.miles_rotary.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.miles_paged_attention.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                                          i64, i64, i64, i64, i64, i64, f32, ptr, ptr, i64, i64, ptr, i64]
    lib.miles_silu_mul.argtypes = [i32, ptr, ptr, i64, i64]
    lib.miles_greedy.argtypes = [i32, ptr, i64, i64, ptr, ptr]
    for fn in (lib.miles_rms_norm, lib.miles_rotary, lib.miles_greedy, lib.miles_paged_attention, lib.miles_silu_mul):
        fn.restype = None
    return lib


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why not): tried once per process, the reason logged once."""
    if os.environ.get("MILES_ASYNC_CPU_KERNELS", "1") == "0":
        why = "MILES_ASYNC_CPU_KERNELS=0"
    else:
        try:
            return _load(), None
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why = f"{type(e).__name__}: {e}"
    log.warning("fused CPU kernels unavailable, the engine runs plain torch ops instead: %s", why)
    return None, why


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot be built or are turned off."""
    return _loaded()[0]


def unavailable_reason() -> str | None:
    return _loaded()[1]


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tensors of `dtype` on `device` can go through the kernels here."""
    return device.type == "cpu" and dtype in _DTYPES and library() is not None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` over the last dim (models/transformer.py's numerics)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    library().miles_rms_norm(_DTYPES[x.dtype], _ptr(x), _ptr(weight), _ptr(out), x.numel() // width, width, eps)  # type: ignore[union-attr]
    return out


def rotary(x_BTNH: torch.Tensor, cos_BTH: torch.Tensor, sin_BTH: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rotary` (cos and sin already in x's dtype)."""
    x_BTNH, cos_BTH, sin_BTH = x_BTNH.contiguous(), cos_BTH.contiguous(), sin_BTH.contiguous()
    out = torch.empty_like(x_BTNH)
    batch, tokens, heads, head_dim = x_BTNH.shape
    library().miles_rotary(_DTYPES[x_BTNH.dtype], _ptr(x_BTNH), _ptr(cos_BTH), _ptr(sin_BTH), _ptr(out),  # type: ignore[union-attr]
                           batch * tokens, heads, head_dim)
    return out


def greedy(logits_RV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_R, logprobs_R): each row's argmax (the first, as torch.argmax) and its float32
    log-prob under the row's log_softmax, read in one pass over the logits (no float32 copy)."""
    logits_RV = logits_RV.contiguous()
    rows, vocab = logits_RV.shape
    tokens_R = torch.empty(rows, dtype=torch.long, device=logits_RV.device)
    logprobs_R = torch.empty(rows, dtype=torch.float32, device=logits_RV.device)
    library().miles_greedy(_DTYPES[logits_RV.dtype], _ptr(logits_RV), rows, vocab, _ptr(tokens_R),  # type: ignore[union-attr]
                           _ptr(logprobs_R))
    return tokens_R, logprobs_R


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` where gate and up are the two halves of `gate_up`'s last dim (one
    matmul's output, as the MLP's prepacked gate/up projection gives it), read in place."""
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    library().miles_silu_mul(_DTYPES[gate_up.dtype], _ptr(gate_up), _ptr(out), out.numel() // width, width)  # type: ignore[union-attr]
    return out


def _heads_rows(x_TKH: torch.Tensor) -> int:
    """Elements between x's token rows, its heads contiguous ([T, K, H], a view of a wider row
    allowed); ValueError otherwise."""
    if x_TKH.stride(2) != 1 or x_TKH.stride(1) != x_TKH.shape[2]:
        raise ValueError(f"new keys/values need contiguous heads, got strides {x_TKH.stride()}")
    return x_TKH.stride(0)


def paged_attention(q_TNH: torch.Tensor, q_rows_G: torch.Tensor, k_blocks: torch.Tensor,
                    v_blocks: torch.Tensor, tables_GW: torch.Tensor, lengths_G: torch.Tensor,
                    out_TNH: torch.Tensor, out_rows_G: torch.Tensor, scale: float,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Each query g (row q_rows_G[g] of q_TNH) over the first lengths_G[g] cached positions of its
    sequence (blocks [K, num_blocks, block_size, H], block table row g of tables_GW), written to
    row out_rows_G[g] of out_TNH. A decoding request is one query; a prompt chunk one per token,
    each with its own length. Index tensors int64; q, the blocks and out of one dtype, contiguous.

    `new_kv=(k_TKH, v_TKH, slots_T)` first writes the step's new keys and values into the blocks
    (token t at flat position slots_T[t] of each head: what `index_copy_` along the blocks' flat
    positions does), in the same call."""
    num_kv_heads, num_blocks, block_size, head_dim = k_blocks.shape
    if not (out_TNH.is_contiguous() and k_blocks.is_contiguous() and v_blocks.is_contiguous()):
        raise ValueError("paged_attention writes out_TNH and reads the blocks in place: all contiguous")
    q_TNH, tables_GW = q_TNH.contiguous(), tables_GW.contiguous()
    k_new = v_new = slots_T = None
    k_stride = v_stride = num_new = 0
    if new_kv is not None:
        k_new, v_new, slots_T = new_kv
        if k_new.dtype != k_blocks.dtype or v_new.dtype != v_blocks.dtype:
            raise ValueError(f"new keys/values ({k_new.dtype}) must be in the blocks' dtype ({k_blocks.dtype})")
        k_stride, v_stride, num_new = _heads_rows(k_new), _heads_rows(v_new), slots_T.numel()
    library().miles_paged_attention(  # type: ignore[union-attr]
        _DTYPES[q_TNH.dtype], _ptr(q_TNH), _ptr(q_rows_G), _ptr(k_blocks), _ptr(v_blocks), _ptr(tables_GW),
        tables_GW.shape[1], _ptr(lengths_G), _ptr(out_TNH), _ptr(out_rows_G), q_rows_G.numel(), q_TNH.shape[1],
        num_kv_heads, head_dim, num_blocks, block_size, scale,
        k_new.data_ptr() if k_new is not None else None, v_new.data_ptr() if v_new is not None else None,
        k_stride, v_stride, slots_T.data_ptr() if slots_T is not None else None, num_new)


if __name__ == "__main__":
    print(library() and library()._name or unavailable_reason())  # type: ignore[union-attr]
