"""Recipes: the shipped one loads, overrides apply by dotted path, mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_async.actors.recipe import load_recipe, parse_override

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


def test_the_shipped_recipe_loads_and_overrides_apply():
    config = load_recipe(RECIPE, ["loop.num_steps=7", "rollout.sampling.temperature=0.5", "eval.mode=none",
                                  "loop.mode=sync"])
    assert (config.loop.num_steps, config.rollout.sampling.temperature, config.eval.mode) == (7, 0.5, "none")
    assert config.loop.staleness == 0 and load_recipe(RECIPE).loop.staleness == 2
    assert load_recipe(RECIPE, ["loop.mode=one_step_off"]).loop.staleness == 1
    assert config.task.reward == "miles_async.tasks.reverse:reward"
    assert load_recipe(RECIPE).rollout.refill == "sample"
    assert load_recipe(RECIPE, ["rollout.refill=group"]).rollout.refill == "group"


@pytest.mark.parametrize(("overrides", "message"), [
    (["loop.num_step=3"], "unknown key loop.'num_step'; LoopSection has: mode"),
    (["buffer.capacity=3"], "unknown key buffer.'capacity'"),
    (["nope.x=1"], "unknown key 'nope'"),
    (['loop.num_steps="many"'], r"Expected `int`, got `str` - at `\$.loop.num_steps`"),
    (["loop.mode=turbo"], "loop.mode"),
    (["rollout.refill=batch"], "rollout.refill"),
    (["loop.num_steps"], "must look like key=value"),
    (["loop.num_steps.x=1"], "is a value, not a table"),
    (["eval.mode=command"], "needs eval.command"),
    (["buffer.capacity_groups=4", "loop.batch_groups=8"], "must hold a batch"),
])
def test_mistakes_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(RECIPE, overrides)


def test_a_missing_or_broken_recipe_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[loop\nnum_steps = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_recipe(broken)


def test_override_values_parse_as_toml_or_stay_text():
    assert parse_override("a.b=1e-4") == ("a.b", 1e-4)
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=[1, 2]") == ("a", [1, 2])
    assert parse_override("a=shared") == ("a", "shared")
