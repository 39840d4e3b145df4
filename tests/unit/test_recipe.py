"""Recipes: the shipped ones load, overrides apply by dotted path, mistakes name the key and where it was
written, relative paths are taken from the recipe's folder, and a resolved recipe reads back from its TOML."""

from __future__ import annotations

import re
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
    assert config.task.plugin == "miles_async.tasks.reverse:ReverseTask"
    assert load_recipe(RECIPE).scheduler.refill == "sample"
    assert load_recipe(RECIPE, ["scheduler.refill=group"]).scheduler.refill == "group"


@pytest.mark.parametrize(("overrides", "message"), [
    (["loop.num_step=3"], r"unknown key 'loop.num_step' \(did you mean 'loop.num_steps'\?\); LoopConfig has: mode"),
    (["buffer.capacity=3"], "unknown key 'buffer.capacity'"),
    (["nope.x=1"], "unknown key 'nope'"),
    (['loop.num_steps="many"'], r"Expected `int`, got `str` - at `\$.loop.num_steps`"),
    (["loop.mode=turbo"], "loop.mode"),
    (["scheduler.refill=batch"], "scheduler.refill"),
    (["model.pretrained=gpt2"], r"model.pretrained"),
    (["model.pretrained=smollm2", "model.path=/tmp/m"], "both name the model: keep one"),
    (["trainer.compute_dtype=float16"], "compute_dtype must be"),
    (["task.config.alphabet=3"], r"task.config \(miles_async.tasks.reverse:ReverseTask\): Expected `str`"),
    (["task.config.min_length=3"], ("unknown key\\(s\\) task.config.min_length for miles_async.tasks.reverse:ReverseTask "
                                    "\\(did you mean task.config.min_len\\?\\); its Config has: alphabet, min_len")),
    (["task.plugin=miles_async.tasks.reverse:nothing"], "miles_async.tasks.reverse has no 'nothing'"),
    (["task.plugin=miles_async.tasks.reverse:prompts"], "is not a task class"),
    (["task.plugin=miles_async.tasks.calculator:CalculatorTask"], "multi-turn: it needs \\[agent\\]"),
    (["loop.num_steps"], "must look like key=value"),
    (["loop.num_steps.x=1"], "is a value, not a table"),
    (["eval.mode=command"], "needs eval.command"),
    (["buffer.capacity_groups=4", "loop.batch_groups=8"], "must hold a batch"),
    (['teacher.path="runs/x/final_model"'], r"\[teacher\] names a model but trainer.policy_loss.distill_coef is 0"),
    (["trainer.policy_loss.distill_coef=0.5"], "distill_coef is 0.5 but no teacher scores the samples"),
    (["trainer.policy_loss.distill_mode=forward"], "Invalid enum value .forward. - at `\\$.trainer.policy_loss.distill_mode`"),
    (['teacher.path="a"', 'teacher.pretrained="smollm2"'], "both name the teacher: keep one"),
    (['teacher.path="a"', "trainer.policy_loss.distill_coef=1", "teacher.max_in_flight=0"],
     "teacher.max_in_flight must be >= 1"),
    (["trainer.advantage.reward_coef=0"], 'buffer.filter = "nonzero_std" drops every group'),
    (["loop.offload_engines=true"], 'it needs loop.mode = "sync"'),
    (["loop.offload_engines=true", "loop.mode=sync", "weights.transport=shm"], "shared memory cannot be released"),
    (["trainer.policy_loss.mis_band=[1.5, 2.0]"], "mis_band must be"),
    (["rollout.engine.weight_format=int8"], "rollout.engine.weight_format"),
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


@pytest.mark.parametrize(("key", "source"), [
    ("buffer.max_staleness=1", "loop.mode / loop.max_staleness"),
    ("scheduler.max_staleness=1", "loop.mode / loop.max_staleness"),
    ("scheduler.batch_groups=2", "loop.batch_groups"),
    ("trainer.model_dir=x", "model.path"),
    ("trainer.temperature=0.5", "rollout.sampling.temperature"),
    ("weights.family=qwen3", "the model's config.json"),
    ("weights.pause_mode=abort", "rollout.partial"),
    ("rollout.engine.shared_weights=true", 'weights.transport = "shm"'),
])
def test_a_setting_the_run_derives_is_refused_naming_its_source(key, source):
    """No setting is silently overridden: a field the run sets from elsewhere cannot be set too."""
    with pytest.raises(ValueError, match=f"is set by the run from {re.escape(source)}"):
        load_recipe(RECIPE, [key])


def test_every_default_is_the_components_own():
    """A recipe section is the component's config struct: no second set of defaults."""
    from miles_async.actors.weights import WeightSyncConfig
    from miles_async.engine.core import EngineConfig
    from miles_async.policies.buffer import BufferConfig
    from miles_async.policies.refill import RefillConfig
    from miles_async.trainer.config import TrainerConfig

    config = load_recipe(None)
    assert config.trainer == TrainerConfig() and config.scheduler == RefillConfig()
    assert config.buffer == BufferConfig() and config.weights == WeightSyncConfig(transport="auto")
    assert config.rollout.engine == EngineConfig()


def test_true_on_policy_dtype_and_engine_features_are_reachable():
    config = load_recipe(RECIPE, ["trainer.batch_invariant=true", "rollout.engine.batch_invariant=true",
                                  "trainer.dtype=bfloat16", "rollout.engine.dtype=bfloat16"])
    assert config.trainer.batch_invariant and config.rollout.engine.batch_invariant
    assert (config.trainer.dtype, config.rollout.engine.dtype) == ("bfloat16", "bfloat16")


def test_the_word_none_sets_an_optional_field_to_none_and_stays_a_word_for_text_fields():
    config = load_recipe(RECIPE, ["trainer.policy_loss.tis_cap=none", "trainer.policy_loss.dual_clip_c=none",
                                  "rollout.engine.weight_format=none"])
    assert config.trainer.policy_loss.tis_cap is None and config.trainer.policy_loss.dual_clip_c is None
    assert config.rollout.engine.weight_format == "none"
    assert load_recipe(RECIPE).trainer.policy_loss.tis_cap == 2.0


def test_offloaded_engines_get_a_transport_that_can_refill_them():
    from miles_async.actors.fleet import resolve_transport

    assert resolve_transport(load_recipe(RECIPE, ["loop.mode=sync"])) == "shm"
    assert resolve_transport(load_recipe(RECIPE, ["loop.mode=sync", "loop.offload_engines=true"])) == "stream"


def test_colocated_is_refused_when_the_recipe_loads():
    with pytest.raises(ValueError, match='"colocated" hands the weights over inside one process'):
        load_recipe(RECIPE, ["weights.transport=colocated"])


def test_the_distillation_recipe_loads_with_its_teacher():
    config = load_recipe(RECIPE.with_name("distill-reverse.toml"))
    assert config.teacher.enabled and config.teacher.path == "runs/reverse/final_model"
    assert config.trainer.policy_loss.distill_coef == 1.0 and config.trainer.advantage.reward_coef == 0.0
    assert config.buffer.filter == "none" and config.rollout.sampling.temperature == 1.0
    assert not load_recipe(RECIPE).teacher.enabled


def test_the_lora_recipe_loads_and_the_engines_get_the_trainers_adapters():
    config = load_recipe(RECIPE.with_name("reverse-lora.toml"))
    assert config.trainer.lora.rank == 16 and config.trainer.lora.scale == 2.0 and config.sft.max_steps == 0
    assert config.model.path == "runs/reverse/sft_model"
    with pytest.raises(ValueError, match="rollout.engine.lora is set by the run from trainer.lora"):
        load_recipe(RECIPE, ["rollout.engine.lora.rank=4"])


def test_a_quantized_engine_with_lora_is_refused_when_the_recipe_loads():
    # The engine refuses the pair; the recipe must say so before a process starts (it once got as far
    # as the engines' start, a traceback and exit status 1).
    with pytest.raises(ValueError, match="weight_format = 'int4' with LoRA is not supported"):
        load_recipe(RECIPE, ["rollout.engine.weight_format=int4", "trainer.lora.rank=8"])
    assert load_recipe(RECIPE, ["rollout.engine.weight_format=int4"]).rollout.engine.weight_format == "int4"


def test_the_calculator_recipe_loads_as_a_multi_turn_task():
    config = load_recipe(RECIPE.with_name("calculator.toml"))
    assert config.task.plugin.endswith(":CalculatorTask") and config.agent.agent
    with pytest.raises(ValueError, match="only with a multi-turn task"):
        load_recipe(RECIPE, ["agent.agent=miles_async.tasks.calculator:agent",
                             "agent.environment=miles_async.tasks.calculator:CalculatorEnv"])


def test_the_resolved_recipe_holds_the_tasks_config(tmp_path):
    from miles_async.actors.recipe import dump_recipe

    tree = dump_recipe(load_recipe(RECIPE))
    assert tree["task"]["config"]["alphabet"] == "fgjkmpqv" and tree["task"]["config"]["min_len"] == 4



def test_a_bad_value_is_blamed_on_the_command_line_or_on_the_file(tmp_path):
    with pytest.raises(ValueError) as raised:
        load_recipe(RECIPE, ["loop.mode=sync", "loop.num_steps=abc"])
    assert str(raised.value) == "command line: loop.num_steps=abc: Expected `int`, got `str` - at `$.loop.num_steps`"
    with pytest.raises(ValueError, match=r"^command line: loop.batch_groups=100: buffer.capacity_groups \(64\) must hold"):
        load_recipe(RECIPE, ["loop.batch_groups=100"])  # a cross-check that only the override breaks
    with pytest.raises(ValueError, match=r"^command line: nope=1: unknown key 'nope'"):
        load_recipe(None, ["nope=1"])
    broken = tmp_path / "broken.toml"
    broken.write_text('[loop]\nnum_steps = "many"\n')
    for overrides in ([], ["loop.mode=sync"]):  # an override elsewhere does not take the blame
        with pytest.raises(ValueError, match=f"^recipe {re.escape(str(broken))}: Expected `int`, got `str`"):
            load_recipe(broken, overrides)
    with pytest.raises(ValueError, match="^command line: loop.num_steps=x: Expected `int`"):
        load_recipe(broken, ["loop.num_steps=x"])  # the override replaced the file's value: its own is wrong
    with pytest.raises(ValueError, match="^command line: nope=1: unknown key 'nope'"):
        load_recipe(broken, ["nope=1"])
    small = tmp_path / "small.toml"
    small.write_text("[buffer]\ncapacity_groups = 4\n")
    with pytest.raises(ValueError, match=re.escape(f"recipe {small} with loop.batch_groups=6: buffer.capacity_groups "
                                                   "(4) must hold a batch (loop.batch_groups = 6)")):
        load_recipe(small, ["loop.batch_groups=6"])  # both take part: both are named


def test_unknown_keys_get_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"unknown key 'rollout.sampling.temprature' \(did you mean "
                                         r"'rollout.sampling.temperature'\?\)"):
        load_recipe(RECIPE, ["rollout.sampling.temprature=0.5"])
    with pytest.raises(ValueError, match=r"unknown key 'xyzzy'; RunConfig has"):  # nothing close: no guess
        load_recipe(RECIPE, ["xyzzy=1"])


def test_relative_paths_come_from_the_recipes_folder_and_the_command_lines_from_the_working_directory(
        tmp_path, monkeypatch):
    from miles_async.actors.sft import load_sft_recipe

    (tmp_path / "recipes" / "data").mkdir(parents=True)
    (tmp_path / "recipes" / "data" / "pairs.jsonl").write_text("")
    recipe = tmp_path / "recipes" / "sft.toml"
    recipe.write_text('[model]\npath = "Org/name"\n[data]\npath = "data/pairs.jsonl"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_sft_recipe(recipe)
    assert loaded.data.path == str(tmp_path / "recipes" / "data" / "pairs.jsonl")
    assert loaded.model.path == "Org/name"  # nothing of that name beside the recipe: a Hub id, kept as written
    (elsewhere / "mine.jsonl").write_text("")
    assert load_sft_recipe(recipe, ["data.path=mine.jsonl"]).data.path == str(elsewhere / "mine.jsonl")
    assert load_sft_recipe(recipe, ["data.path=gone.jsonl"]).data.path == "gone.jsonl"  # its reader names it
    config = load_recipe(RECIPE.with_name("reverse-lora.toml"))
    assert config.model.path == "runs/reverse/sft_model"  # another run's output: from the working directory


def test_the_dry_run_toml_of_every_shipped_recipe_reads_back_the_same(tmp_path):
    from miles_async.actors.recipe import dump_recipe, dump_recipe_toml
    from miles_async.actors.sft import load_sft_recipe, sft_recipe_toml

    loaded = 0
    for path in sorted(RECIPE.parent.glob("*.toml")):
        again = tmp_path / path.name
        if path.name.startswith("sft-"):
            sft = load_sft_recipe(path, ["trainer.policy_loss.tis_cap=none"])
            again.write_text(sft_recipe_toml(sft))
            assert load_sft_recipe(again) == sft
            continue
        try:
            config = load_recipe(path, ["trainer.policy_loss.tis_cap=none"])  # a None that is not the default
        except ValueError as e:  # an environment that is not installed here (openenv, verifiers)
            assert "install" in str(e) or "cannot import" in str(e), e
            continue
        again.write_text(dump_recipe_toml(config))
        assert dump_recipe(load_recipe(again)) == dump_recipe(config), path.name
        loaded += 1
    assert loaded >= 5
