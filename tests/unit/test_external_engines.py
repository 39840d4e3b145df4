"""What a run needs of an external engine before any server starts: the recipe's choices and refusals,
the transport "auto" picks, vLLM's command line and environment, the untied view of a tied model,
and the reading of vLLM's completion choices. The real server: tests/e2e/test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_async.actors.external import EMBED, LM_HEAD, _write_lm_head, untied_view
from miles_async.actors.fleet import resolve_transport
from miles_async.actors.recipe import load_recipe
from miles_async.engine.vllm import (
    PYTHON_ENV,
    VllmServer,
    VllmUnavailable,
    check_model,
    find_python,
    parse_completion,
)
from miles_async.models import init_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


def test_auto_picks_shared_memory_for_embedded_engines_and_files_for_vllm():
    assert resolve_transport(load_recipe(RECIPE)) == "shm"
    assert resolve_transport(load_recipe(RECIPE, ["rollout.backend=vllm"])) == "disk"
    assert resolve_transport(load_recipe(RECIPE, ["rollout.backend=sglang"])) == "disk"
    assert resolve_transport(load_recipe(RECIPE, ["placement.engines=[1]"])) == "stream"
    assert resolve_transport(load_recipe(RECIPE, ["weights.transport=broadcast"])) == "broadcast"


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.backend=vllm", "weights.transport=shm"], 'weights.transport = "shm" cannot reach a vllm server'),
    (["rollout.backend=vllm", 'rollout.server.url="http://h:1"', "rollout.num_engines=2"],
     "attaches to one running server, but rollout.num_engines is 2"),
    (["rollout.server.kv_cache_mib=0"], "kv_cache_mib must be >= 1"),
    (["rollout.backend=tgi"], "rollout.backend"),
])
def test_the_recipe_refuses_what_an_external_engine_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(RECIPE, overrides)


def test_vllm_runs_on_the_cores_it_is_given(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.touch()
    model = init_model("qwen3", "tiny", tmp_path / "m", seed=0)
    server = VllmServer(model, port=8123, python=python, threads=2, kv_cache_bytes=2**25, api_key="k")
    argv = server.argv()
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2**25)
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs" and "--api-key" in argv
    assert server.env is not None
    assert (server.env["OMP_NUM_THREADS"], server.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "nobind")
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and server.env["VLLM_SERVER_DEV_MODE"] == "1"
    bound = VllmServer(model, port=8123, python=python, cpus="0-1")
    assert bound.env is not None and bound.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "OMP_NUM_THREADS" not in bound.env


def test_a_model_vllm_cannot_run_on_cpu_is_refused_naming_the_head_size(tmp_path):
    model = init_model("qwen3", "tiny", tmp_path / "m", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    with pytest.raises(ValueError, match="head_dim 16 is not one vLLM's CPU attention supports"):
        check_model(model)


def test_without_a_vllm_environment_the_error_names_the_setup_command(monkeypatch, tmp_path):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("miles_async.engine.vllm.VENV", ".venv-vllm-nowhere")
    with pytest.raises(VllmUnavailable, match="python3 dev.py vllm"):
        find_python()
    monkeypatch.setenv(PYTHON_ENV, "/opt/vllm/bin/python")
    assert find_python() == Path("/opt/vllm/bin/python")


def test_the_untied_view_carries_the_output_projection_as_a_tensor_of_its_own(tmp_path):
    model = init_model("qwen3", "tiny", tmp_path / "m", seed=0)
    view = untied_view(model, tmp_path / "view")
    assert json.loads((view / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True  # the original is untouched
    embed = load_file(model / "model.safetensors")[EMBED]
    assert torch.equal(load_file(view / "lm_head.safetensors")[LM_HEAD], embed)
    assert (view / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    update = tmp_path / "full_v00000001" / "model.safetensors"
    update.parent.mkdir()
    (update).write_bytes((model / "model.safetensors").read_bytes())
    _write_lm_head(update)
    assert torch.equal(load_file(update.parent / "lm_head.safetensors")[LM_HEAD], embed)


def test_a_completion_choice_becomes_an_engine_output():
    choice = {"text": "ab", "token_ids": [7, 8], "finish_reason": "length", "prompt_token_ids": [1, 2, 3],
              "logprobs": {"token_logprobs": [-0.5, -1.25], "tokens": ["a", "b"], "top_logprobs": None}}
    out = parse_completion(choice, version=4)
    assert (out.output_ids, out.output_logprobs, out.finish_reason, out.text, out.prompt_tokens) == (
        [7, 8], [-0.5, -1.25], "length", "ab", 3)
    assert [(s.version, s.start, s.end) for s in out.weight_versions] == [(4, 0, 2)]
    with pytest.raises(ValueError, match="2 token ids but 0 log-probs"):
        parse_completion({**choice, "logprobs": None}, version=4)
