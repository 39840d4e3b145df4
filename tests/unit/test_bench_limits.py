"""miles_async/bench/limits.py: the weights a step multiplies and reads, counted on the model's modules, match
the hand formula and the checkpoint's own tensors; the bounds divide them by the measured rates."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from miles_async.bench import limits
from miles_async.models import ModelConfig, init_model


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def folder(request, tmp_path_factory):
    return init_model(request.param, "tiny", tmp_path_factory.mktemp(request.param))


def test_matmul_params_match_the_hand_formula(folder):
    cfg = ModelConfig.from_hf(folder)
    h, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = h * d * (2 * heads + 2 * kv)
    per_layer = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):  # the router, and the k experts a token goes to
            per_layer.append(attention + h * cfg.num_experts + 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok)
        else:
            per_layer.append(attention + 3 * h * cfg.intermediate_size)
    assert limits.matmul_params(cfg) == sum(per_layer) + cfg.vocab_size * h


def test_weight_bytes_read_are_the_checkpoints_tensors_but_the_untied_embedding(folder):
    cfg = ModelConfig.from_hf(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    total = sum(torch.Size(shape).numel() for name, shape in sizes.items()
                if name != "model.embed_tokens.weight" or cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        total -= torch.Size(sizes.get("lm_head.weight", [0])).numel()  # a tied copy, if written, is one tensor
    assert limits.weight_bytes_read(cfg, 2) == 2 * total


def test_decode_step_bounds_divide_bytes_by_traffic_and_flops_by_the_matmul_rate(folder):
    cfg = ModelConfig.from_hf(folder)
    bandwidth = {"copied_bytes_per_s": 1e9, "traffic_bytes_per_s": 2e9}
    bounds = limits.decode_step_bounds(cfg, batch=4, context=10, dtype=torch.float32, bandwidth=bandwidth,
                                       flops_per_s=1e10)
    assert bounds["weight_bytes"] == limits.weight_bytes_read(cfg, 4)
    assert bounds["weight_streaming_bound_s"] == pytest.approx(bounds["weight_bytes"] / 2e9)
    expected_flops = 2 * limits.matmul_params(cfg) * 4 + 4 * cfg.num_hidden_layers * 4 * 10 * cfg.num_attention_heads * cfg.head_dim
    assert bounds["flops"] == expected_flops
    assert bounds["compute_bound_s"] == pytest.approx(expected_flops / 1e10)


def test_the_rates_are_measured_and_positive():
    copy = limits.copy_bandwidth(mib=8, repeats=2)
    assert copy["traffic_bytes_per_s"] == pytest.approx(2 * copy["copied_bytes_per_s"]) and copy["copied_bytes_per_s"] > 0
    assert limits.matmul_rate(torch.float32, n=128, repeats=2) > 0
