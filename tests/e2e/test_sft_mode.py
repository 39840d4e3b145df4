"""`miles-async sft`: supervised fine-tuning end to end on the tiny model (a trainer rank process),
the Hugging Face folder it ends in, and a resume equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _support_run import run_cli
from safetensors.torch import load_file

from miles_async.models import init_model, load_pretrained, load_tokenizer
from miles_async.tasks.reverse import ReverseTaskConfig, prompts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def write_recipe(tmp_path: Path, count: int = 48) -> Path:
    """Raw pairs of the main job's task, for the tiny model the recipe makes under the run folder."""
    tokenizer = load_tokenizer(init_model("qwen3", "tiny", tmp_path / "tok"))
    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.text, "response": p.answer}) + "\n"
                            for p in prompts(ReverseTaskConfig(), count, tokenizer)))
    recipe = tmp_path / "sft.toml"
    recipe.write_text(f'[data]\npath = "{data}"\nchat_template = false\n'
                      "[loop]\nbatch_size = 8\nlr = 1e-3\ncheckpoint_every_s = 0\n"
                      "[trainer]\nmicro_batch_tokens = 64\n")
    return recipe


@pytest.mark.timeout(300)
def test_sft_trains_checkpoints_and_writes_a_model_folder(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    out = tmp_path / "run"
    proc = run_cli(["sft", str(recipe), "--out", str(out), "--quiet", "loop.epochs=2", "loop.checkpoint_every=4",
                    "loop.keep_checkpoints=2", "data.num_heldout=8", "loop.eval_every=5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # 40 examples to train on (8 held out), 2 epochs of batches of 8
    assert summary["num_steps"] == 10 and summary["num_examples"] == 40 and summary["left_out"] == 0
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["heldout_loss_last"] < summary["heldout_loss_first"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(11)) and rows[-1]["train/epoch"] == 2.0
    assert [r["step"] for r in rows if "eval/heldout_loss" in r] == [0, 5, 10]
    assert all(r["train/num_samples"] == 8 and r["perf/tokens_per_s"] > 0 for r in rows[1:])
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000008", "step_00000010"]  # every 4 steps and at the end, the newest 2
    model = load_pretrained(out / "final_model")  # a folder RL recipes start from (model.path)
    assert load_tokenizer(out / "final_model").eos_token_id is not None
    start = load_pretrained(out / "model")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.state_dict().values()))


@pytest.mark.timeout(300)
def test_a_resumed_sft_run_ends_with_the_uninterrupted_runs_weights(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, count=24)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_cli(["sft", str(recipe), "--out", str(straight), "--quiet", "loop.max_steps=6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(["sft", str(recipe), "--out", str(resumed), "--quiet", "loop.max_steps=3"])  # stops at 3
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(["sft", str(recipe), "--out", str(resumed), "--quiet", "--resume", "loop.max_steps=6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["resumed_from"].endswith("step_00000003")
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    straight_rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in straight_rows]
    a, b = (load_file(str(run / "final_model" / "model.safetensors")) for run in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_refuses_a_missing_data_file_before_starting_anything(tmp_path: Path) -> None:
    recipe = tmp_path / "sft.toml"
    recipe.write_text(f'[data]\npath = "{tmp_path / "none.jsonl"}"\n')
    proc = run_cli(["sft", str(recipe), "--out", str(tmp_path / "run")], timeout_s=60)
    assert proc.returncode == 2 and "the run cannot start: data.path" in proc.stderr and "is not a file" in proc.stderr
    assert "Traceback" not in proc.stderr
