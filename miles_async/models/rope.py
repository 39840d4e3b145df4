"""Rotary position embeddings, computed the way transformers computes them (so logits match).

Inverse frequencies are computed once, in float32, for the RoPE types `ModelConfig` accepts
(default, linear, llama3, yarn); cos/sin are computed per call from the positions, in float32,
then cast to the activations' dtype, exactly as transformers' `*RotaryEmbedding.forward` does.

Tensor names (STYLE rule 10): B batch, T tokens, N heads (query or kv), H head dim, F = H / 2.

Try it: `Rotary(config)(positions_BT, dtype)` returns the (cos_BTH, sin_BTH) pair to hand to
`apply_rotary`.
"""

from __future__ import annotations

import math

import torch

from miles_async.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq_F in float32, attention scaling applied to cos and sin) for the config's RoPE."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq_F = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq_F, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq_F / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq_F, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported")  # ModelConfig refuses it first


def _llama3(inv_freq_F: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled_F = torch.where(wavelen_F > low_freq_wavelen, inv_freq_F / factor, inv_freq_F)
    smooth_F = (old_context_len / wavelen_F - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_F = (1 - smooth_F) * scaled_F / factor + smooth_F * scaled_F
    is_medium_F = ~(wavelen_F < high_freq_wavelen) * ~(wavelen_F > low_freq_wavelen)
    return torch.where(is_medium_F, smoothed_F, scaled_F)


def _yarn(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp below divides by high - low
    pos_freqs_F = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    ramp_F = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_F = 1 - ramp_F
    inv_freq_F = (1.0 / (factor * pos_freqs_F)) * (1 - extrapolation_F) + (1.0 / pos_freqs_F) * extrapolation_F
    return inv_freq_F, float(attention_factor)


class Rotary:
    """cos/sin tables for arbitrary positions; holds only float32 frequencies (never cast by .to())."""

    def __init__(self, config: ModelConfig) -> None:
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            self.inv_freq_F, self.attention_scaling = inverse_frequencies(config)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions_BT.device
        inv_freq_F = self._on_device.get(device)
        if inv_freq_F is None:
            inv_freq_F = self._on_device[device] = self.inv_freq_F.to(device)
        freqs_BTF = positions_BT[..., None].to(torch.float32) * inv_freq_F
        emb_BTH = torch.cat((freqs_BTF, freqs_BTF), dim=-1)
        cos_BTH = emb_BTH.cos() * self.attention_scaling
        sin_BTH = emb_BTH.sin() * self.attention_scaling
        return cos_BTH.to(dtype), sin_BTH.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x_BTNH: torch.Tensor, cos_BTH: torch.Tensor, sin_BTH: torch.Tensor) -> torch.Tensor:
    """Rotate q or k (heads on axis 2) by the positions' angles."""
    cos_BT1H, sin_BT1H = cos_BTH.unsqueeze(2), sin_BTH.unsqueeze(2)
    return x_BTNH * cos_BT1H + _rotate_half(x_BTNH) * sin_BT1H
