"""`init_model`: write a randomly initialised model and its tokenizer as a Hugging Face folder.

Every command must work on a laptop with nothing downloaded (docs/design.md, "Defaults that must
hold"), so recipes and tests start from a model made here: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with a chat template) and generation_config.json, a
folder that our loader, transformers' AutoModelForCausalLM/AutoTokenizer and SGLang all read.

Weights are drawn as transformers draws them (normal(0, 0.02) for matrices and embeddings, zero
biases, unit norms) from a generator seeded by `seed`, so one seed gives the same bytes.

Try it: `miles-async init-model --family qwen3 --preset tiny --out /tmp/tiny`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_async.models.config import FAMILIES, ModelConfig
from miles_async.models.loading import save_pretrained
from miles_async.models.tokenizer import IM_END, PAD_TOKEN, write_tokenizer
from miles_async.models.transformer import CausalLM, RMSNorm

INIT_STD = 0.02
# Sizes per preset; the vocabulary is the tokenizer's. "tiny" runs the whole RL loop on a laptop
# CPU in seconds; "small" (~3M parameters dense) is for benchmarks that need measurable compute.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    },
    "small": {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 8192,
        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
    },
}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def preset_config(family: str, preset: str, vocab_size: int) -> ModelConfig:
    """The ModelConfig of a preset for one family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    sizes = dict(PRESETS[preset])
    moe = {key: sizes.pop(key) for key in _MOE_KEYS}
    extra: dict[str, Any] = {"tie_word_embeddings": True, "rope_theta": 1_000_000.0}
    if family == "qwen2":
        extra["attention_bias"] = True
    if family in ("qwen3", "qwen3_moe"):
        extra["qk_norm"] = True
    if family == "qwen3_moe":
        extra.update(moe, norm_topk_prob=True, tie_word_embeddings=False)
    return ModelConfig(family=family, vocab_size=vocab_size, **sizes, **extra)


def init_weights(model: CausalLM, seed: int, std: float = INIT_STD) -> None:
    """Fill every parameter in place, reproducibly from `seed` (independent of global RNG state)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def init_model(family: str, preset: str = "tiny", out_dir: str | Path = "models/tiny", seed: int = 0,
               init_std: float = INIT_STD) -> Path:
    """Write a random-init model of `family` and `preset` with its tokenizer into `out_dir`; return it.

    Files already in `out_dir` with the same names are overwritten. `init_std` is the standard
    deviation of the weight matrices: at the usual 0.02 a tiny model's distributions are nearly
    uniform and its greedy output repeats one token; tests that compare outputs use about 0.3.
    """
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    preset_config(family, preset, vocab_size=1)  # refuse a bad family or preset before writing
    folder = Path(out_dir)
    tokenizer = write_tokenizer(folder)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = preset_config(family, preset, vocab_size)
    model = CausalLM(config)
    init_weights(model, seed, init_std)
    pad_id, eos_id = tokenizer.token_to_id(PAD_TOKEN), tokenizer.token_to_id(IM_END)
    token_ids = {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id}
    save_pretrained(model, folder, extra_config=token_ids)
    generation_config = {"eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id, "bos_token_id": None}
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return folder
