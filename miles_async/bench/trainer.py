"""`miles-async bench trainer`: a training step on SmolLM2-135M, ours beside a plain transformers step.

The step, on one process and `--threads` torch threads: forward and backward over `--batch`
sequences of `--seq-len` random tokens, then an AdamW update of every weight. Ours is the
trainer's own path (`miles_async.models` with the trainer's chunked log-prob kernel over one
packed row, `trainer.loss.attach_logprobs`, loss = mean negative log-prob); the peer is
transformers' `AutoModelForCausalLM` on the same folder with `labels`, and the same AdamW.
Precisions, each on both sides:
- "float32": weights, activations and optimizer state in fp32;
- "bf16_autocast": fp32 master weights and optimizer state, matmuls under
  `torch.autocast("cpu", torch.bfloat16)` (the usual mixed precision): ours through the trainer's
  `compute_dtype = "bfloat16"`, whose vocabulary log-probs stay fp32; the peer's whole forward.
Each figure is tokens/s (median of `--steps` steps after one warm-up) and the fraction of the
matmul peak it reaches: 6 x multiplied weights x tokens + 3 x attention FLOPs, over the step
time and the `torch.mm` rate measured in the same run for that dtype (miles_async/bench/limits.py). On a
CPU with no bf16 instructions (AVX2 only) bf16 is emulated: the matmul rates in the JSON say so.
Both sides update with the same optimizer: the trainer's own (`trainer.step.make_optimizer`:
`torch.optim.AdamW(fused=True)`, torch's fused kernel, which transformers' Trainer selects with
`optim="adamw_torch_fused"`), at lr 1e-6; the JSON's `optimizer` records, for each side, the
settings read back from the optimizer it stepped.

`--workload grpo` times instead a batch shaped like an RL step: `--groups` prompts of
`--prompt-len` random tokens, `--group-size` answers each of 8-32 random tokens, the loss on the
answers only. Ours runs the trainer's own micro-batch loss (`trainer.loss.micro_batch_loss`,
SFT objective) over the packed batch twice, with each group's prompt run once
(`share_prefixes`, the default) and without; the peer runs the batch padded to its longest
sample with an attention mask, as TRL's GRPOTrainer does. Tokens/s counts the samples' tokens
(a shared prompt counts once per sample); no fraction of peak is given, since the sides run
different amounts of arithmetic for the same batch.

    miles-async bench trainer --json
    miles-async bench trainer --threads 1 --steps 3 --precisions float32
    miles-async bench trainer --json --workload grpo --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from miles_async.bench import limits
from miles_async.trainer.loss import mixed_precision

PRECISIONS = ("float32", "bf16_autocast")


def _progress(line: str) -> None:
    print(f"[bench trainer] {line}", file=sys.stderr, flush=True)


def _compute_dtype(precision: str) -> str:
    """The trainer's `compute_dtype` for a precision of this bench."""
    return "bfloat16" if precision == "bf16_autocast" else "float32"


