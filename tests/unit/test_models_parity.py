"""Our models against transformers' own: tiny random models built and saved by transformers, loaded
by `load_pretrained`, must give the same logits (fp32, within 1e-4) for every family, tied or
untied, single-file or sharded, with each RoPE scaling type we accept. MoE routing is checked
against transformers' router, and captured experts replay exactly.

Tensor names: B batch, T tokens, V vocab, L MoE layers, k experts per token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_async.models import load_pretrained, read_state_dict

transformers = pytest.importorskip("transformers", reason="parity tests need the dev extra's transformers")

TOL = 1e-4
VOCAB = 128
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def hf_config(family: str, **overrides):
    if family == "llama":
        return transformers.LlamaConfig(**COMMON, **overrides)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, **overrides)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=16, **overrides)
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    return transformers.Qwen3MoeConfig(**COMMON, head_dim=16, **{**moe, **overrides})


def save_hf_model(folder: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Build a random model with transformers, perturb its norms and biases (they start at 1 and 0,
    which would hide a missing or misplaced one), save it and return it."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(torch.randn_like(param) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf")
    return {family: (root / family, save_hf_model(root / family, family)) for family in FAMILIES}


def batch_ids(seed: int = 1, shape: tuple[int, int] = (3, 19)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def assert_parity(folder: Path, hf_model: torch.nn.Module, ids_BT: torch.Tensor | None = None) -> None:
    ids_BT = batch_ids() if ids_BT is None else ids_BT
    ours = load_pretrained(folder)
    with torch.no_grad():
        expected_BTV = hf_model(ids_BT).logits
        got_BTV = ours(ids_BT)
    assert got_BTV.shape == expected_BTV.shape == (*ids_BT.shape, hf_model.config.vocab_size)
    torch.testing.assert_close(got_BTV, expected_BTV, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(saved, family: str) -> None:
    folder, hf_model = saved[family]
    assert_parity(folder, hf_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_separate_samples(saved, family: str) -> None:
    model = load_pretrained(saved[family][0])
    first_T, second_T = batch_ids(2, (1, 7)), batch_ids(3, (1, 12))
    packed_1T = torch.cat([first_T, second_T], dim=1)
    positions_1T = torch.cat([torch.arange(7), torch.arange(12)])[None]
    with torch.no_grad():
        packed_1TV = model(packed_1T, positions_1T)
        separate_TV = torch.cat([model(first_T)[0], model(second_T)[0]])
    torch.testing.assert_close(packed_1TV[0], separate_TV, atol=1e-5, rtol=0)
    # Without the restart the second sample would see the first: the logits must differ.
    with torch.no_grad():
        unpacked_1TV = model(packed_1T)
    assert not torch.allclose(unpacked_1TV[0, 7:], separate_TV[7:], atol=1e-3)


def test_tied_embeddings(tmp_path) -> None:
    hf_model = save_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_state_dict(tmp_path)
    assert_parity(tmp_path, hf_model)
    ours = load_pretrained(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_sharded_checkpoint(tmp_path) -> None:
    hf_model = save_hf_model(tmp_path, "qwen3", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    assert_parity(tmp_path, hf_model)


@pytest.mark.parametrize(
    ("family", "rope_parameters"),
    [
        ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}),
        (
            "llama",
            {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0,
            },
        ),
        ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}),
    ],
    ids=["linear", "llama3", "yarn"],
)
def test_rope_scaling_matches(tmp_path, family: str, rope_parameters: dict) -> None:
    hf_model = save_hf_model(tmp_path, family, rope_parameters=rope_parameters)
    assert_parity(tmp_path, hf_model, batch_ids(4, (2, 80)))


def test_moe_routing_matches_transformers_router(saved) -> None:
    folder, hf_model = saved["qwen3_moe"]
    model = load_pretrained(folder)
    ids_BT = batch_ids()
    with torch.no_grad():
        _, experts_LBTk = model(ids_BT, return_routed_experts=True)
        router_logits = hf_model(ids_BT, output_router_logits=True).router_logits
    assert experts_LBTk.shape == (2, *ids_BT.shape, 2) and experts_LBTk.dtype == torch.int64
    for layer, logits_ME in enumerate(router_logits):
        expected_Mk = torch.topk(logits_ME.softmax(-1), 2, dim=-1).indices
        assert torch.equal(experts_LBTk[layer].reshape(-1, 2), expected_Mk)


def test_moe_replay(saved) -> None:
    model = load_pretrained(saved["qwen3_moe"][0])
    ids_BT = batch_ids()
    with torch.no_grad():
        logits_BTV, experts_LBTk = model(ids_BT, return_routed_experts=True)
        replayed_BTV = model(ids_BT, routed_experts=experts_LBTk.to(torch.int32))
        # (e + 1) mod E keeps the k experts of a token distinct, and changes every one of them.
        other_LBTk = (experts_LBTk + 1) % model.config.num_experts
        changed_BTV, used_LBTk = model(ids_BT, routed_experts=other_LBTk, return_routed_experts=True)
    assert torch.equal(replayed_BTV, logits_BTV)
    assert torch.equal(used_LBTk, other_LBTk)
    assert (changed_BTV - logits_BTV).abs().max() > 1e-3


def test_moe_replay_trains_the_router(saved) -> None:
    # R3 replays the experts but keeps their weights a function of the router, so it still learns.
    model = load_pretrained(saved["qwen3_moe"][0])
    ids_BT = batch_ids()
    with torch.no_grad():
        _, experts_LBTk = model(ids_BT, return_routed_experts=True)
    model(ids_BT, routed_experts=experts_LBTk).logsumexp(-1).sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_bfloat16_load_is_close(saved) -> None:
    folder, _ = saved["qwen3"]
    ids_BT = batch_ids()
    with torch.no_grad():
        fp32_BTV = load_pretrained(folder)(ids_BT)
        model = load_pretrained(folder, dtype=torch.bfloat16)
        bf16_BTV = model(ids_BT)
    assert model.lm_head.weight.dtype == torch.bfloat16 and bf16_BTV.dtype == torch.bfloat16
    torch.testing.assert_close(bf16_BTV.float(), fp32_BTV, atol=0.05, rtol=0.05)


def test_fused_expert_layout_loads(saved, tmp_path) -> None:
    # transformers 5 holds experts fused in memory ([E, 2F, D] gate+up, [E, D, F] down); a checkpoint
    # written that way must load to the same model.
    from safetensors.torch import save_file

    folder, hf_model = saved["qwen3_moe"]
    tensors = read_state_dict(folder)
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = tensor
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
             for e in range(8)]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    assert_parity(tmp_path, hf_model)
