"""A Verifiers environment in the loop (miles_async/agents/verifiers.py), from `.venv-verifiers`.

Verifiers 0.4 cannot share `.venv` (it pins mcp 2.0, OpenEnv 0.10 wants mcp < 2), so it has an
environment of its own, `python3 dev.py verifiers`, with the calculator environment the tests ship
(tests/data/verifiers_calc) installed. These tests run there in subprocesses: the adapter's unit
tests, and recipes/verifiers-calculator.toml shortened through the real CLI, whose episodes run the
environment's harness, tool and rubric against the TITO session server and the embedded engine, and
whose samples are trained. Without `.venv-verifiers` they skip, naming the command.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from miles_async.observe import SampleTrace, decode_trace

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-verifiers"
RECIPE = ROOT / "recipes" / "verifiers-calculator.toml"
# A few seconds of work: groups of 4, batches of 2 groups, short outputs, one evaluation at the end
# (sampled: a greedy tiny model often ends on an empty reply, which the rubric scores 0). Synchronous
# and batch-invariant, so that the trainer's log-prob of every trained token must equal the engine's
# bit for bit: it does only if each sample holds exactly the tokens the engine sampled (TITO).
SHORT = ["task.num_prompts=64", "loop.num_steps=3", "loop.batch_groups=2", "scheduler.group_size=4",
         "scheduler.target_in_flight=16", "buffer.filter=none", "rollout.sampling.max_new_tokens=8", "eval.every=3",
         "eval.num_prompts=4", "eval.temperature=1.0", "loop.mode=sync", "trainer.batch_invariant=true",
         "rollout.engine.batch_invariant=true", "sft.max_steps=3", "sft.probe_every=3", "sft.num_probe=4",
         "sft.target_accuracy=2.0"]  # three warm-start steps on the environment's demonstrations
# The calculator's rubric (verifiers_calc.CalcTask): correct 1.0 + answered 0.25. Our side adds nothing.
RUBRIC_REWARDS = {0.0, 0.25, 1.0, 1.25}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=(
    f"no {VENV.name}: run `python3 dev.py verifiers` (Verifiers 0.4 cannot share .venv: it pins mcp 2.0)"))]


@pytest.mark.timeout(150)
def test_the_adapters_unit_tests_pass_where_verifiers_is_installed():
    proc = subprocess.run([str(VENV / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/unit/test_verifiers_adapter.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=140, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    closing = proc.stdout.strip().splitlines()[-1]
    assert " passed" in closing and "1 skipped" in closing, closing  # only the no-Verifiers test skips


@pytest.mark.timeout(150)
def test_a_verifiers_environment_trains_in_the_loop(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([str(VENV / "bin" / "miles-async"), "run", str(RECIPE), "--out", str(out), "--quiet",
                           *SHORT], cwd=tmp_path, capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_steps"] == 3 and summary["sft_steps"] == 3 and len(summary["eval_scores"]) == 1
    assert 0.0 <= summary["eval_scores"][0][1] <= 1.25  # the evaluator's episodes, scored by the rubric too
    samples = [r for r in decode_trace(out / "trace.jsonl") if isinstance(r, SampleTrace)]
    # Episodes ran to the end (none failed), each a conversation the session server recorded.
    odd = [s for s in samples if s.finish_reason not in ("stop", "length") or s.output_tokens == 0]
    assert samples and not odd, odd[:3]
    # The rewards are the rubric's: a random policy answers (0.25), and is almost never right.
    assert {s.reward for s in samples} <= RUBRIC_REWARDS and any(s.reward == 0.25 for s in samples)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["train/num_samples"] == 8 for m in metrics)
    # TITO: the trainer scored exactly the tokens the engine sampled (SHORT says why this is exact).
    assert all(m["train/num_tokens"] > 0 for m in metrics) and [m["train/logprob_abs_diff"] for m in metrics] == [0.0] * 3
