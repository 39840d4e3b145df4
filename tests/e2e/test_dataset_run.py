"""The dataset task through the real CLI: the GPU recipe checked with `--dry-run` against a Hugging Face
cache holding its model and its data, a bad dataset input refused before anything is written, and
the CPU recipe (SmolLM2 on the shipped word problems) trained for two steps.

The cache (HF_HOME under tmp_path, HF_HUB_OFFLINE=1) holds `Qwen/Qwen3-0.6B` as the tiny random
qwen3 of `init_model` (tests/unit/_support_hub.py: huggingface_hub's layout) and `openai/gsm8k`
(subset main) as rows in GSM8K's format (tests/unit/_support_datasets.py: datasets' layout), so
the real huggingface_hub and datasets resolve both as they would offline on a machine that has
downloaded them. The tiny model stands in for Qwen3-0.6B at the boundary the dry run is not about
(its weights); its tokenizer renders the prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_async.models import init_model, smollm2
from tests.unit._support_datasets import place_hub_dataset
from tests.unit._support_hub import place_in_hub_cache

pytestmark = pytest.mark.slow
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GSM8K_ROWS = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?",
               "answer": f"Tom has {i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1}"}
              for i in range(80)]


def cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_async.launch.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s, check=False)


@pytest.mark.timeout(120)
def test_the_gpu_recipe_dry_runs_against_a_hub_cache(tmp_path: Path) -> None:
    home = tmp_path / "hf-home"
    place_in_hub_cache(home / "hub", "Qwen/Qwen3-0.6B", init_model("qwen3", "tiny", tmp_path / "tiny", seed=0))
    place_hub_dataset(home, "openai/gsm8k", "main", {"train": GSM8K_ROWS[:60], "test": GSM8K_ROWS[60:]})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    done = cli(["run", str(RECIPES / "gsm8k-qwen3-0.6b.toml"), "--dry-run", "--out", str(out)], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not out.exists()
    printed = done.stdout
    assert 'path = "Qwen/Qwen3-0.6B"' in printed and 'plugin = "dataset"' in printed
    assert 'path = "openai/gsm8k"' in printed and 'eval_split = "test"' in printed
    assert "enable_thinking = false" in printed
    # A subset the cache does not hold: one line, status 2, nothing written.
    bad = cli(["run", str(RECIPES / "gsm8k-qwen3-0.6b.toml"), "--out", str(out), 'task.config.name="socratic"'], env)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "task.config.path 'openai/gsm8k' (name 'socratic', split 'train')" in bad.stderr
    assert "Traceback" not in bad.stderr and not out.exists()


@pytest.mark.timeout(120)
def test_bad_dataset_inputs_stop_the_run_before_it_writes(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2?"}) + "\n")
    recipe = tmp_path / "mine.toml"  # the tiny model the run makes; a dataset beside the recipe
    recipe.write_text('[task]\nplugin = "dataset"\nnum_prompts = 10\n[task.config]\npath = "rows.jsonl"\n'
                      "[sft]\nmax_steps = 0\n")
    out = tmp_path / "run"
    start, line = "the run cannot start: ", 'command line: task.config.reward="exat": '  # the pre-flight's; the recipe's
    for overrides, message in [
        ([], f"{start}{rows}:2: the row has no 'answer' (task.config.label_key); it has: prompt"),
        ([f'task.config.path="{tmp_path}/nope.jsonl"'], f"{start}task.config.path '{tmp_path}/nope.jsonl' does not"),
        (['task.config.reward="exat"'], (f"{line}task.config (dataset): task.config.reward 'exat' is not a reward (did "
                                        "you mean 'exact'?)")),
    ]:
        done = cli(["run", str(recipe), "--out", str(out), *overrides])
        assert done.returncode == 2, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"miles-async run: {message}"), done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert not out.exists()


@pytest.mark.timeout(300)
def test_the_cpu_recipe_trains_smollm2_on_the_word_problems(tmp_path: Path) -> None:
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    out = tmp_path / "run"
    done = cli(["run", str(RECIPES / "smollm2-word-problems.toml"), "--out", str(out), "--quiet", "loop.num_steps=2",
                "eval.every=2", "eval.num_prompts=8", "loop.batch_groups=2", "scheduler.group_size=4",
                "scheduler.target_in_flight=8", "buffer.filter=none", "rollout.sampling.max_new_tokens=24"],
               timeout_s=280)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_steps"] == 2 and [s for s, _ in summary["eval_scores"]] == [0, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/num_samples"] == 8 for r in rows)
    # the rewards came from math-verify in the rollout worker's threads: real scores, none failed
    samples = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()
               if '"kind":"sample"' in line]
    assert samples and all(s["finish_reason"] in ("stop", "length") and s["reward"] in (0.0, 1.0) for s in samples)
