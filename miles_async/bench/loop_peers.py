"""The peer of `miles-async bench loop`: TRL's `GRPOTrainer`, the single-machine GRPO loop users reach for.

`trl_grpo(model_dir, prompt_texts, answers, ...)` trains the model folder that `init_model` writes
with TRL on the same prompts, the same sampling settings, the same group size, prompts per step
and learning rate as our loop, on CPU in fp32 with transformers' `generate` (no vLLM), offline,
and returns its throughput. It runs in a child process (`python -m miles_async.bench.loop_peers
--child SPEC`) so that TRL's imports, threads and global state never reach the caller; the child
writes its result to a JSON file and the parent reads it back, or raises RuntimeError with the
tail of the child's stderr.

How TRL is set up (each setting is one our loop has too; the rest are TRL's defaults, reported in
the result's `config`):
- one optimizer step = `prompts_per_step` prompts x `group_size` samples, generated once for the
  step (per_device_train_batch_size = prompts_per_step * group_size, gradient_accumulation_steps
  = 1, num_iterations = 1, so the PPO ratio is 1 and the step is on-policy, as ours);
- prompts are plain text (a "standard", not conversational, dataset): TRL tokenizes them with the
  tokenizer as they are, adding no chat template (for a chat model the caller passes the prompts
  already rendered with its template: our prompt ids decoded), and decodes completions with
  skip_special_tokens=True; the dataset is read in order (shuffle_dataset=False);
- sampling: temperature, top_p 1, top_k 0 (whole vocabulary), max_completion_length =
  max_new_tokens; generation stops at the tokenizer's EOS and the generation_config's eos ids;
- the reward is our task's checker on the decoded completion against the answer (`reward`:
  "reverse", `miles_async.tasks.reverse.is_correct`; "arithmetic", the number after the first `=`
  of `miles_async.tasks.arithmetic`): 1.0 or 0.0, exactly our task's reward;
- AdamW (betas 0.9/0.999, no weight decay), constant learning rate, no warm-up, grad-norm clip 1.0
  (our trainer's defaults); loss_type "dapo" (token-level mean, TRL's default), beta 0 (no
  reference model), epsilon 0.2; fp32 (or, with `bf16`, TRL's bf16 mixed precision over fp32
  weights, as our trainer's compute_dtype = "bfloat16"), gradient checkpointing off, use_cpu=True.

Timing (time.perf_counter in the child): `step_s[i]` runs from the end of step i-1 to the end of
step i (step 0 from its start), so it holds generation, reward, loss, backward, the optimizer and
TRL's logging. Step 0 is the warm-up: samples_per_s = samples of steps 1.. / their summed time.
`completion_tokens[i]` counts the ids TRL trains on (up to and including the first EOS).

Try it: `python -m miles_async.bench.loop_peers --steps 4 --prompts 8 --group-size 8`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CHILD_TIMEOUT_S = 600.0
STDERR_TAIL_CHARS = 4000
# Keep the child offline and quiet; thread counts are set from num_threads.
_CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
}


def trl_grpo(model_dir: str, prompt_texts: list[str], answers: list[str], *, group_size: int,
             prompts_per_step: int, num_steps: int, max_new_tokens: int, temperature: float, lr: float,
             seed: int, num_threads: int = 1, timeout_s: float = CHILD_TIMEOUT_S, reward: str = "reverse",
             bf16: bool = False) -> dict:
    """Run TRL's GRPOTrainer for `num_steps` steps in a child process and return its measurements.

    Step i uses prompts [i * prompts_per_step, (i + 1) * prompts_per_step) of `prompt_texts`
    (wrapping around when there are fewer), each sampled `group_size` times. Step 0 is a warm-up,
    left out of `samples_per_s`, so `num_steps` must be at least 2. `reward` names our task whose
    checker scores the completions (REWARDS); `bf16` is TRL's mixed precision (fp32 weights).
    """
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {reward!r}")
    _check_args(model_dir, prompt_texts, answers, group_size=group_size, prompts_per_step=prompts_per_step,
                num_steps=num_steps, max_new_tokens=max_new_tokens, temperature=temperature, lr=lr,
                num_threads=num_threads)
    spec = {"model_dir": str(model_dir), "prompt_texts": list(prompt_texts), "answers": list(answers),
            "group_size": group_size, "prompts_per_step": prompts_per_step, "num_steps": num_steps,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "lr": lr, "seed": seed,
            "num_threads": num_threads, "reward": reward, "bf16": bf16}
    with tempfile.TemporaryDirectory(prefix="miles_trl_grpo_") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps({**spec, "out_path": str(out_path), "work_dir": tmp}))
        env = {**os.environ, **_CHILD_ENV, "OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)}
        try:
            done = subprocess.run([sys.executable, "-m", "miles_async.bench.loop_peers", "--child", str(spec_path)],
                                  capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"TRL GRPO child ran past {timeout_s:.0f} s; stderr tail:\n"
                               f"{_tail(exc.stderr)}") from exc
        if done.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"TRL GRPO child failed (exit {done.returncode}); stderr tail:\n{_tail(done.stderr)}")
        return json.loads(out_path.read_text())


def _check_args(model_dir: str, prompt_texts: list[str], answers: list[str], *, group_size: int,
                prompts_per_step: int, num_steps: int, max_new_tokens: int, temperature: float, lr: float,
                num_threads: int) -> None:
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"model_dir {model_dir!r} has no config.json; pass a folder written by init_model")
    if not prompt_texts or len(prompt_texts) != len(answers):
        raise ValueError(f"need one answer per prompt and at least one prompt, got {len(prompt_texts)} prompts "
                         f"and {len(answers)} answers")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (GRPO compares samples within a group), got {group_size}")
    if prompts_per_step < 1 or max_new_tokens < 1 or num_threads < 1:
        raise ValueError(f"prompts_per_step, max_new_tokens and num_threads must be >= 1, got {prompts_per_step}, "
                         f"{max_new_tokens} and {num_threads}")
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (step 0 is a warm-up, not measured), got {num_steps}")
    if not temperature > 0 or not lr > 0:
        raise ValueError(f"temperature and lr must be > 0 (TRL samples), got {temperature} and {lr}")


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-STDERR_TAIL_CHARS:]


# ---------------------------------------------------------------------------------------------------
# The child: everything below imports torch, transformers and TRL.
# ---------------------------------------------------------------------------------------------------


def exact_match_rewards(completions: list[str], answers: list[str], reward: str = "reverse") -> list[float]:
    """Our task's reward for TRL's decoded completions: 1.0 where the task's checker accepts the
    completion ("reverse": `is_correct(completion, answer)`; "arithmetic": the number after the
    first `=` is the answer), else 0.0."""
    check = REWARDS[reward]()
    return [1.0 if check(text, answer) else 0.0 for text, answer in zip(completions, answers, strict=True)]


def _reverse_checker() -> Callable[[str, str], bool]:
    from miles_async.tasks.reverse import is_correct

    return is_correct


def _arithmetic_checker() -> Callable[[str, str], bool]:
    from miles_async.tasks.arithmetic import answer_of

    return lambda text, answer: answer_of(text) == int(answer)


REWARDS: dict[str, Callable[[], Callable[[str, str], bool]]] = {"reverse": _reverse_checker,
                                                                 "arithmetic": _arithmetic_checker}


def _run_child(spec: dict) -> dict:
    """Train with GRPOTrainer as `spec` says and return the measurements (runs in the child)."""
    import torch

    torch.set_num_threads(spec["num_threads"])
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from miles_async.models import load_tokenizer

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    t_setup = time.perf_counter()
    group_size, prompts_per_step = spec["group_size"], spec["prompts_per_step"]
    samples_per_step = group_size * prompts_per_step
    num_prompts = prompts_per_step * spec["num_steps"]
    texts, answers = spec["prompt_texts"], spec["answers"]
    rows = [(texts[i % len(texts)], answers[i % len(texts)]) for i in range(num_prompts)]
    dataset = datasets.Dataset.from_dict({"prompt": [t for t, _ in rows], "answer": [a for _, a in rows]})

    per_step = {"reward_mean": [], "completion_tokens": [], "num_scored": [], "prompts": []}

    def exact_match(prompts: list, completions: list, completion_ids: list, answer: list, **_: object) -> list:
        rewards = exact_match_rewards(completions, answer, spec["reward"])
        per_step["reward_mean"].append(sum(rewards) / len(rewards))
        per_step["completion_tokens"].append(sum(len(ids) for ids in completion_ids))
        per_step["num_scored"].append(len(rewards))
        per_step["prompts"].append(list(prompts))
        return rewards

    step_ends: list[float] = []
    first_begin: list[float] = []
    trl_logs: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not first_begin:
                first_begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                trl_logs.append(dict(logs))

    config = _grpo_config(trl.GRPOConfig, spec, samples_per_step)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[exact_match], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepClock()])
    ours = load_tokenizer(spec["model_dir"])
    same_prompt_ids = all(tokenizer(text)["input_ids"] == list(ours.encode(text)) for text in set(texts))
    checkpointing = bool(getattr(trainer.model, "is_gradient_checkpointing", False))
    setup_s = time.perf_counter() - t_setup
    trainer.train()

    step_s = [end - start for start, end in zip([first_begin[0], *step_ends[:-1]], step_ends)]
    if len(step_s) != spec["num_steps"] or per_step["num_scored"] != [samples_per_step] * spec["num_steps"]:
        raise RuntimeError(f"expected {spec['num_steps']} steps of {samples_per_step} scored samples, got "
                           f"{len(step_s)} steps and {per_step['num_scored']} samples per reward call")
    measured_s = sum(step_s[1:])
    # The prompts TRL scored, step by step, against the ones it was given: each prompt of the step's
    # slice, group_size times in a row (shuffle_dataset=False). False would mean another order.
    step_rows = [rows[i * prompts_per_step:(i + 1) * prompts_per_step] for i in range(spec["num_steps"])]
    expected = [[text for text, _ in step for _ in range(group_size)] for step in step_rows]
    return {
        "peer": "trl.GRPOTrainer",
        "samples_per_s": round(samples_per_step * (len(step_s) - 1) / measured_s, 3),
        "completion_tokens_per_s": round(sum(per_step["completion_tokens"][1:]) / measured_s, 1),
        "samples_per_step": samples_per_step,
        "measured_steps": len(step_s) - 1,
        "step_s": [round(s, 4) for s in step_s],
        "completion_tokens": per_step["completion_tokens"],
        "reward_mean": per_step["reward_mean"],
        "prompts_in_order": per_step["prompts"] == expected,
        "prompt_ids_match_ours": same_prompt_ids,
        "setup_s": round(setup_s, 3),
        "trl_logged": {key: [log[key] for log in trl_logs if key in log]
                       for key in ("reward", "completions/mean_length", "loss", "grad_norm")},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "config": {
            "group_size": group_size, "prompts_per_step": prompts_per_step, "num_steps": spec["num_steps"],
            "max_new_tokens": spec["max_new_tokens"], "temperature": spec["temperature"], "lr": spec["lr"],
            "seed": spec["seed"], "torch_threads": torch.get_num_threads(), "dtype": str(model.dtype),
            "device": str(trainer.accelerator.device), "gradient_checkpointing": checkpointing,
            "loss_type": config.loss_type, "beta": config.beta, "epsilon": config.epsilon,
            "scale_rewards": config.scale_rewards, "optim": _enum_value(config.optim),
            "lr_scheduler_type": _enum_value(config.lr_scheduler_type), "max_grad_norm": config.max_grad_norm,
            "weight_decay": config.weight_decay, "top_p": config.top_p, "top_k": config.top_k,
            "eos_token_ids": list(trainer.eos_token_ids), "generation": "transformers generate (no vLLM)",
            "prompt_format": "plain text as given (a chat template only if the prompts were rendered with one)",
            "bf16": config.bf16, "reward": spec["reward"],
        },
    }


def _enum_value(value: object) -> str:
    return str(getattr(value, "value", value))


def _grpo_config(config_cls: type, spec: dict, samples_per_step: int) -> object:
    # transformers renamed gradient_checkpointing to activation_checkpointing in some releases;
    # TRL defaults it on. Turn off whichever name this version has.
    fields = config_cls.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return config_cls(
        output_dir=str(Path(spec["work_dir"], "trl_out")),
        use_cpu=True,
        bf16=spec.get("bf16", False),
        fp16=False,
        **{checkpointing: False},
        use_vllm=False,
        per_device_train_batch_size=samples_per_step,  # counted in completions: prompts x group
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        num_iterations=1,
        max_steps=spec["num_steps"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="dapo",
        beta=0.0,
        shuffle_dataset=False,
        seed=spec["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _manual_run(argv: list[str] | None) -> dict:
    """`__main__`: a tiny model and reverse-task prompts in a temporary folder, then `trl_grpo`."""
    from miles_async.models import init_model, load_tokenizer
    from miles_async.tasks.reverse import ReverseTaskConfig, prompts

    parser = argparse.ArgumentParser(description="TRL GRPOTrainer on the reverse task, CPU (prints JSON)")
    parser.add_argument("--model-dir", default="", help="a model folder; default: init_model qwen3 tiny")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is a warm-up")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="miles_trl_model_") as tmp:
        model_dir = args.model_dir or str(init_model("qwen3", "tiny", tmp, seed=args.seed))
        task = prompts(ReverseTaskConfig(seed=args.seed), args.prompts * args.steps, load_tokenizer(model_dir))
        return trl_grpo(model_dir, [p.text for p in task], [p.answer for p in task], group_size=args.group_size,
                        prompts_per_step=args.prompts, num_steps=args.steps, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, lr=args.lr, seed=args.seed, num_threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        spec = json.loads(Path(argv[1]).read_text())
        result = _run_child(spec)
        Path(spec["out_path"]).write_text(json.dumps(result))
        return 0
    print(json.dumps(_manual_run(argv), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
