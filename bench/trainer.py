"""`miles-async bench trainer`: a training step on SmolLM2-135M, ours beside a plain transformers step.

The step, on one process and `--threads` torch threads: forward and backward over `--batch`
sequences of `--seq-len` random tokens, then an AdamW update of every weight. Ours is the
trainer's own path (`miles_async.models` with the trainer's chunked log-prob kernel over one
packed row, `trainer.loss.attach_logprobs`, loss = mean negative log-prob); the peer is
transformers' `AutoModelForCausalLM` on the same folder with `labels` and `torch.optim.AdamW`.
Precisions, each on both sides:
- "float32": weights, activations and optimizer state in fp32;
- "bf16_autocast": fp32 master weights and optimizer state, matmuls under
  `torch.autocast("cpu", torch.bfloat16)` (the usual mixed precision): ours through the trainer's
  `compute_dtype = "bfloat16"`, whose vocabulary log-probs stay fp32; the peer's whole forward.
Each figure is tokens/s (median of `--steps` steps after one warm-up) and the fraction of the
matmul peak it reaches: 6 x multiplied weights x tokens + 3 x attention FLOPs, over the step
time and the `torch.mm` rate measured in the same run for that dtype (bench/limits.py). On a
CPU with no bf16 instructions (AVX2 only) bf16 is emulated: the matmul rates in the JSON say so.

    miles-async bench trainer --json
    miles-async bench trainer --threads 1 --steps 3 --precisions float32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from miles_async.bench import limits
from miles_async.trainer.loss import mixed_precision

PRECISIONS = ("float32", "bf16_autocast")


def _progress(line: str) -> None:
    print(f"[bench trainer] {line}", file=sys.stderr, flush=True)


def _compute_dtype(precision: str) -> str:
    """The trainer's `compute_dtype` for a precision of this bench."""
    return "bfloat16" if precision == "bf16_autocast" else "float32"


def _timed_steps(step: Callable[[], None], steps: int) -> float:
    step()  # warm-up: allocations, OpenMP team, optimizer state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_step(model_dir: str, ids_BT: torch.Tensor, precision: str) -> Callable[[], None]:
    from miles_async.models import load_pretrained
    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.loss import attach_logprobs

    model = load_pretrained(model_dir).train()
    # the trainer's own mixed precision (TrainerConfig.compute_dtype): the backbone under autocast,
    # the vocabulary log-probs in fp32
    attach_logprobs(model, TrainerConfig(compute_dtype=_compute_dtype(precision)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch, seq = ids_BT.shape
    input_1T = ids_BT.reshape(1, -1)
    positions_1T = torch.arange(seq).repeat(batch)[None]  # packed: positions restart per sequence
    targets_T = torch.roll(input_1T[0], -1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logp_T, _ = model.token_logprobs(input_1T, positions_1T, targets_T, None)  # type: ignore[operator]
        (-logp_T.float().mean()).backward()
        optimizer.step()

    return step


def transformers_step(model_dir: str, ids_BT: torch.Tensor, precision: str) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with mixed_precision(torch.device("cpu"), _compute_dtype(precision)):
            loss = model(input_ids=ids_BT, labels=ids_BT).loss
        loss.float().backward()
        optimizer.step()

    return step


def measure(batch: int, seq_len: int, steps: int, threads: int, precisions: tuple[str, ...]) -> dict[str, Any]:
    from miles_async.models import ModelConfig
    from miles_async.models.smollm2 import smollm2_checkpoint

    torch.set_num_threads(threads)
    model_dir = str(smollm2_checkpoint())
    cfg = ModelConfig.from_hf(model_dir)
    tokens = batch * seq_len
    ids_BT = torch.randint(3, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    # causal attention: each token attends to (seq_len + 1) / 2 keys on average
    flops = 6 * limits.matmul_params(cfg) * tokens + 3 * limits.attention_flops(cfg, tokens, (seq_len + 1) // 2)
    rates = {"float32": limits.matmul_rate(torch.float32), "bf16_autocast": limits.matmul_rate(torch.bfloat16)}
    _progress(f"matmul rate: fp32 {rates['float32'] / 1e9:.0f} GFLOP/s, bf16 {rates['bf16_autocast'] / 1e9:.0f} GFLOP/s "
              f"({threads} thread(s), {torch.backends.cpu.get_cpu_capability()})")
    rows: dict[str, Any] = {}
    for precision in precisions:
        for side, make in (("ours", ours_step), ("transformers", transformers_step)):
            step_s = _timed_steps(make(model_dir, ids_BT, precision), steps)
            rows.setdefault(precision, {})[side] = {
                "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
                "fraction_of_matmul_peak": round(flops / step_s / rates[precision], 3)}
            _progress(f"{precision}, {side}: {tokens / step_s:,.0f} tokens/s ({step_s:.2f} s a step)")
        rows[precision]["ratio_ours_over_transformers"] = round(
            rows[precision]["transformers"]["step_s"] / rows[precision]["ours"]["step_s"], 2)
    return {
        "bench": "trainer",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "model": {"name": "SmolLM2-135M-Instruct", "folder": model_dir, "matmul_params": limits.matmul_params(cfg)},
        "workload": {"batch": batch, "seq_len": seq_len, "tokens_per_step": tokens, "steps": steps,
                     "threads": threads, "optimizer": "torch.optim.AdamW", "flops_per_step": flops},
        "matmul_flops_per_s": {p: round(r) for p, r in rates.items()},
        "precisions": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON on one line")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (after one warm-up)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {PRECISIONS}")
    args = parser.parse_args(argv)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if not precisions or any(p not in PRECISIONS for p in precisions):
        parser.error(f"--precisions takes {', '.join(PRECISIONS)}, got {args.precisions!r}")
    if min(args.batch, args.seq_len, args.steps, args.threads) < 1:
        parser.error("--batch, --seq-len, --steps and --threads must be >= 1")
    from miles_async.models import smollm2

    if (reason := smollm2.unavailable()) is not None:
        raise SystemExit(f"bench trainer measures SmolLM2-135M-Instruct, which is not available: {reason}")
    result = measure(args.batch, args.seq_len, args.steps, args.threads, precisions)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
