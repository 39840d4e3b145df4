"""The model configuration, read from and written to a Hugging Face `config.json`.

`ModelConfig` holds what our compact implementations need and nothing else; `from_hf` accepts
both the transformers 4.x layout (`rope_theta` + `rope_scaling`, `num_experts`) and the 5.x one
(`rope_parameters`, `num_local_experts`), and refuses, with a ValueError naming the field, what the
models here do not implement (sliding-window attention, a non-SiLU activation, a RoPE type other
than default/linear/llama3/yarn). `to_hf` writes the 4.x layout, which transformers 4.51+ and 5.x
and SGLang all read.

Try it: `python -c "from miles_async.models import ModelConfig; print(ModelConfig.from_hf('DIR'))"`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# "dynamic" (NTK) rescales the frequencies with the longest sequence seen so far, a state that
# would make one token's logits depend on what else ran before it; "longrope" needs per-dim
# factors of its own. Neither is used by the families here, so both are refused, by name.
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
_ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The shape and numerics of one decoder-only model (field names are Hugging Face's).

    family: "llama" | "qwen2" | "qwen3" | "qwen3_moe" (the checkpoint's `model_type`).
    head_dim: per-head width; Hugging Face's default is hidden_size // num_attention_heads.
    rope_scaling: None for plain RoPE, else a dict with "rope_type" in ROPE_TYPES and its keys.
    attention_bias: biases on q/k/v (qwen2 always; o_proj has one too for llama/qwen3 when set).
    mlp_bias: biases on gate/up/down (llama only).
    qk_norm: a per-head RMSNorm on q and k before RoPE (qwen3, qwen3_moe).
    num_experts .. mlp_only_layers: the MoE block (qwen3_moe); layer i is sparse when
        num_experts > 0, i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _check_rope_scaling(self.rope_scaling)
        # These follow from the family in transformers' code; a config saying otherwise would be
        # written to config.json and read back as a different model.
        if self.qk_norm != (self.family in ("qwen3", "qwen3_moe")):
            raise ValueError(f"qk_norm must be {not self.qk_norm} for family {self.family!r}")
        if self.family == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: attention_bias must be True")
        if self.mlp_bias and self.family != "llama":
            raise ValueError(f"mlp_bias is a llama option; {self.family!r} has no MLP biases")
        if self.family == "qwen3_moe":
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"qwen3_moe needs 0 < num_experts_per_tok <= num_experts, got "
                    f"{self.num_experts_per_tok} and {self.num_experts}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError(
                    f"qwen3_moe needs moe_intermediate_size > 0 and decoder_sparse_step > 0, got "
                    f"{self.moe_intermediate_size} and {self.decoder_sparse_step}"
                )

    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3_moe" and self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Hugging Face's rule for which decoder layers carry a sparse MoE block."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """The decoder layers with a MoE block, in order: the L axis of routed-expert tensors."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of a routed-expert record (R3), or None for a dense model."""
        return (len(self.moe_layer_indices), self.num_experts_per_tok) if self.is_moe else None

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config: a checkpoint folder, a config.json path, or its dict."""
        hf = _read_hf_dict(path_or_dict)
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ValueError(
                f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}"
            )
        _refuse_unsupported(hf)
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _read_rope(hf)
        fields: dict[str, Any] = {
            "family": family,
            "vocab_size": int(hf["vocab_size"]),
            "hidden_size": int(hf["hidden_size"]),
            "intermediate_size": int(hf["intermediate_size"]),
            "num_hidden_layers": int(hf["num_hidden_layers"]),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(hf.get("num_key_value_heads") or num_heads),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v always carry biases, whatever the config says.
            "attention_bias": True if family == "qwen2" else bool(hf.get("attention_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qk_norm": family in ("qwen3", "qwen3_moe"),
        }
        if family == "qwen3_moe":
            fields.update(
                num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
            )
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """This config as a transformers config.json dict (token ids are the caller's to add)."""
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
        }
        if self.family == "llama":
            hf.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        else:
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        if self.family in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.attention_bias
        if self.family == "qwen3_moe":
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
                router_aux_loss_coef=0.001,
            )
        return hf


def _read_hf_dict(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no Hugging Face config at {path}: pass a checkpoint folder with a config.json")
    return json.loads(path.read_text())


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: the models here implement SwiGLU with 'silu'")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError(
            "sliding-window attention (use_sliding_window / layer_types 'sliding_attention') is not "
            "supported; set use_sliding_window to false"
        )


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout; rope_scaling is None for plain RoPE."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in params:  # the key's pre-4.45 name
        params.setdefault("rope_type", params.pop("type"))
    rope_type = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1.0)")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    return theta, params


def _check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if rope_scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}")
