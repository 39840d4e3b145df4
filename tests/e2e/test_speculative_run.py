"""The main job with speculative decoding and the draft trained online (recipes/reverse-speculative.toml):
in true on-policy mode the trainer's log-prob of every trained token still equals the engine's bit
for bit (speculation changes nothing the trainer sees), drafts are accepted, the head is trained and
pushed; a recipe that speculates without a draft to train (or the reverse) is refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support_run import SHORT, run_cli

from miles_async.actors.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse-speculative.toml"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_speculating_run_trains_exactly_on_policy_and_its_draft_online(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=4", "loop.mode=sync",
                    "eval.mode=none", "rollout.sampling.max_new_tokens=10", "trainer.batch_invariant=true",
                    "rollout.engine.batch_invariant=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/logprob_abs_diff"] for r in rows] == [0.0] * 4
    assert all(r["train/draft_ce"] > 0 for r in rows)
    assert any(r["rollout/spec_accept_rate"] > 0 for r in rows) and all(r["rollout/spec_accept_length"] >= 1.0 for r in rows)


def test_speculation_and_the_draft_setting_go_together() -> None:
    with pytest.raises(ValueError, match='set trainer.draft = "online"'):
        load_recipe(RECIPE, ["trainer.draft=none"])
    with pytest.raises(ValueError, match="speculative_tokens is 0"):
        load_recipe(RECIPE, ["rollout.engine.speculative_tokens=0"])
    assert load_recipe(RECIPE, ["trainer.draft=frozen"]).trainer.draft == "frozen"