class Step(NamedTuple):
    """One side's training step and the optimizer it steps (its settings go in the JSON)."""

    run: Callable[[], None]
    optimizer: torch.optim.Optimizer


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Both sides' optimizer: the trainer's own (`trainer.step.make_optimizer`: fused AdamW, the
    trainer's betas, eps and weight decay) at lr 1e-6."""
    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.step import make_optimizer

    return make_optimizer(list(params), TrainerConfig(lr=1e-6))


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer was built with, read back from it: class, lr, betas, eps, weight decay, kernel."""
    defaults = optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "lr": defaults["lr"],
            "betas": list(defaults["betas"]), "eps": defaults["eps"], "weight_decay": defaults["weight_decay"],
            "kernel": kernel}


def _timed_steps(step: Step, steps: int) -> float:
    step.run()  # warm-up: allocations, OpenMP team, optimizer state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step.run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_step(model_dir: str, ids_BT: torch.Tensor, precision: str) -> Step:
    from miles_async.models import load_pretrained
    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.loss import attach_logprobs

    model = load_pretrained(model_dir).train()
    # the trainer's own mixed precision (TrainerConfig.compute_dtype): the backbone under autocast,
    # the vocabulary log-probs in fp32
    attach_logprobs(model, TrainerConfig(compute_dtype=_compute_dtype(precision)))
    optimizer = adamw(model.parameters())
    batch, seq = ids_BT.shape
    input_1T = ids_BT.reshape(1, -1)
    positions_1T = torch.arange(seq).repeat(batch)[None]  # packed: positions restart per sequence
    targets_T = torch.roll(input_1T[0], -1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logp_T, _ = model.token_logprobs(input_1T, positions_1T, targets_T, None)  # type: ignore[operator]
        (-logp_T.float().mean()).backward()
        optimizer.step()

    return Step(step, optimizer)


def transformers_step(model_dir: str, ids_BT: torch.Tensor, precision: str) -> Step:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).train()
    optimizer = adamw(model.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with mixed_precision(torch.device("cpu"), _compute_dtype(precision)):
            loss = model(input_ids=ids_BT, labels=ids_BT).loss
        loss.float().backward()
        optimizer.step()

    return Step(step, optimizer)


def _versions() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def grpo_batch(groups: int, group_size: int, prompt_len: int, vocab_size: int) -> list[Any]:
    """The `--workload grpo` batch: TokenData per sample, grouped consecutively, seeded."""
    from miles_async.trajectory import TokenData

    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(group_size):
            length = int(torch.randint(8, 33, (1,), generator=gen))
            answer = torch.randint(3, vocab_size, (length,), generator=gen).tolist()
            samples.append(TokenData.build(tokens=prompt + answer, loss_mask=[0] * prompt_len + [1] * length,
                                           logprobs=[0.0] * (prompt_len + length)))
    return samples


def ours_grpo_step(model_dir: str, samples: list[Any], group_size: int, precision: str,
                   share: bool) -> Step:
    from miles_async.models import load_pretrained
    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.loss import attach_logprobs, micro_batch_loss
    from miles_async.trainer.packing import pack

    model = load_pretrained(model_dir).train()
    config = TrainerConfig(model_dir=model_dir, objective="sft", compute_dtype=_compute_dtype(precision))
    attach_logprobs(model, config)
    optimizer = adamw(model.parameters())
    groups = [i // group_size for i in range(len(samples))] if share else None
    batch = pack(samples, [0.0] * len(samples), groups=groups)
    trained = float(batch.loss_mask_T.sum())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        micro_batch_loss(model, batch, config, trained, torch.device("cpu")).loss.backward()
        optimizer.step()

    return Step(step, optimizer)


def transformers_grpo_step(model_dir: str, samples: list[Any], precision: str) -> Step:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).train()
    optimizer = adamw(model.parameters())
    longest = max(s.num_tokens for s in samples)
    ids_BT = torch.zeros(len(samples), longest, dtype=torch.int64)
    attention_BT = torch.zeros(len(samples), longest, dtype=torch.int64)
    labels_BT = torch.full((len(samples), longest), -100, dtype=torch.int64)
    for i, sample in enumerate(samples):  # right padding, the loss on the answer tokens only
        ids = torch.from_numpy(sample.token_ids().astype("int64"))
        mask = torch.from_numpy(sample.mask().astype(bool))
        ids_BT[i, :len(ids)] = ids
        attention_BT[i, :len(ids)] = 1
        labels_BT[i, :len(ids)] = torch.where(mask, ids, -100)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with mixed_precision(torch.device("cpu"), _compute_dtype(precision)):
            loss = model(input_ids=ids_BT, attention_mask=attention_BT, labels=labels_BT).loss
        loss.float().backward()
        optimizer.step()

    return Step(step, optimizer)


def measure_grpo(groups: int, group_size: int, prompt_len: int, steps: int, threads: int,
                 precisions: tuple[str, ...]) -> dict[str, Any]:
    from miles_async.models import ModelConfig
    from miles_async.models.smollm2 import smollm2_checkpoint

    torch.set_num_threads(threads)
    model_dir = str(smollm2_checkpoint())
    samples = grpo_batch(groups, group_size, prompt_len, ModelConfig.from_hf(model_dir).vocab_size)
    tokens = sum(s.num_tokens for s in samples)
    rows: dict[str, Any] = {}
    sides: tuple[tuple[str, Callable[[str], Step]], ...] = (
        ("ours", lambda precision: ours_grpo_step(model_dir, samples, group_size, precision, True)),
        ("ours_unshared", lambda precision: ours_grpo_step(model_dir, samples, group_size, precision, False)),
        ("transformers", lambda precision: transformers_grpo_step(model_dir, samples, precision)))
    for precision in precisions:
        for side, make in sides:
            step = make(precision)
            step_s = _timed_steps(step, steps)
            rows.setdefault(precision, {})[side] = {"step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
                                                    "optimizer": optimizer_settings(step.optimizer)}
            _progress(f"grpo, {precision}, {side}: {tokens / step_s:,.0f} tokens/s ({step_s:.2f} s a step)")
        row = rows[precision]
        row["ratio_ours_over_transformers"] = round(row["transformers"]["step_s"] / row["ours"]["step_s"], 2)
        row["ratio_ours_over_unshared"] = round(row["ours_unshared"]["step_s"] / row["ours"]["step_s"], 2)
    return {
        "bench": "trainer",
        "versions": _versions(),
        "model": {"name": "SmolLM2-135M-Instruct", "folder": model_dir},
        "workload": {"kind": "grpo", "groups": groups, "group_size": group_size, "prompt_len": prompt_len,
                     "answer_len": "8-32, uniform", "tokens_per_step": tokens,
                     "padded_tokens_per_step": len(samples) * max(s.num_tokens for s in samples),
                     "steps": steps, "threads": threads},
        "precisions": rows,
    }


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
            step = make(model_dir, ids_BT, precision)
            step_s = _timed_steps(step, steps)
            rows.setdefault(precision, {})[side] = {
                "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
                "fraction_of_matmul_peak": round(flops / step_s / rates[precision], 3),
                "optimizer": optimizer_settings(step.optimizer)}
            _progress(f"{precision}, {side}: {tokens / step_s:,.0f} tokens/s ({step_s:.2f} s a step)")
        rows[precision]["ratio_ours_over_transformers"] = round(
            rows[precision]["transformers"]["step_s"] / rows[precision]["ours"]["step_s"], 2)
    return {
        "bench": "trainer",
        "versions": _versions(),
        "model": {"name": "SmolLM2-135M-Instruct", "folder": model_dir, "matmul_params": limits.matmul_params(cfg)},
        "workload": {"kind": "random", "batch": batch, "seq_len": seq_len, "tokens_per_step": tokens, "steps": steps,
                     "threads": threads, "flops_per_step": flops},
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
    parser.add_argument("--workload", choices=["random", "grpo"], default="random",
                        help="random: --batch x --seq-len random tokens; grpo: groups sharing a prompt (see above)")
    parser.add_argument("--groups", type=int, default=4, help="grpo: prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="grpo: answers per prompt")
    parser.add_argument("--prompt-len", type=int, default=43,
                        help="grpo: prompt tokens (43: recipes/smollm2-math.toml's, chat template included)")
    args = parser.parse_args(argv)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if not precisions or any(p not in PRECISIONS for p in precisions):
        parser.error(f"--precisions takes {', '.join(PRECISIONS)}, got {args.precisions!r}")
    if min(args.batch, args.seq_len, args.steps, args.threads, args.groups, args.group_size, args.prompt_len) < 1:
        parser.error("--batch, --seq-len, --steps, --threads, --groups, --group-size and --prompt-len must be >= 1")
    from miles_async.models import smollm2

    if (reason := smollm2.unavailable()) is not None:
        raise SystemExit(f"bench trainer measures SmolLM2-135M-Instruct, which is not available: {reason}")
    if args.workload == "grpo":
        result = measure_grpo(args.groups, args.group_size, args.prompt_len, args.steps, args.threads, precisions)
    else:
        result = measure(args.batch, args.seq_len, args.steps, args.threads, precisions)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
