"""The machine's own limits, measured in the run that quotes them: memory bandwidth and matmul rate.

A decode step must at least read every weight once (the weight-streaming bound) and do its
matmuls (the compute bound); a training step must do its matmuls. The benchmarks put their
measured step times beside these two figures, both measured here and now on the same threads:

- `copy_bandwidth`: `dst.copy_(src)` over a buffer far larger than the caches, best of several.
  It reports the bytes copied per second and the memory traffic (each byte is read and written:
  twice that). The weight-streaming bound divides the bytes a step reads by the traffic rate, the
  faster of the two readings, so that it stays a bound.
- `matmul_rate`: a square matmul in the dtype asked for (2 n^3 FLOPs), best of several, by
  `torch.mm` or by oneDNN on a prepacked weight, whichever is faster. On a CPU without bf16
  instructions (AVX2 only) bf16 is emulated and slower than fp32; the figure shows it.

Both take `device` ("cpu" by default; "cuda" measures the GPU's own memory and tensor cores, each
timing between `torch.cuda.synchronize` calls, by `torch.mm` alone: miles_async/bench/gpu.py).

`decode_step_bounds` combines them for a model config: bytes read per decode step (every weight
but the embedding rows not looked up) and FLOPs at a batch size and a context length, both counted
on the model's own modules (built on the meta device). Try it: `python -m miles_async.bench.limits`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from miles_async.models import ModelConfig


def _best_s(fn: Any, repeats: int, device: str = "cpu") -> float:
    # a GPU op returns once queued: wait for the device before reading the clock
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()  # warm: page faults, OpenMP team start (on a GPU: the kernel's first launch)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(mib: int = 512, repeats: int = 5, device: str = "cpu") -> dict[str, float]:
    """Bytes/s of `copy_` between two fp32 buffers of `mib` MiB each (copied, and read + written)."""
    numel = mib * 2**20 // 4
    src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
    seconds = _best_s(lambda: dst.copy_(src), repeats, device)
    nbytes = numel * 4
    return {"buffer_mib": mib, "copied_bytes_per_s": nbytes / seconds, "traffic_bytes_per_s": 2 * nbytes / seconds}


def matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an n x n x n matmul in `dtype`: the faster of `torch.mm` and a oneDNN linear on a
    prepacked weight (miles_async/kernels/onednn.py, what the engine runs; on AMD CPUs torch's fp32 `mm` goes
    to MKL's slower generic path, and the bound must stay a bound). On a GPU, `torch.mm` (cuBLAS)."""
    if torch.device(device).type != "cpu":
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        return 2 * n**3 / _best_s(lambda: torch.mm(a, b, out=out), repeats, device)
    from miles_async.kernels import onednn
    from miles_async.kernels.precision import native_bf16

    if dtype == torch.bfloat16 and not native_bf16(torch.device("cpu")):
        # No native bf16 (AVX512-BF16, AMX): `mm` emulates every product (tens of seconds a 2048
        # cube), while bf16 autocast work can run on the fp32 units after conversion: the bound is
        # the faster of the two, the emulated one measured on a 512 cube (the same per-FLOP rate).
        return max(matmul_rate(torch.float32, n, repeats), _emulated_rate(dtype, min(n, 512), repeats))
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _best_s(lambda: torch.mm(a, b, out=out), repeats)
    if onednn.supported(dtype, a.device):
        packed = onednn.prepack(b.t().contiguous())
        seconds = min(seconds, _best_s(lambda: onednn.linear(a, packed, None), repeats))
    return 2 * n**3 / seconds


def _emulated_rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b, out=out), repeats)


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    from miles_async.models import CausalLM

    with torch.device("meta"):  # shapes only: nothing allocated
        return CausalLM(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights multiplied per token, counted on the model's own modules: every linear layer, the
    vocabulary projection included (tied or not); in a mixture of experts, a token's experts only
    (top k of each sparse layer's)."""
    total = 0
    for name, module in _meta_model(cfg).named_modules():
        if isinstance(module, torch.nn.Linear):
            numel = module.weight.numel()
            expert = ".experts." in name
            total += numel * cfg.num_experts_per_tok // cfg.num_experts if expert else numel
    return total


def weight_bytes_read(cfg: ModelConfig, bytes_per_param: int) -> int:
    """Bytes of weights a decode step reads: every parameter (all experts of a mixture: a batch
    reaches most of them), except the embedding table, of which a step reads a few rows, unless
    it is tied to the vocabulary projection, which reads it whole."""
    model = _meta_model(cfg)
    embedding = 0 if cfg.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    return bytes_per_param * (sum(p.numel() for p in model.parameters()) - embedding)


def attention_flops(cfg: ModelConfig, tokens: int, context: int) -> int:
    """Scores and weighted sum for `tokens` query tokens over `context` keys each."""
    return 4 * cfg.num_hidden_layers * tokens * context * cfg.num_attention_heads * cfg.head_dim


def decode_step_bounds(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
                       bandwidth: dict[str, float], flops_per_s: float) -> dict[str, float]:
    """Lower bounds on one decode step of `batch` requests at `context` tokens each, in seconds."""
    nbytes = weight_bytes_read(cfg, torch.finfo(dtype).bits // 8)
    flops = 2 * matmul_params(cfg) * batch + attention_flops(cfg, batch, context)
    return {"weight_bytes": nbytes, "flops": flops,
            "weight_streaming_bound_s": nbytes / bandwidth["traffic_bytes_per_s"],
            "compute_bound_s": flops / flops_per_s}


def measure(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> dict[str, Any]:
    return {"torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "copy": copy_bandwidth(),
            "matmul_flops_per_s": {str(d).removeprefix("torch."): matmul_rate(d) for d in dtypes}}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
